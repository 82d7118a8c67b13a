"""`python -m t5x_like.generate`: the command is t5x_like/cli/generate.py."""

import sys

from t5x_like.cli.generate import main

if __name__ == '__main__':
  sys.exit(main())
