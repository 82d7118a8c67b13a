"""Leaving a run cleanly: exit codes, the kill switch, the wall-clock limit, SIGTERM, SIGUSR1 and
SIGHUP.

A job array resubmits a job until the run is done; the exit code tells it which case it is in:

  0  FINISHED     training reached its end, or the kill switch stopped it (saved first): do not
                  requeue. A run that finds the kill switch at start-up exits 0 without work.
  1  CRASHED      an uncaught exception; the traceback says why. Or a checkpoint that could not
                  be written (a full disk): one message. The last complete checkpoint is intact.
  2  BAD_INPUT    a bad config, command line or checkpoint; one message on stderr. Fix, then rerun.
  3  REQUEUE      saved before runtime.exit_duration_mins, or on SIGTERM / SIGUSR1 (SLURM's time
                  limit and `--signal=USR1@SECONDS` pre-timeout warning) / SIGHUP (the terminal
                  or ssh session of an interactive run closed): requeue me to continue.
  3  (also)       SIGTERM, SIGINT, SIGUSR1 or SIGHUP before the first iteration (start-up, data
                  preparation, restore, compilation): the process leaves at once, nothing to
                  save; the last checkpoint is intact.
  4  HUNG         no progress for runtime.hang_timeout_mins (a collective that never completes,
                  a stuck save): every thread's Python stack was printed, then the process left
                  without saving. Requeue to resume from the last checkpoint.
  5  DIVERGED     runtime.max_consecutive_nan non-finite iterations in a row, or non-finite
                  params at a save: the state of the last finite iteration was kept (saved
                  unless it already was, never a non-finite one). Do not requeue: roll back,
                  skip the data, lower the learning rate or reset the optimizer first.

SIGUSR2 prints every thread's Python stack to stderr and training goes on: with `scancel
--signal=USR2 JOBID` every task of a job says where it is, the diagnosis the chronicles made by
hand with py-spy when one rank hung in a collective.

Every condition is checked at an iteration boundary, and in a multi-process run all processes stop
at the same iteration: each process's reason is all-gathered and the strongest one wins, so no
process enters the save while another enters the next step (a hang).
"""

from __future__ import annotations

import contextlib
import enum
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, NoReturn

import numpy as np

# The wall-clock limit counts from process start (JAX start-up and compilation included), as
# Megatron's --exit-duration-in-mins does; importing this module early marks that moment.
PROCESS_START = time.monotonic()


def now() -> float:
  """The clock the limits and the watchdog read (tests put a stand-in in its place)."""
  return time.monotonic()


class ExitCode(enum.IntEnum):
  FINISHED = 0
  CRASHED = 1
  BAD_INPUT = 2
  REQUEUE = 3
  HUNG = 4
  DIVERGED = 5


class Interrupted(BaseException):
  """SIGTERM, SIGINT or SIGUSR1 before the training loop started (start-up, data preparation,
  restore, compilation): there is nothing to save, so the process leaves at once with exit code
  3. A BaseException, as KeyboardInterrupt is: no `except Exception` on the way takes it for a
  crash."""

  def __init__(self, signum: int):
    self.signum = signum
    super().__init__(
      f'received {signal.Signals(signum).name} before the first iteration of this '
      'job: nothing was trained, the last checkpoint is intact; exit code '
      f'{int(ExitCode.REQUEUE)} (REQUEUE)'
    )


class StopReason(enum.IntEnum):
  """Why a run stops early; a larger value wins when processes disagree."""

  TIME_LIMIT = 1
  SIGNAL = 2
  KILL_SWITCH = 3  # An operator's decision to stop beats "requeue me".
  # runtime.max_consecutive_nan non-finite iterations in a row, or params that are not finite.
  # Every process sees the same losses, so every process decides it at the same iteration.
  DIVERGED = 4

  @property
  def exit_code(self) -> ExitCode:
    return {StopReason.KILL_SWITCH: ExitCode.FINISHED, StopReason.DIVERGED: ExitCode.DIVERGED}.get(
      self, ExitCode.REQUEUE
    )


def exit_code(reason: StopReason | None) -> ExitCode:
  return ExitCode.FINISHED if reason is None else reason.exit_code


def kill_switch_present(path: str) -> bool:
  return bool(path) and os.path.exists(path)


