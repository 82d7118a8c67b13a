"""runtime.Watchdog's decision: how long a step may be silent before it is a hang; a signal
during start-up that the interpreter drops still ends the run before training."""

import gc
import os
import queue
import signal
import threading
import time

import pytest

from t5x_like.training import runtime


def test_first_iteration_grace_and_suspension(monkeypatch):
  clock = [1000.0]
  monkeypatch.setattr(runtime, 'now', lambda: clock[0])
  watchdog = runtime.Watchdog(timeout_s=60.0)
  clock[0] += 3600
  assert not watchdog.overdue()  # not armed before the first beat (start-up, restore)
  # A job's first iteration also sets up the communicators: FIRST_ITERATION_GRACE timeouts.
  watchdog.beat('in iteration 1', grace=runtime.FIRST_ITERATION_GRACE)
  clock[0] += 60 * runtime.FIRST_ITERATION_GRACE - 1
  assert not watchdog.overdue()
  clock[0] += 2
  assert watchdog.overdue()
  # Every later beat allows one timeout.
  watchdog.beat('in iteration 2')
  clock[0] += 59
  assert not watchdog.overdue()
  clock[0] += 2
  assert watchdog.overdue()
  # Compilation is not progress, but not a hang either; the clock restarts after it.
  with watchdog.suspended():
    clock[0] += 3600
    assert not watchdog.overdue()
  clock[0] += 59
  assert not watchdog.overdue()


def test_the_watchdog_thread_ends_the_process_after_the_timeout_and_not_before(
  monkeypatch, tmp_path
):
  """The thread's side of the decision above, on a fake clock: silent for just under the timeout,
  the process lives on; just over it, the thread reports (message, stacks in the log) and exits
  with code 4. `os._exit` is replaced so that the test process survives the exit."""
  clock, reads = [1000.0], [0]

  def now():
    reads[0] += 1
    return clock[0]

  exits, test_over = queue.Queue(), threading.Event()

  def fake_exit(code):
    exits.put(code)
    test_over.wait(30)  # then the stopped watchdog's thread ends

  monkeypatch.setattr(runtime, 'now', now)
  monkeypatch.setattr(runtime.os, '_exit', fake_exit)
  monkeypatch.setattr(runtime.Watchdog, 'CHECK_EVERY_S', 0.01)
  hangs, log_path = [], str(tmp_path / 'main_log.txt')

  def checks_at_this_time(count=3):
    """Lets the thread look at the clock `count` more times (real time is only a guard)."""
    target, deadline = reads[0] + count, time.monotonic() + 30
    while reads[0] < target and exits.empty() and time.monotonic() < deadline:
      time.sleep(0.01)
    return reads[0] >= target

  with runtime.Watchdog(60.0, log_path, on_hang=hangs.append) as watchdog:
    watchdog.beat('in iteration 5')
    clock[0] += 59.9
    checked = checks_at_this_time()
    assert exits.empty() and not hangs  # not before the timeout
    assert checked, 'the watchdog thread stopped checking the clock'
    clock[0] += 0.2
    try:
      assert exits.get(timeout=30) == runtime.ExitCode.HUNG
    finally:
      test_over.set()
  (message,) = hangs
  assert message.startswith(
    '> hang: no progress for 1.00 minutes (runtime.hang_timeout_mins=1) while in iteration 5;'
  )
  with open(log_path) as f:
    log = f.read()
  assert log.startswith(message) and '(most recent call first)' in log


@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_a_start_up_signal_handled_inside_a_gc_callback_still_stops_the_run(monkeypatch):
  """Python runs a signal handler wherever the main thread is, inside a garbage-collection
  callback too (jax registers one), and drops what the handler raises there: the trainer, in
  TensorFlow's import when SIGTERM came, trained on and exited 0 in 5 of 8 runs. The signal is
  kept: the run ends where training would begin, or, if start-up goes on that long, from the
  signal watcher (exit 3; `os._exit` replaced so that the test process survives it)."""
  exits = queue.Queue()
  monkeypatch.setattr(runtime.os, '_exit', exits.put)
  monkeypatch.setattr(runtime.StopConditions, 'DROPPED_EXIT_AFTER_S', 0.2)
  signalled = []

  def collecting(phase, info):
    if phase == 'start' and not signalled:
      signalled.append(True)
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(1000):  # bytecode, at which the main thread runs the pending handler
        pass

  with runtime.StopConditions() as stop:
    gc.callbacks.append(collecting)
    try:
      gc.collect()  # the handler's Interrupted is raised inside the callback, and dropped
    finally:
      gc.callbacks.remove(collecting)
    assert signalled and stop.received == signal.SIGTERM
    assert exits.get(timeout=30) == runtime.ExitCode.REQUEUE  # start-up went on: the watcher
    with pytest.raises(runtime.Interrupted, match='received SIGTERM before the first iteration'):
      stop.start_training()
    assert not stop.training


def test_a_start_up_signal_caught_by_the_run_is_left_to_its_cleanup(monkeypatch):
  """The reverse case: the Interrupted reached the run, whose cleanup (an alert command) then
  takes longer than the watcher's wait for a dropped one. The watcher does not end the process
  (before, it did, cutting the cleanup short with the wrong reason)."""
  exits = queue.Queue()
  monkeypatch.setattr(runtime.os, '_exit', exits.put)
  monkeypatch.setattr(runtime.StopConditions, 'DROPPED_EXIT_AFTER_S', 0.2)
  with runtime.StopConditions() as stop:
    with pytest.raises(runtime.Interrupted):
      with runtime.stop_conditions(None, stop, 1):  # the trainer's view of its caller's stop
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
          pass
    with pytest.raises(queue.Empty):
      exits.get(timeout=1.0)  # five times the wait, within the block
