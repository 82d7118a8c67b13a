"""The loop's watches and their hooks: a lasting slowdown of the step (throughput), loss and
grad-norm spikes, the divergence stop (non-finite iterations in a row), and the replicated
copies compared across devices (ReplicaCheck)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax

from t5x_like.config import Config
from t5x_like.mesh import partitioning
from t5x_like.training import runtime


class ThroughputWatch:
  """Notices a lasting slowdown of the step, as tr11's 5% drop from one slow GPU (149 to 140
  TFLOPs, found days later on a graph).

  The baseline is the median step time of `window` iterations after `warmup` ones, per global
  batch size (a ramp-up changes the step). `add` returns a message once the median of the latest
  `window` iterations exceeds the baseline by more than `threshold`, and again only after the
  step has recovered (below half the threshold) and slowed down anew. A median of 20 ignores
  the odd slow iteration (a checkpoint save, a hiccup) and reacts within 20 iterations.

  A job compared only with itself misses a device that is slow from the job's start (the next job
  of an array lands on a bad node): `baselines()` go into the checkpoint's meta, and the next job on
  the same setup starts from them (`seed`). It still measures its own first window, and keeps the
  faster of the two as the baseline.
  """

  def __init__(self, window: int = 20, threshold: float = 0.05, warmup: int = 3):
    self.window, self.threshold, self.warmup = window, threshold, warmup
    self._seen: dict[tuple[int, int], int] = {}
    self._times: dict[tuple[int, int], list[float]] = {}
    # (gbs, seq_len) -> (median, first, last, whose: "this run's" or "an earlier job's")
    self._baseline: dict[tuple[int, int], tuple[float, int, int, str]] = {}
    self._warned: set[tuple[int, int]] = set()

  def baselines(self) -> list[dict]:
    """The baselines, as JSON for a checkpoint's meta."""
    return [
      {'global_batch_size': gbs, 'seq_len': seq, 'step_s': base, 'first': first, 'last': last}
      for (gbs, seq), (base, first, last, _) in sorted(self._baseline.items())
    ]

  def seed(self, baselines: list[dict]) -> None:
    """Baselines of an earlier job (`baselines()` of it) on the same setup."""
    for b in baselines:
      self._baseline[(b['global_batch_size'], b['seq_len'])] = (
        b['step_s'],
        b['first'],
        b['last'],
        "an earlier job's",
      )

  def add(
    self, iteration: int, global_batch_size: int, seconds: float, seq_len: int = 0
  ) -> str | None:
    """`seq_len`: the curriculum's length of this iteration (0 without a curriculum); each
    (global batch size, length) has its own baseline."""
    key = (global_batch_size, seq_len)
    self._seen[key] = self._seen.get(key, 0) + 1
    if self._seen[key] <= self.warmup:
      return None
    times = self._times.setdefault(key, [])
    times.append(seconds)
    del times[: -self.window]
    if len(times) < self.window:
      return None
    if self._seen[key] == self.warmup + self.window:  # this job's own first window
      own = statistics.median(times)
      if key not in self._baseline or own < self._baseline[key][0]:
        self._baseline[key] = (own, iteration - self.window + 1, iteration, "this run's")
        return None
    base, first, last, whose = self._baseline[key]
    recent = statistics.median(times)
    slower = recent / base - 1.0
    if slower > self.threshold and key not in self._warned:
      self._warned.add(key)
      length = f', sequence length {seq_len}' if seq_len else ''
      return (
        f'> throughput: the median step time of iterations {iteration - self.window + 1}-'
        f'{iteration} is {recent:.3g} s, {slower:.1%} above {whose} {base:.3g} s '
        f'(iterations {first}-{last}, global batch size {global_batch_size}{length}). If '
        "it stays, look for a slow device: python -m t5x_like.devices on the job's nodes "
        '(docs/operations.md, "Finding a slow device")'
      )
    if slower < self.threshold / 2:
      self._warned.discard(key)
    return None