def detach_from_terminal() -> None:
  """Silences stdout and stderr where they are a terminal: after SIGHUP the terminal is gone and
  every write to it fails (EIO), which would crash the save that SIGHUP asks for."""
  for stream in (sys.stdout, sys.stderr):
    try:
      if os.isatty(stream.fileno()):
        silence(stream)
    except (OSError, ValueError, AttributeError):
      continue  # closed, or not a file (a test's capture)


def silence(stream) -> None:
  """Points `stream`'s file descriptor at /dev/null, dropping what it still buffers."""
  with contextlib.suppress(OSError, ValueError):
    stream.flush()
  try:
    fd = stream.fileno()
  except (OSError, ValueError, AttributeError):
    return
  devnull = os.open(os.devnull, os.O_WRONLY)
  try:
    os.dup2(devnull, fd)
  finally:
    os.close(devnull)
  with contextlib.suppress(OSError, ValueError):
    stream.flush()  # the lines that failed to reach the terminal go to /dev/null now


def kill_switch_note(path: str) -> str:
  """The log line of a run that the kill switch `path`, present at start-up, ends at once."""
  return f'> kill switch {path} exists: exiting without training (remove the file to train)'


def stop_conditions(rt, stop: StopConditions | None, num_processes: int):
  """What a run watches, as a context manager: `stop` (entered by the caller), or when None its
  own StopConditions from the config's `runtime` section `rt`."""
  if stop is not None:
    return _caught_by_the_caller(stop)
  return StopConditions(rt.kill_switch_path, rt.exit_duration_mins, num_processes=num_processes)


@contextlib.contextmanager
def _caught_by_the_caller(stop: StopConditions):
  """`stop` as a context manager that tells it when an Interrupted leaves the block: the run's
  cleanup (an alert command, up to 10 s) is under way, not a start-up that went on."""
  try:
    yield stop
  except Interrupted:
    stop.interrupt_seen()
    raise


def leave_now(message: str = '', code: ExitCode = ExitCode.REQUEUE) -> NoReturn:
  """Prints `message` (if any) on stderr and ends the process with `code` once its output is
  flushed: no save, no atexit or finalizers, which may wait on the work a signal interrupted
  (or a failed save's writer threads), and no interpreter teardown under native work."""
  sys.stdout.flush()
  if message:
    print(message, file=sys.stderr)
  sys.stderr.flush()
  os._exit(int(code))


def leave_on_early_signals() -> dict[signal.Signals, Any]:
  """Until StopConditions takes them over, SIGTERM, SIGINT, SIGUSR1 and SIGHUP end the process
  with exit code 3 and the start-up line: the trainer command spends about a second importing
  before it can watch them, and the default action (exit 143, no line) would say nothing. A
  signal the parent left ignored (nohup's SIGHUP, a background job's SIGINT) stays ignored.
  Returns the handlers it replaced, for restore_signals."""

  def leave(signum, frame) -> None:
    leave_now(f'> stopped: {Interrupted(signum)}')

  previous = {}
  for sig in StopConditions.SIGNALS:
    if signal.getsignal(sig) != signal.SIG_IGN:
      previous[sig] = signal.signal(sig, leave)
  return previous


def restore_signals(previous: dict[signal.Signals, Any]) -> None:
  """The handlers leave_on_early_signals replaced, again."""
  for sig, handler in previous.items():
    signal.signal(sig, handler)


