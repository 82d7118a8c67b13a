"""`python -m t5x_like.plot`: the command is t5x_like/cli/plot.py."""

import sys

from t5x_like.cli.plot import main

if __name__ == '__main__':
  sys.exit(main())
