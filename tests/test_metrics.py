"""watches.ThroughputWatch: a lasting slowdown of the step is reported, a single slow step is not.
watches.SpikeWatch: a loss or grad-norm spike is reported in its first iteration."""

from t5x_like.training import metrics, watches


def messages(add, points, first_iteration):
  """What `add(iteration, *point)` returns for consecutive iterations, keyed by iteration."""
  out = {}
  for i, point in enumerate(points):
    message = add(first_iteration + i, *point)
    if message:
      out[first_iteration + i] = message
  return out


def feed(watch, times, first_iteration, gbs=16):
  """ThroughputWatch's messages for step times of consecutive iterations."""
  return messages(lambda it, s: watch.add(it, gbs, s), [(t,) for t in times], first_iteration)


def test_a_lasting_slowdown_is_reported_once_and_again_only_after_a_recovery():
  watch = watches.ThroughputWatch(window=5, threshold=0.05, warmup=2)
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


def test_each_global_batch_size_and_curriculum_length_has_its_own_baseline():
  # A batch-size ramp-up makes the step longer without anything being wrong.
  watch = watches.ThroughputWatch(window=3, threshold=0.05, warmup=1)
  assert feed(watch, [5.0, 1.0, 1.0, 1.0], 1, gbs=16) == {}
  assert feed(watch, [5.0, 2.0, 2.0, 2.0, 2.0, 2.0], 5, gbs=32) == {}
  assert list(feed(watch, [2.3] * 3, 11, gbs=32)) == [12]
  # So does the curriculum's next sequence length, at the same batch size.
  assert (
    messages(lambda it, s: watch.add(it, 16, s, 1024), [(t,) for t in [5.0] + [1.8] * 6], 14) == {}
  )
  slow = messages(lambda it, s: watch.add(it, 16, s, 1024), [(2.0,)] * 3, 21)
  assert list(slow) == [22] and 'global batch size 16, sequence length 1024' in slow[22]


def test_an_earlier_jobs_baseline_finds_a_device_slow_from_the_start_and_a_faster_one_wins():
  earlier = watches.ThroughputWatch(window=3, threshold=0.05, warmup=1)
  assert feed(earlier, [5.0, 1.0, 1.0, 1.0], 1) == {}
  assert earlier.baselines() == [
    {'global_batch_size': 16, 'seq_len': 0, 'step_s': 1.0, 'first': 2, 'last': 4}
  ]
  # The next job is 10% slower from its first step: its own baseline would hide that.
  slow_job = watches.ThroughputWatch(window=3, threshold=0.05, warmup=1)
  slow_job.seed(earlier.baselines())
  slow = feed(slow_job, [5.0, 1.1, 1.1, 1.1], 5)
  assert list(slow) == [8] and "10.0% above an earlier job's 1 s (iterations 2-4" in slow[8]
  # A job faster than the earlier one keeps its own, faster baseline.
  fast_job = watches.ThroughputWatch(window=3, threshold=0.05, warmup=1)
  fast_job.seed(earlier.baselines())
  assert feed(fast_job, [5.0, 0.8, 0.8, 0.8, 0.8], 5) == {}
  assert fast_job.baselines()[0]['step_s'] == 0.8
  assert list(feed(fast_job, [0.9] * 3, 10)) == [11]  # 12.5% above its own 0.8 s


def spikes(watch, points, first_iteration):
  """SpikeWatch's messages for (loss, grad norm) points of consecutive iterations."""
  return messages(watch.add, points, first_iteration)


