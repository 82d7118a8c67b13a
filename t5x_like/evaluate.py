"""`python -m t5x_like.evaluate`: the command is t5x_like/cli/evaluate.py."""

import sys

from t5x_like.cli.evaluate import main

if __name__ == '__main__':
  sys.exit(main())
