"""`python -m t5x_like.watch`: the command is t5x_like/cli/watch.py."""

import sys

from t5x_like.cli.watch import main

if __name__ == '__main__':
  sys.exit(main())
