"""`python -m t5x_like.devices`: the command is t5x_like/cli/devices.py."""

import sys

from t5x_like.cli.devices import main

if __name__ == '__main__':
  sys.exit(main())
