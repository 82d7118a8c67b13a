"""`python -m t5x_like.data`: see `t5x_like/data/cli.py`."""

import sys

from t5x_like.data.cli import main

sys.exit(main())