class DivergenceWatch:
  """Ends a run that has diverged instead of letting it skip to its last iteration.

  A non-finite iteration changes nothing (the step skips it), so a run whose every step is NaN
  would otherwise go on to its end and report success. After `limit` consecutive non-finite
  iterations (`runtime.max_consecutive_nan`; 0: never) `add` returns the message that stops the
  run. `last_finite` is the progress after the last finite iteration: the state the run keeps.
  """

  def __init__(self, limit: int, start: Any):
    self.limit = limit
    self.consecutive = 0
    self.first_non_finite: int | None = None
    self.last_finite = start  # a Progress: the job's start, then after each finite iteration

  def add(self, progress: Any, finite: bool) -> str | None:
    """`progress` after an iteration that was (not) finite; the stop message, or None."""
    if finite:
      self.consecutive, self.first_non_finite = 0, None
      self.last_finite = dataclasses.replace(progress)
      return None
    self.consecutive += 1
    if self.first_non_finite is None:
      self.first_non_finite = progress.iteration
    if not self.limit or self.consecutive < self.limit:
      return None
    return (
      f'> diverged: iterations {self.first_non_finite}-{progress.iteration} '
      f'({self.consecutive} in a row, runtime.max_consecutive_nan={self.limit}) had a '
      f'non-finite loss or gradient norm and were skipped; the run stops with the state '
      f'of iteration {self.last_finite.iteration}, the last finite one'
    )


class SpikeWatch:
  """Notices a loss or gradient-norm spike in the iteration it happens.

  The chronicles found tr11's spike at iteration 31214 and tr8b's divergences on graphs, hours
  later, and then needed the checkpoint from before the spike and the batch that caused it. A
  spike here is an lm loss more than `loss_threshold` above the median of the previous `window`
  finite iterations, or a grad norm above `grad_factor` times theirs; no spike is reported before
  `window` iterations of this job (the early fall of the loss and the warm-up's grad norms are
  not spikes). `add` returns a message at the first iteration of a spike and again only after an
  iteration without one. Non-finite iterations are counted elsewhere (nan iterations). A
  threshold of 0 turns its check off (`runtime.spike_*`).
  """

  def __init__(self, window: int = 50, loss_threshold: float = 0.15, grad_factor: float = 4.0):
    self.window, self.loss_threshold, self.grad_factor = window, loss_threshold, grad_factor
    self._losses: list[float] = []
    self._grad_norms: list[float] = []
    self._in_spike = False

  def add(self, iteration: int, lm_loss: float, grad_norm: float) -> str | None:
    if not (math.isfinite(lm_loss) and math.isfinite(grad_norm)):
      return None
    reasons = []
    if len(self._losses) >= self.window:
      loss_median = statistics.median(self._losses)
      grad_median = statistics.median(self._grad_norms)
      if self.loss_threshold and lm_loss > loss_median * (1 + self.loss_threshold):
        reasons.append(
          f'lm loss {lm_loss:.4f} is {lm_loss / loss_median - 1:.0%} above the '
          f'median {loss_median:.4f}'
        )
      if self.grad_factor and grad_norm > grad_median * self.grad_factor:
        reasons.append(
          f'grad norm {grad_norm:.3f} is {grad_norm / grad_median:.1f}x the median '
          f'{grad_median:.3f}'
        )
    # The spike joins the window: if the loss stays there, it is the new level, not a spike.
    for values, value in ((self._losses, lm_loss), (self._grad_norms, grad_norm)):
      values.append(value)
      del values[: -self.window]
    was_in_spike, self._in_spike = self._in_spike, bool(reasons)
    if not reasons or was_in_spike:
      return None
    return (
      f'> spike at iteration {iteration}: '
      + '; '.join(reasons)
      + f' of the previous {self.window} iterations'
    )


