"""`python -m t5x_like.train`: the command is t5x_like/cli/train.py."""

from t5x_like.cli.train import cli

if __name__ == '__main__':
  cli()
