"""`python -m t5x_like.plan`: the command is t5x_like/cli/plan.py."""

import sys

from t5x_like.cli.plan import main

if __name__ == '__main__':
  sys.exit(main())