def throughput_setup(cfg: Config, software: dict[str, Any]) -> dict[str, Any]:
  """What the step time depends on besides the data: devices, mesh, model, micro-batch, the
  ramp-up's padding, software (fixed for a job). Step-time baselines carry over from an earlier
  job only when this is equal."""
  device = jax.devices()[0]
  setup = {
    'platform': device.platform,
    'device_kind': device.device_kind,
    'devices': jax.device_count(),
    'processes': jax.process_count(),
    'mesh': dataclasses.asdict(cfg.mesh),
    'pipeline': dataclasses.asdict(cfg.pipeline),
    'model': dataclasses.asdict(cfg.model),
    'micro_batch_size': cfg.train.micro_batch_size,
    # A ramp-up step padded to more micro-batches takes longer under a pipeline.
    'rampup_microbatch_multiple': cfg.train.rampup_microbatch_multiple,
    'software': software,
  }
  return json.loads(json.dumps(setup))  # as the checkpoint's meta holds it (lists, not tuples)


def resumed_throughput_watch(
  cfg: Config, software: dict[str, Any], saved: dict[str, Any] | None
) -> tuple[ThroughputWatch, dict[str, Any], str | None]:
  """The run's throughput watch, its setup, and the note on the checkpoint's baselines (`saved`:
  the meta's 'throughput'), which seed the watch when their job ran on the same setup."""
  # A GPU's step time is steady to 1-2%, so 5% is a real slowdown (tr11's slow GPU). A CPU's
  # moves by 10-20% with whatever else the machine runs: only a larger change is.
  watch = ThroughputWatch(threshold=0.25 if jax.devices()[0].platform == 'cpu' else 0.05)
  setup = throughput_setup(cfg, software)
  return watch, setup, seed_throughput(watch, saved, setup)


def seed_throughput(
  watch: ThroughputWatch, saved: dict[str, Any] | None, setup: dict[str, Any]
) -> str | None:
  """Seeds `watch` with the checkpoint's step-time baselines (its meta's 'throughput') when its
  job ran on the same setup; the note for the log, or None when there is nothing to say."""
  if not saved or not saved['baselines']:
    return None
  if saved['setup'] != setup:
    return (
      "> throughput: the checkpoint's job ran on another setup (devices, mesh, model or "
      'software); this job measures its own step-time baseline'
    )
  watch.seed(saved['baselines'])
  first = saved['baselines'][0]
  return (
    f"> throughput: step times are compared with the earlier job's baseline from the "
    f'start ({first["step_s"]:.3g} s at global batch size {first["global_batch_size"]}'
    f"{', ...' if len(saved['baselines']) > 1 else ''}): a device slow from this job's "
    'start is reported too'
  )


def throughput_hook(watch: ThroughputWatch, log: Callable[[str], None], alert, curriculum: bool):
  """Every iteration: a step slower than the baseline of its batch size (and, with a curriculum,
  the length the step runs at) is logged and alerted ('slowdown')."""

  def watch_throughput(info) -> None:
    if info.record is None:
      return
    r = info.record
    # The step time follows the length the step runs at (model FLOPs count the trained one).
    length = r.get('padded_seq_len', r['seq_len']) if curriculum else 0
    slowdown = watch.add(info.iteration, r['global_batch_size'], r['step_time_s'], length)
    if slowdown:
      log(slowdown)
      alert('slowdown', slowdown, info.iteration)

  return watch_throughput


def spike_hook(watch: SpikeWatch, report: Callable[[str, int], None]):
  """Every iteration: a loss or grad-norm spike goes to `report(message, iteration)`."""

  def watch_spikes(info) -> None:
    if info.record is not None:
      spike = watch.add(info.iteration, info.record['lm_loss'], info.record['grad_norm'])
      if spike:
        report(spike, info.iteration)

  return watch_spikes


def divergence_hook(watch: DivergenceWatch, on_diverged: Callable[[str, Any], None]):
  """Every iteration: runtime.max_consecutive_nan non-finite iterations in a row call
  `on_diverged(message, state)` and stop the run (DIVERGED)."""

  def watch_divergence(info) -> None:
    if not info.trained:
      return
    diverged = watch.add(info.progress, info.finite)
    if diverged:
      on_diverged(diverged, info.state)
      info.request_stop(runtime.StopReason.DIVERGED)

  return watch_divergence