class StopConditions:
  """Watches the kill switch, the wall clock and the signals; a context manager for the handlers.

  `poll()`, called at every iteration boundary, says whether to stop before the next iteration.
  The next iteration is expected to last as long as the previous one did (boundary to boundary,
  so data, logging and saves count; the first one includes compilation, which errs on the early
  side), and the limit is never knowingly crossed.
  """

  # SIGHUP: the terminal of an interactive run closed. Unless it is ignored (`nohup`), it is
  # SIGTERM's case, and what the process prints goes nowhere from then on (the log file has it).
  SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
  # Before training, a signal raises Interrupted in the main thread; if that thread is inside a
  # long native call (an XLA compilation), Python runs no handler until it returns, so after this
  # long the process leaves from a watcher thread instead.
  FORCE_EXIT_AFTER_S = 2.0
  # A handler that ran where its exception is dropped (a garbage-collection callback) leaves
  # the main thread in start-up; after this long the watcher ends the process instead.
  DROPPED_EXIT_AFTER_S = 10.0

  def __init__(
    self,
    kill_switch_path: str = '',
    exit_duration_mins: float = 0.0,
    start: float | None = None,
    num_processes: int = 1,
  ):
    self.kill_switch_path = kill_switch_path
    self.limit_s = exit_duration_mins * 60.0
    self.start = PROCESS_START if start is None else start
    self.num_processes = num_processes
    self.received: int | None = None  # the signal number, once one arrived
    self.last_iteration_s = 0.0
    self.training = False  # set by start_training(): the loop saves at a boundary from then on
    self._last_poll: float | None = None
    # The handlers the signals had before __enter__ (signal.signal's return values).
    self._previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int | None] = {}
    self._wakeup: tuple[int, int] | None = None
    self._previous_wakeup_fd = -1
    self._interrupt_handled = threading.Event()
    self._leaving = threading.Event()  # set once an Interrupted is caught, or the block ends
    self._watcher: threading.Thread | None = None

  def __enter__(self) -> StopConditions:
    for sig in self.SIGNALS:
      if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
        continue  # started under nohup: the user asked for the run to outlive the terminal
      self._previous[sig] = signal.signal(sig, self._on_signal)
    # CPython's C-level handler writes each signal's number to this pipe at once, whatever the
    # main thread is doing: the watcher learns of a signal that no Python handler can run for.
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    self._wakeup = (read_fd, write_fd)
    self._previous_wakeup_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    self._watcher = threading.Thread(
      target=self._watch_signals, args=(read_fd,), name='t5x_like-signals', daemon=True
    )
    self._watcher.start()
    return self

  def __exit__(self, *exc) -> None:
    self._leaving.set()
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()
    if self._wakeup is not None:
      signal.set_wakeup_fd(self._previous_wakeup_fd)
      read_fd, write_fd = self._wakeup
      self._wakeup = None
      os.write(write_fd, b'\0')  # not a signal number: the watcher ends
      if self._watcher is not None:
        self._watcher.join(timeout=5)
      os.close(read_fd)
      os.close(write_fd)

  def interrupt_seen(self) -> None:
    """The caller caught the handler's Interrupted: the process is leaving through its cleanup,
    not going on with start-up, and the signal watcher leaves it to do so."""
    self._leaving.set()

  def start_training(self) -> None:
    """From here on a signal stops the run at the next iteration boundary, after a save. A
    signal whose Interrupted did not reach the caller ends the run here, before its first
    iteration: Python runs a handler wherever the main thread is, a garbage-collection callback
    included (jax registers one), and an exception raised there is dropped."""
    if self.received is not None:
      raise Interrupted(self.received)
    self.training = True

  def _on_signal(self, signum, frame) -> None:
    if signum == signal.SIGHUP:
      detach_from_terminal()
    if not self.training:
      self.received = signum  # for start_training, should the exception be dropped
      self._interrupt_handled.set()
      raise Interrupted(signum)
    if self.received is not None and signum in (signal.SIGTERM, signal.SIGINT):
      # A second SIGTERM or Ctrl-C: the user will not wait for the save.
      leave_now(
        f'> received {signal.Signals(signum).name} again: leaving now without saving; the '
        f'last complete checkpoint is intact; exit code {int(ExitCode.REQUEUE)} (REQUEUE)'
      )
    # Only a flag: the loop saves at the next iteration boundary, outside the handler.
    self.received = signum

  def _watch_signals(self, read_fd: int) -> None:
    while True:
      try:
        data = os.read(read_fd, 1)
      except OSError:
        return
      if not data or data == b'\0':
        return
      if self.training or data[0] not in [int(s) for s in self._previous]:
        continue
      if not self._interrupt_handled.wait(self.FORCE_EXIT_AFTER_S):
        leave_now(f'> {Interrupted(data[0])} (left during a native call, e.g. a compilation)')
      elif not self._leaving.wait(self.DROPPED_EXIT_AFTER_S) and not self.training:
        leave_now(f'> {Interrupted(data[0])} (left from start-up, which went on)')

  def elapsed_s(self) -> float:
    return now() - self.start

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
    current = now()
    if self._last_poll is not None:
      self.last_iteration_s = current - self._last_poll
    self._last_poll = current
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
    return (
      f'{self.elapsed_s() / 60:.2f} of runtime.exit_duration_mins={self.limit_s / 60:g} '
      'minutes used'
    )


