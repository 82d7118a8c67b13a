"""`python -m t5x_like.from_megatron`: the command is t5x_like/cli/from_megatron.py."""

import sys

from t5x_like.cli.from_megatron import main

if __name__ == '__main__':
  sys.exit(main())
