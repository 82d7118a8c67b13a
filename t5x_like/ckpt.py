"""`python -m t5x_like.ckpt`: the command is t5x_like/cli/ckpt.py."""

import sys

from t5x_like.cli.ckpt import main

if __name__ == '__main__':
  sys.exit(main())
