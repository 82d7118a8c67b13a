"""Alerts outside the log: `runtime.alert_command` runs when something needs an operator.

The chronicles watched their runs with a cron job that mailed the team when the job was no longer
in SLURM's queue, and found everything else (a loss spike, a slow GPU, a hang, drifted LayerNorm
copies) by reading logs and TensorBoard, hours or days later. Here the trainer runs a shell
command of the user's choice on each such event, with what happened in its environment:

  T5X_LIKE_EVENT      spike | slowdown | replica_mismatch | hang | crashed | stopped | finished
                      | diverged (and stale, from t5x_like.watch)
  T5X_LIKE_MESSAGE    the line the log got (first line of it)
  T5X_LIKE_ITERATION  the iteration it happened at ('' when none applies)
  T5X_LIKE_WORKDIR    the run's workdir
  T5X_LIKE_PROCESS    the JAX process index that sent it

for example `runtime.alert_command='mail -s "$T5X_LIKE_EVENT: $T5X_LIKE_MESSAGE" me@lab.org
</dev/null'`, or a `curl` to a chat webhook. The command runs in the background, in its own
session: a slow mail server never delays training, and an alert sent on a hang outlives the
process that sent it. Its output goes to WORKDIR/logs/alerts.log. A job killed outright (a node
lost, `scancel -9`) cannot send anything; for that, see `t5x_like.watch`.
"""

from __future__ import annotations

import os
import subprocess

from t5x_like.training import runtime

# The trainer's events; `stale` comes from t5x_like.watch, which also sends `stopped`.
EVENTS = (
  'spike',
  'slowdown',
  'replica_mismatch',
  'hang',
  'crashed',
  'stopped',
  'finished',
  'diverged',
  'stale',
  'harness_failed',  # an eval.harness_tasks evaluation failed (the run goes on)
)


class Alerts:
  """Sends events through `command` ('' = none). Events of the whole run (all but a replica
  mismatch, which each process finds on its own devices) are sent by process 0 only: a hang or an
  end seen by 384 processes is one alert."""

  PER_PROCESS = ('replica_mismatch',)

  def __init__(self, command: str, workdir: str, process_index: int = 0):
    self.command = command
    self.workdir = workdir
    self.process_index = process_index
    self.log_path = os.path.join(workdir, 'logs', 'alerts.log')
    self._running: list[subprocess.Popen] = []

  def send(self, event: str, message: str, iteration: int | None = None) -> None:
    if event not in EVENTS:
      raise ValueError(f'unknown alert event {event!r}; one of {EVENTS}')
    if not self.command or (self.process_index != 0 and event not in self.PER_PROCESS):
      return
    self._running = [p for p in self._running if p.poll() is None]  # reap the finished ones
    env = dict(
      os.environ,
      T5X_LIKE_EVENT=event,
      T5X_LIKE_MESSAGE=message.strip().splitlines()[0] if message.strip() else '',
      T5X_LIKE_ITERATION='' if iteration is None else str(iteration),
      T5X_LIKE_WORKDIR=self.workdir,
      T5X_LIKE_PROCESS=str(self.process_index),
    )
    os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
    with open(self.log_path, 'ab') as log:
      log.write(
        f'> alert {event} at iteration {env["T5X_LIKE_ITERATION"] or "-"}: '
        f'{env["T5X_LIKE_MESSAGE"]}\n'.encode()
      )
      log.flush()
      try:
        self._running.append(
          subprocess.Popen(  # pylint: disable=consider-using-with
            self.command,
            shell=True,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
          )
        )
      except OSError as e:  # no shell, no fork: the run itself goes on
        log.write(f'> alert command could not start: {e}\n'.encode())

  def wait(self, timeout_s: float = 10.0) -> None:
    """Gives the commands still running a moment to finish (at the end of a run)."""
    for p in self._running:
      try:
        p.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        pass  # it goes on in its own session
    self._running = []


def end_hook(alerts: Alerts):
  """A hook (hooks.Hooks.at_end and on_stop) after the end line: 'finished' or 'stopped' with
  that line (info.message); a diverged run already sent 'diverged'."""

  def send_end(info) -> None:
    if info.stop_reason is not runtime.StopReason.DIVERGED:
      alerts.send(
        'finished' if info.stop_reason is None else 'stopped', info.message, info.iteration
      )

  return send_end