def test_a_spike_is_reported_in_its_first_iteration_and_a_new_level_is_not_a_spike():
  watch = watches.SpikeWatch(window=10, loss_threshold=0.15, grad_factor=4.0)
  # The first `window` iterations only fill the window: a falling loss is no spike.
  assert spikes(watch, [(9.0 - 0.5 * i, 1.0) for i in range(10)], 1) == {}
  noisy = [(2.4 + 0.05 * (-1) ** i, 0.2 + 0.02 * (i % 3)) for i in range(20)]
  assert spikes(watch, noisy, 11) == {}
  # tr11 at 31214: the loss jumps; reported once however long the spike lasts.
  got = spikes(watch, [(3.1, 0.25), (3.3, 0.3), (3.0, 0.25)], 31)
  assert list(got) == [31]
  assert got[31].startswith(
    '> spike at iteration 31: lm loss 3.1000 is 29% above the median 2.4000'
  )
  assert got[31].endswith('of the previous 10 iterations')
  # Back to normal, then a grad-norm spike alone (the loss has not moved yet).
  assert spikes(watch, noisy[:10], 34) == {}
  got = spikes(watch, [(2.45, 5.0)], 44)
  assert 'grad norm 5.000 is ' in got[44] and 'lm loss' not in got[44]
  # A loss that stays higher becomes the median: after half a window it is no longer a spike.
  level = spikes(watch, [(2.4, 0.2)] + [(3.0, 0.2)] * 12 + [(2.4, 0.2), (3.0, 0.2)], 45)
  assert list(level) == [46]
  # Non-finite iterations are the nan counter's business.
  assert watch.add(60, float('nan'), 1.0) is None and watch.add(61, 2.5, float('inf')) is None


def test_a_spike_check_with_threshold_0_is_off():
  """runtime.spike_loss_threshold / spike_grad_factor = 0: e.g. grad norms only, for a run whose
  loss jumps by design (a new data mix)."""
  grads_only = watches.SpikeWatch(window=5, loss_threshold=0.0, grad_factor=3.0)
  assert spikes(grads_only, [(2.0, 1.0)] * 5 + [(9.0, 1.0)], 1) == {}
  assert list(spikes(grads_only, [(2.0, 1.0), (2.0, 4.0)], 7)) == [8]
  loss_only = watches.SpikeWatch(window=5, loss_threshold=0.5, grad_factor=0.0)
  assert spikes(loss_only, [(2.0, 1.0)] * 5 + [(2.0, 100.0)], 1) == {}
  assert list(spikes(loss_only, [(2.0, 1.0), (3.5, 1.0)], 7)) == [8]


def test_tensorboard_runs_plot_training_against_iterations_samples_and_tokens():
  record = {
    'iteration': 7,
    'consumed_samples': 112,
    'consumed_tokens': 14336,
    'lm_loss': 6.5,
    'learning_rate': 1e-3,
    'global_batch_size': 16,
    'grad_norm': 0.5,
    'num_zeros': 0.0,
    'step_time_s': 0.9,
    'skipped_iterations': 0,
  }
  runs = metrics.tensorboard_scalars(record)
  assert runs[''] == [
    ('lm-loss-training/lm_loss', 6.5, 7),
    ('learning-rate/learning-rate', 1e-3, 7),
    ('batch-size/batch-size', 16, 7),
    ('grad-norm/grad-norm', 0.5, 7),
    ('num-zeros/num-zeros', 0.0, 7),
    ('consumed/samples', 112, 7),
    ('consumed/tokens', 14336, 7),
    ('iteration-time/iteration-time', 0.9, 7),
    ('skipped/skipped_iterations', 0, 7),
  ]
  # Speed and counters only against the iteration; the curves to compare runs by also against
  # the data consumed, each axis in its own run (a resume's purge step is per run).
  assert runs['vs_tokens'] == [
    ('lm-loss-training/lm_loss_vs_tokens', 6.5, 14336),
    ('learning-rate/learning-rate_vs_tokens', 1e-3, 14336),
    ('batch-size/batch-size_vs_tokens', 16, 14336),
    ('grad-norm/grad-norm_vs_tokens', 0.5, 14336),
    ('num-zeros/num-zeros_vs_tokens', 0.0, 14336),
  ]
  assert [(tag, step) for tag, _, step in runs['vs_samples']] == [
    (tag.replace('_vs_tokens', '_vs_samples'), 112) for tag, _, _ in runs['vs_tokens']
  ]
  evaluated = {
    'iteration': 7,
    'consumed_samples': 112,
    'consumed_tokens': 14336,
    'set': 'valid',
    'lm_loss': 6.0,
    'ppl': 403.4,
  }
  assert metrics.tensorboard_eval_scalars(evaluated)['vs_tokens'] == [
    ('lm-loss-validation/valid_lm_loss_vs_tokens', 6.0, 14336),
    ('lm-loss-validation/valid_lm_loss_PPL_vs_tokens', 403.4, 14336),
  ]
  # A record without an axis (an evaluation written before tokens were recorded) has no such run.
  del evaluated['consumed_tokens']
  assert set(metrics.tensorboard_eval_scalars(evaluated)) == {'', 'vs_samples'}