class RunWatches:
  """A run's three watches, from where it resumes: the throughput watch (seeded with the
  checkpoint's baselines when its job ran on the same `setup`; `note` says what happened to
  them), the spike watch and the divergence watch (counting from `progress`, the resumed one)."""

  def __init__(self, cfg: Config, software: dict[str, Any], saved: dict[str, Any] | None, progress):
    rt = cfg.runtime
    self.throughput, self.throughput_setup, self.note = resumed_throughput_watch(
      cfg, software, saved
    )
    self.spikes = SpikeWatch(rt.spike_window, rt.spike_loss_threshold, rt.spike_grad_factor)
    self.divergence = DivergenceWatch(rt.max_consecutive_nan, dataclasses.replace(progress))
    self.curriculum = cfg.curriculum.enabled

  def register(self, hooks, log: Callable[[str], None], alert, checkpoints) -> None:
    """Their hooks, every iteration: a slowdown is logged and alerted, a spike and a divergence go
    to `checkpoints` (training.run_checkpoints.RunCheckpoints: `spike`, `on_diverged`)."""
    hooks.add_hook(throughput_hook(self.throughput, log, alert, self.curriculum))
    hooks.add_hook(spike_hook(self.spikes, checkpoints.spike))
    hooks.add_hook(divergence_hook(self.divergence, checkpoints.on_diverged))

  def checkpoint_meta(self) -> dict[str, Any]:
    """What a checkpoint's meta carries for the next job (its 'throughput')."""
    return {'setup': self.throughput_setup, 'baselines': self.throughput.baselines()}


class ReplicaCheck:
  """runtime.replica_check_interval as a training-loop hook (hooks.Hooks.add_hook): the
  replicated arrays of the params and optimizer state whose copies differ (the chronicles'
  LayerNorm weights that drifted apart across tensor ranks, found weeks later). One SPMD program
  updates every copy alike, so this should never find one; the check makes that a measured fact
  of the run, not an assumption. Every process calls it at the same iteration (a collective)
  and reaches the same verdict. `log(line)` writes the run's log, `alert(event, message,
  iteration)` is alerts.Alerts.send; a process that writes no log prints a mismatch too.
  `num_devices`: the mesh's, as the log line names them."""

  def __init__(self, log, alert, is_writer: bool, num_devices: int):
    self.log, self.alert, self.is_writer = log, alert, is_writer
    self.num_devices = num_devices

  def __call__(self, info) -> None:
    if info.trained:
      self.check(info.state, info.iteration)

  def check(self, tree, iteration: int) -> list[str]:
    """Logs the verdict on `tree` at `iteration`; returns the paths whose copies differ."""
    drifted = partitioning.replica_report(tree)
    devices = self.num_devices
    if drifted:
      where = '; '.join(
        f'{m.path} on process{"es" * (len(m.processes) > 1)} {", ".join(map(str, m.processes))}'
        for m in drifted
      )
      message = (
        f'> replica check at iteration {iteration}: the copies of '
        f'{", ".join(m.path for m in drifted)} differ across devices. Resume from the '
        'last checkpoint (a restore reads one copy) and report it with this log. The '
        f'differing copies: {where}'
      )
      self.log(message)
      self.alert('replica_mismatch', message, iteration)
      if not self.is_writer:
        print(message, file=sys.stderr, flush=True)
    elif jax.process_count() == 1:
      self.log(
        f'> replica check at iteration {iteration}: every replicated array of the '
        f"params and optimizer state is identical on this process's {devices} devices"
      )
    else:
      self.log(
        f'> replica check at iteration {iteration}: every replicated array of the '
        f'params and optimizer state is identical on all {devices} devices of the '
        f'{jax.process_count()} processes'
      )
    return [m.path for m in drifted]
