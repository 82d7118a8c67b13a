"""`python -m t5x_like.train` and the `t5x-like-train` command: t5x_like/cli/train.py, after the
signals are watched (importing it takes about a second)."""

from t5x_like.training import runtime


def main() -> None:
  previous = runtime.leave_on_early_signals()
  try:
    from t5x_like.cli.train import cli  # jax and the rest: the slow imports

    cli()
  finally:  # the run is over: a late signal is not one "before the first iteration"
    runtime.restore_signals(previous)


if __name__ == '__main__':
  main()
