"""`python -m t5x_like.data`: the command is t5x_like/cli/data.py."""

import sys

from t5x_like.cli.data import main

sys.exit(main())