# A job's first iteration may take this many hang timeouts (communicator set-up, first-touch
# allocation) before the watchdog calls it a hang.
FIRST_ITERATION_GRACE = 10.0


class Watchdog:
  """Turns a hang into an exit that says where every thread was.

  The training loop calls `beat(what)` as it makes progress (each iteration, each evaluated
  set, each save). If no beat comes for `timeout_s`, a daemon thread writes a message and every
  thread's Python stack (faulthandler: it needs neither the GIL's cooperation nor the stuck
  thread's) to stderr and to `log_path`, then ends the process with exit code 4 (HUNG) without
  running any cleanup that could block too. Under `srun --kill-on-bad-exit=1` that ends the job
  step, so a job array requeues instead of idling for hours (the chronicles' NCCL hang that
  never timed out). Compilation can take long and cannot hang on another process, so it runs
  inside `suspended()`. timeout_s <= 0: no watchdog, only the SIGUSR2 stack dump.
  """

  CHECK_EVERY_S = 1.0

  def __init__(
    self,
    timeout_s: float,
    log_path: str | None = None,
    on_hang: Callable[[str], None] | None = None,
  ):
    self.timeout_s = timeout_s
    self.log_path = log_path
    self.on_hang = on_hang  # called with the message before the stacks are written
    self._last_beat = now()
    self._allowed_s = timeout_s  # of silence after the last beat (see `beat`'s grace)
    self._what = 'starting'
    self._armed = False
    self._suspended = 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def __enter__(self) -> Watchdog:
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    if self.timeout_s > 0:
      self._thread = threading.Thread(target=self._watch, name='t5x_like-watchdog', daemon=True)
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    faulthandler.unregister(signal.SIGUSR2)

  def beat(self, what: str, grace: float = 1.0) -> None:
    """Progress was made; the next step is `what` (named in the message if it hangs), allowed
    `grace` x the timeout (a job's first iteration sets up the collectives' communicators:
    NCCL's take minutes on hundreds of GPUs)."""
    self._what = what
    self._allowed_s = self.timeout_s * grace
    self._last_beat = now()
    self._armed = True

  def overdue(self) -> bool:
    """Whether the silence since the last beat is longer than that beat allows."""
    return self._armed and not self._suspended and now() - self._last_beat > self._allowed_s

  @contextlib.contextmanager
  def suspended(self):
    self._suspended += 1
    try:
      yield
    finally:
      self._suspended -= 1
      self._last_beat = now()

  def _watch(self) -> None:
    while not self._stop.wait(min(self.CHECK_EVERY_S, self.timeout_s / 4)):
      if self.overdue():
        self._report_and_exit()

  def _report_and_exit(self) -> None:
    grace = self._allowed_s / self.timeout_s
    allowed = f'runtime.hang_timeout_mins={self.timeout_s / 60:g}' + (
      f' x {grace:g} for this step' if grace != 1 else ''
    )
    message = (
      f'> hang: no progress for {(now() - self._last_beat) / 60:.2f} minutes '
      f'({allowed}) while {self._what}; the '
      f'Python stack of every thread follows; exit code {int(ExitCode.HUNG)} '
      f'(HUNG): resubmit to resume from the last checkpoint\n'
    )
    if self.on_hang is not None:
      try:
        self.on_hang(message)
      except Exception:  # pylint: disable=broad-except
        pass  # the exit below matters more than the alert
    outputs = [sys.stderr]
    log = None
    if self.log_path and os.path.isdir(os.path.dirname(self.log_path)):
      log = open(self.log_path, 'a')  # pylint: disable=consider-using-with
      outputs.append(log)
    for out in outputs:
      out.write(message)
      out.flush()
      faulthandler.dump_traceback(file=out, all_threads=True)
      out.flush()
    os._exit(int(ExitCode.HUNG))  # no atexit or finalizers: they may wait on the hung thread
