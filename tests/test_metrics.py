"""metrics.ThroughputWatch: a lasting slowdown of the step is reported, a single slow step is not."""

from t5x_like import metrics


def feed(watch, times, first_iteration, gbs=16):
  """The messages `add` returns for consecutive iterations, keyed by iteration."""
  out = {}
  for i, seconds in enumerate(times):
    message = watch.add(first_iteration + i, gbs, seconds)
    if message:
      out[first_iteration + i] = message
  return out


def test_a_lasting_slowdown_is_reported_once_and_again_only_after_a_recovery():
  watch = metrics.ThroughputWatch(window=5, threshold=0.05, warmup=2)
  # Two warm-up iterations (slow) are not the baseline; iterations 3-7 are: 1.0 s.
  assert feed(watch, [10.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0], 1) == {}
  # One slow iteration (a save, a hiccup) does not move the median of five.
  assert feed(watch, [1.0, 2.5, 1.0, 1.0, 1.0], 8) == {}
  # tr11's drop: every step 6% slower. Reported when most of the window is slow, then not again.
  slow = feed(watch, [1.06] * 10, 13)
  assert list(slow) == [15]
  assert 'iterations 11-15 is 1.06 s, 6.0% above' in slow[15]
  assert "this run's 1 s (iterations 3-7, global batch size 16)" in slow[15]
  assert 'python -m t5x_like.devices' in slow[15]
  # 4% is within the 5% threshold but not a recovery (below 2.5%): still no second message.
  assert feed(watch, [1.04] * 5 + [1.06] * 5, 23) == {}
  # Recovered (the slow device replaced), then slow again: a new message.
  assert feed(watch, [1.0] * 5, 33) == {}
  assert list(feed(watch, [1.2] * 5, 38)) == [40]


def test_each_global_batch_size_has_its_own_baseline():
  # A batch-size ramp-up makes the step longer without anything being wrong.
  watch = metrics.ThroughputWatch(window=3, threshold=0.05, warmup=1)
  assert feed(watch, [5.0, 1.0, 1.0, 1.0], 1, gbs=16) == {}
  assert feed(watch, [5.0, 2.0, 2.0, 2.0, 2.0, 2.0], 5, gbs=32) == {}
  assert list(feed(watch, [2.3] * 3, 11, gbs=32)) == [12]
