"""runtime.Watchdog's decision: how long a step may be silent before it is a hang."""

from t5x_like import runtime


def test_first_iteration_grace_and_suspension(monkeypatch):
  clock = [1000.0]
  monkeypatch.setattr(runtime, '_now', lambda: clock[0])
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
