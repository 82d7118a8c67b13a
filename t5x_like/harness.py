"""`python -m t5x_like.harness`: the command is t5x_like/cli/harness.py."""

import sys

from t5x_like.cli.harness import main

if __name__ == '__main__':
  sys.exit(main())
