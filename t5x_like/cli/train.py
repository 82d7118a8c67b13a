"""`python -m t5x_like.train`: train from a config file or gin files.

  python -m t5x_like.train --config configs/tiny.py --workdir DIR [--config.train.steps=N ...]
  python -m t5x_like.train --gin_file configs/tiny.gin --workdir DIR
      [--gin_bindings 'train.steps=N']

Several processes (multi-host): under SLURM (`srun`, one task per GPU) they find each other by
themselves; any other launcher passes `--coordinator_address HOST:PORT --num_processes N
--process_id I` to every process (distributed.py).

A workdir that already holds checkpoints resumes from the latest complete one. Exit codes
(runtime.py): 0 finished (or stopped by the kill switch), 1 crashed or a checkpoint could not be
written, 2 bad config, checkpoint, data or a workdir in use, 3 saved before a time limit or on
SIGTERM/SIGINT/SIGUSR1/SIGHUP (or stopped by one before training began): requeue to continue, 4 no
progress for runtime.hang_timeout_mins (stacks printed): requeue to resume from the last
checkpoint, 5 diverged (non-finite iterations): fix, then rerun.
"""

from __future__ import annotations

import argparse
import os
import sys

# First, so that runtime.exit_duration_mins counts from process start.
from t5x_like.training import runtime  # isort: skip
from t5x_like.cli.config_arguments import add_config_arguments, config_from_arguments
from t5x_like.config import Config, ConfigError
from t5x_like.mesh import distributed
from t5x_like.training import startup
from t5x_like.training import workdir as workdir_lib


def parse_args(argv: list[str]) -> tuple[Config, str]:
  """Parses the command line into a validated Config and the workdir (no JAX involved)."""
  cfg, workdir, _ = parse_command_line(argv)
  return cfg, workdir


def parse_command_line(argv: list[str]) -> tuple[Config, str, distributed.ProcessGroup]:
  """The validated Config, the workdir and this process's process group (no JAX involved)."""
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.train',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_config_arguments(parser)
  parser.add_argument('--workdir', required=True, help='where checkpoints and logs go')
  parser.add_argument(
    '--coordinator_address',
    help='HOST:PORT of process 0 (multi-process '
    'runs outside SLURM; with --num_processes and --process_id)',
  )
  parser.add_argument('--num_processes', type=int, help='processes in the run')
  parser.add_argument('--process_id', type=int, help='this process, 0 to num_processes - 1')
  args, rest = parser.parse_known_args(argv)
  cfg = config_from_arguments(args, rest)
  workdir_lib.resolve(args.workdir)  # an empty --workdir (unset $WORKDIR) is refused now
  group = distributed.from_flags_or_environment(
    args.coordinator_address, args.num_processes, args.process_id
  )
  return startup.check_config(cfg), args.workdir, group


def main(argv: list[str] | None = None) -> int:
  try:
    cfg, workdir, group = parse_command_line(sys.argv[1:] if argv is None else argv)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return runtime.ExitCode.BAD_INPUT
  if runtime.kill_switch_present(cfg.runtime.kill_switch_path):
    # Every job of an array that starts after the switch was set leaves at once, untouched.
    print(
      f'> kill switch {cfg.runtime.kill_switch_path} exists: exiting without training '
      '(remove the file to train)',
      flush=True,
    )
    return runtime.ExitCode.FINISHED
  # From here on SIGTERM, SIGINT, SIGUSR1 and SIGHUP end the process at once until the loop
  # starts (runtime.Interrupted), and stop it at an iteration boundary after a save from then on.
  stop = runtime.StopConditions(
    cfg.runtime.kill_switch_path, cfg.runtime.exit_duration_mins, num_processes=group.num_processes
  )
  try:
    with stop:
      return _train(cfg, workdir, group, stop, command_line=argv is None)
  except runtime.Interrupted as e:
    if argv is None:
      # The console script: start-up can leave native work running (XLA's dispatched
      # computations, TensorFlow's half-done import), under which the interpreter's teardown
      # crashed (exit 139 instead of 3). Nothing is left to save or close.
      runtime.leave_now(f'> stopped: {e}')
    print(f'> stopped: {e}', file=sys.stderr, flush=True)
    return runtime.ExitCode.REQUEUE


def _train(
  cfg: Config,
  workdir: str,
  group: distributed.ProcessGroup,
  stop: runtime.StopConditions,
  command_line: bool = False,
) -> int:
  # JAX starts only once the config is known to be good.
  from t5x_like.checkpointing.checkpoints import CheckpointError, SaveError
  from t5x_like.data.indexed import DataError
  from t5x_like.training.trainer import Trainer

  try:
    # Before the Trainer: joining the other processes must precede any JAX backend.
    distributed.initialize(group, cfg.mesh.num_devices)
    distributed.check_same_run(cfg.to_json(), workdir)
    trainer = Trainer(cfg, workdir)
    if trainer.cfg.eval.harness_tasks:
      register_harness(trainer)
    trainer.run(stop)
  except (ConfigError, CheckpointError, DataError) as e:
    print(f'error: {e}', file=sys.stderr)
    return runtime.ExitCode.BAD_INPUT
  except SaveError as e:
    if command_line:
      # Orbax's writer threads are still unwinding the same failure and print tracebacks of it
      # as they go; the process's own stderr gets the one message, and cli() leaves at once.
      sys.stderr.flush()
      message_fd = os.dup(2)
      os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
      os.write(message_fd, f'error: {e}\n'.encode())
    else:
      print(f'error: {e}', file=sys.stderr, flush=True)
    return runtime.ExitCode.CRASHED
  return runtime.exit_code(trainer.stop_reason)


def register_harness(trainer) -> None:
  """eval.harness_tasks: the harness evaluation on the trainer's hooks; a bad task name or
  tokenizer ends the run before it starts (the workdir unchanged)."""
  from t5x_like.inference.harness_evaluation import HarnessEvaluator

  try:
    HarnessEvaluator(trainer).register(trainer.hooks)
  except BaseException:
    trainer.release()
    raise


def cli() -> None:
  """The console script: after a failed save, Orbax's writer threads are still unwinding; the
  process leaves without waiting for them."""
  code = main()
  if code == runtime.ExitCode.CRASHED:
    runtime.leave_now(code=runtime.ExitCode.CRASHED)
  sys.exit(code)


if __name__ == '__main__':
  cli()
