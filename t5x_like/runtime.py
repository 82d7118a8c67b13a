"""Leaving a run cleanly: exit codes, the kill switch, the wall-clock limit, SIGTERM and SIGUSR1.

A job array resubmits a job until the run is done; the exit code tells it which case it is in:

  0  FINISHED     training reached its end, or the kill switch stopped it (saved first): do not
                  requeue. A run that finds the kill switch at start-up exits 0 without work.
  1  (crash)      an uncaught exception; the traceback says why. The last checkpoint is intact.
  2  BAD_INPUT    a bad config, command line or checkpoint; one message on stderr. Fix, then rerun.
  3  REQUEUE      saved before runtime.exit_duration_mins, or on SIGTERM / SIGUSR1 (SLURM's time
                  limit and `--signal=USR1@SECONDS` pre-timeout warning): requeue me to continue.

Every condition is checked at an iteration boundary, and in a multi-process run all processes stop
at the same iteration: each process's reason is all-gathered and the strongest one wins, so no
process enters the save while another enters the next step (a hang).
"""

from __future__ import annotations

import enum
import os
import signal
import time

import numpy as np

# The wall-clock limit counts from process start (JAX start-up and compilation included), as
# Megatron's --exit-duration-in-mins does; importing this module early marks that moment.
PROCESS_START = time.monotonic()


def _now() -> float:
  return time.monotonic()


class ExitCode(enum.IntEnum):
  FINISHED = 0
  BAD_INPUT = 2
  REQUEUE = 3


class StopReason(enum.IntEnum):
  """Why a run stops early; a larger value wins when processes disagree."""
  TIME_LIMIT = 1
  SIGNAL = 2
  KILL_SWITCH = 3  # An operator's decision to stop beats "requeue me".

  @property
  def exit_code(self) -> ExitCode:
    return ExitCode.FINISHED if self is StopReason.KILL_SWITCH else ExitCode.REQUEUE


def exit_code(reason: StopReason | None) -> ExitCode:
  return ExitCode.FINISHED if reason is None else reason.exit_code


def kill_switch_present(path: str) -> bool:
  return bool(path) and os.path.exists(path)


class StopConditions:
  """Watches the kill switch, the wall clock and the signals; a context manager for the handlers.

  `poll()`, called at every iteration boundary, says whether to stop before the next iteration.
  The next iteration is expected to last as long as the previous one did (boundary to boundary,
  so data, logging and saves count; the first one includes compilation, which errs on the early
  side), and the limit is never knowingly crossed.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

  def __init__(self, kill_switch_path: str = '', exit_duration_mins: float = 0.0,
               start: float | None = None, num_processes: int = 1):
    self.kill_switch_path = kill_switch_path
    self.limit_s = exit_duration_mins * 60.0
    self.start = PROCESS_START if start is None else start
    self.num_processes = num_processes
    self.received: int | None = None  # the signal number, once one arrived
    self.last_iteration_s = 0.0
    self._last_poll: float | None = None
    self._previous = {}

  def __enter__(self) -> StopConditions:
    for sig in self.SIGNALS:
      self._previous[sig] = signal.signal(sig, self._on_signal)
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()

  def _on_signal(self, signum, frame) -> None:
    # Only a flag: the loop saves at the next iteration boundary, outside the handler.
    self.received = signum

  def elapsed_s(self) -> float:
    return _now() - self.start

  def local_reason(self) -> StopReason | None:
    if kill_switch_present(self.kill_switch_path):
      return StopReason.KILL_SWITCH
    if self.received is not None:
      return StopReason.SIGNAL
    if self.limit_s > 0 and self.elapsed_s() + self.last_iteration_s > self.limit_s:
      return StopReason.TIME_LIMIT
    return None

  def poll(self) -> StopReason | None:
    """The reason to stop now, the same on every process."""
    now = _now()
    if self._last_poll is not None:
      self.last_iteration_s = now - self._last_poll
    self._last_poll = now
    reason = self.local_reason()
    if self.num_processes == 1:
      return reason
    from jax.experimental import multihost_utils
    codes = multihost_utils.process_allgather(np.int32(reason or 0))
    strongest = int(np.max(codes))
    return StopReason(strongest) if strongest else None

  def describe(self, reason: StopReason) -> str:
    if reason is StopReason.KILL_SWITCH:
      return f'kill switch {self.kill_switch_path} exists'
    if reason is StopReason.SIGNAL:
      name = signal.Signals(self.received).name if self.received else 'a signal on another process'
      return f'received {name}'
    return (f'{self.elapsed_s() / 60:.2f} of runtime.exit_duration_mins={self.limit_s / 60:g} '
            'minutes used')
