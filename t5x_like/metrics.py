"""Throughput accounting (Megatron TFLOPs, MFU), the Megatron log line, the metrics files, and
the training loop's watches and their hooks (records, throughput, spikes, divergence)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from t5x_like import runtime, summaries
from t5x_like.config import Config

# Dense bf16 peak TFLOP/s per device, from the vendors' data sheets (SXM parts).
BF16_PEAK_TFLOPS = {
    'A100': 312.0,
    'H100': 989.0,
    'H200': 989.0,
    'B200': 2250.0,
}


def megatron_flops_per_iteration(cfg: Config, global_batch_size: int, seq_len: int) -> float:
  """Megatron's model FLOPs per iteration: 24 c B s L h^2 (1 + s/(6h) + V/(16 L h)).

  c = 4 with full activation recomputation (one more forward), 3 otherwise.
  """
  m = cfg.model
  c = 4 if m.remat_policy == 'full' else 3
  h, L, V = m.hidden_size, m.num_layers, cfg.padded_vocab_size
  return (24 * c * global_batch_size * seq_len * L * h * h *
          (1 + seq_len / (6 * h) + V / (16 * L * h)))


def device_peak_tflops(dtype: str = 'float32') -> tuple[float, str]:
  """Peak TFLOP/s of ONE device and where the number comes from.

  GPUs: the bf16 data-sheet table. CPU: a matmul probe in the compute dtype measured now on the
  whole machine, divided by the number of this process's (virtual) devices that share it.
  """
  device = jax.local_devices()[0]
  if device.platform == 'gpu':
    for name, peak in BF16_PEAK_TFLOPS.items():
      if name in device.device_kind:
        return peak, f'{device.device_kind} bf16 data-sheet peak'
    raise RuntimeError(f'no bf16 peak known for GPU {device.device_kind!r}; add it to '
                       'metrics.BF16_PEAK_TFLOPS')
  machine = measure_matmul_tflops(dtype)
  share = machine / jax.local_device_count()
  return share, (f'CPU peak measured by a {dtype} matmul probe: {machine * 1e3:.1f} GFLOP/s for '
                 f'the machine, shared by {jax.local_device_count()} virtual device(s)')


class PeakReference:
  """A device's peak TFLOP/s for MFU (`device_peak_tflops`), measured when first asked for:
  on CPU its probe compiles a matmul, which waits until the run has started."""

  def __init__(self, dtype: str = 'float32'):
    self.dtype = dtype

  @functools.cached_property
  def measured(self) -> tuple[float, str]:
    """(TFLOP/s of one device, where the number comes from)."""
    return device_peak_tflops(self.dtype)


def measure_matmul_tflops(dtype: str = 'float32', n: int = 1024, repeats: int = 8) -> float:
  """Best-of-N TFLOP/s of an n x n x n matmul on this process's first device."""
  device = jax.local_devices()[0]
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  b = jax.device_put(jnp.ones((n, n), dtype), device)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n**3 / best / 1e12


def log_line(r: dict, total_iterations: int) -> str:
  """The Megatron-DeepSpeed iteration line (same fields, order and formatting)."""
  return (f" iteration {r['iteration']:8d}/{total_iterations:8d} |"
          f" consumed samples: {r['consumed_samples']:12d} |"
          f" consumed tokens: {r['consumed_tokens']:12d} |"
          f" elapsed time per iteration (s): {r['step_time_s']:.2f} |"
          f" learning rate: {r['learning_rate']:.3E} |"
          f" global batch size: {r['global_batch_size']:5d} |"
          f" lm loss: {r['lm_loss']:.6E} |"
          f" grad norm: {r['grad_norm']:.3f} |"
          f" num zeros: {r['num_zeros']:.1f} |" +
          (f" curriculum seqlen: {r['curriculum_seq_len']:5d} |"
           if 'curriculum_seq_len' in r else '') +
          f" number of skipped iterations: {r['skipped_iterations']:3d} |"
          f" number of nan iterations: {r['nan_iterations']:3d} |"
          f" samples per second: {r['samples_per_sec']:.3f} |"
          f" TFLOPs: {r['tflops']:.2f} |" +
          (f" pipeline bubble: {r['pipeline_bubble']:.3f} |" if 'pipeline_bubble' in r else ''))


def perplexity(loss: float) -> float:
  """Megatron's logged PPL: exp(min(20, loss)), so a diverged loss still prints a number."""
  return math.exp(min(20.0, loss))


def eval_lines(r: dict, at: str) -> list[str]:
  """Megatron's evaluation lines: a rule, '<set> loss at <at> | lm loss value | lm loss PPL', a
  rule (the chronicles' 'valid loss at iteration 45000 | lm loss value: 2.327091E+00 | ...')."""
  line = (f" {r['set']} loss at {at} | lm loss value: {r['lm_loss']:.6E} |"
          f" lm loss PPL: {r['ppl']:.6E} |")
  rule = '-' * len(line)
  return [rule, line, rule]


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
    return [{'global_batch_size': gbs, 'seq_len': seq, 'step_s': base, 'first': first,
             'last': last} for (gbs, seq), (base, first, last, _) in sorted(self._baseline.items())]

  def seed(self, baselines: list[dict]) -> None:
    """Baselines of an earlier job (`baselines()` of it) on the same setup."""
    for b in baselines:
      self._baseline[(b['global_batch_size'], b['seq_len'])] = (
          b['step_s'], b['first'], b['last'], "an earlier job's")

  def add(self, iteration: int, global_batch_size: int, seconds: float,
          seq_len: int = 0) -> str | None:
    """`seq_len`: the curriculum's length of this iteration (0 without a curriculum); each
    (global batch size, length) has its own baseline."""
    key = (global_batch_size, seq_len)
    self._seen[key] = self._seen.get(key, 0) + 1
    if self._seen[key] <= self.warmup:
      return None
    times = self._times.setdefault(key, [])
    times.append(seconds)
    del times[:-self.window]
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
      return (f'> throughput: the median step time of iterations {iteration - self.window + 1}-'
              f'{iteration} is {recent:.3g} s, {slower:.1%} above {whose} {base:.3g} s '
              f'(iterations {first}-{last}, global batch size {global_batch_size}{length}). If '
              'it stays, look for a slow device: python -m t5x_like.devices on the job\'s nodes '
              '(docs/operations.md, "Finding a slow device")')
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
    return (f'> diverged: iterations {self.first_non_finite}-{progress.iteration} '
            f'({self.consecutive} in a row, runtime.max_consecutive_nan={self.limit}) had a '
            f'non-finite loss or gradient norm and were skipped; the run stops with the state '
            f'of iteration {self.last_finite.iteration}, the last finite one')


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
        reasons.append(f'lm loss {lm_loss:.4f} is {lm_loss / loss_median - 1:.0%} above the '
                       f'median {loss_median:.4f}')
      if self.grad_factor and grad_norm > grad_median * self.grad_factor:
        reasons.append(f'grad norm {grad_norm:.3f} is {grad_norm / grad_median:.1f}x the median '
                       f'{grad_median:.3f}')
    # The spike joins the window: if the loss stays there, it is the new level, not a spike.
    for values, value in ((self._losses, lm_loss), (self._grad_norms, grad_norm)):
      values.append(value)
      del values[:-self.window]
    was_in_spike, self._in_spike = self._in_spike, bool(reasons)
    if not reasons or was_in_spike:
      return None
    return (f'> spike at iteration {iteration}: ' + '; '.join(reasons) +
            f' of the previous {self.window} iterations')


# ---------------------------------------------------------------- the training loop's hooks
# The watches above and the records, as hooks of t5x_like/hooks.py (fn(info: hooks.StepInfo)).
# `log(line)` writes a line to the run's log; `alert(event, message, iteration)` is
# alerts.Alerts.send. Iterations that did not run the train step are not watched.


def iteration_record(cfg: Config, progress, learning_rate: float, global_batch_size: int,
                     seq_len: int, padded_seq_len: int, step_microbatches: int, stats: dict,
                     step_time_s: float, peak_tflops: float,
                     pipeline_bubble: float | None) -> dict[str, Any]:
  """The metrics record of a trained iteration (metrics.jsonl): `progress` after it (a
  train_state.Progress), the step's `stats` on the host, and what it ran at."""
  gbs, seq = global_batch_size, seq_len
  tflops = (megatron_flops_per_iteration(cfg, gbs, seq) /
            (step_time_s * cfg.mesh.num_devices * 1e12))
  record = {
      'iteration': progress.iteration, 'consumed_samples': progress.consumed_samples,
      'consumed_tokens': progress.consumed_tokens, 'learning_rate': learning_rate,
      'global_batch_size': gbs, 'seq_len': seq, 'lm_loss': float(stats['lm_loss']),
      'grad_norm': float(stats['grad_norm']), 'num_zeros': float(stats['num_zeros']),
      'step_time_s': step_time_s, 'samples_per_sec': gbs / step_time_s,
      'tokens_per_sec': gbs * seq / step_time_s, 'tflops': tflops, 'mfu': tflops / peak_tflops,
      'skipped_iterations': progress.skipped_iterations,
      'nan_iterations': progress.nan_iterations,
  }
  if pipeline_bubble is not None:
    record['pipeline_bubble'] = pipeline_bubble
  if cfg.curriculum.enabled:
    record['curriculum_seq_len'] = seq
  if cfg.curriculum.pad_to_multiple:
    record['padded_seq_len'] = padded_seq_len
  if cfg.train.rampup_microbatch_multiple:
    record['padded_microbatches'] = step_microbatches
  return record


def record_hook(writer: MetricsWriter, total_iterations: int):
  """Every iteration: the Megatron log line and the metrics record (metrics.jsonl, TensorBoard)."""
  def write_record(info) -> None:
    if info.record is not None:
      writer.record(info.record, total_iterations)
  return write_record


def end_line_hook(log: Callable[[str], None]):
  """At the end and on a stop: the run's last line, '> done: ...' or '> stopped: ...' with its
  exit code; kept in info.message for the hooks after it (alerts)."""
  def log_end(info) -> None:
    code = runtime.exit_code(info.stop_reason)
    info.message = (f'> {"done" if info.stop_reason is None else "stopped"}: '
                    f'{info.iteration} iterations, {info.progress.consumed_samples} samples; '
                    f'exit code {int(code)} ({code.name})')
    log(info.message)
  return log_end


def throughput_setup(cfg: Config, software: dict[str, Any]) -> dict[str, Any]:
  """What the step time depends on besides the data: devices, mesh, model, micro-batch, the
  ramp-up's padding, software (fixed for a job). Step-time baselines carry over from an earlier
  job only when this is equal."""
  device = jax.devices()[0]
  setup = {'platform': device.platform, 'device_kind': device.device_kind,
           'devices': jax.device_count(), 'processes': jax.process_count(),
           'mesh': dataclasses.asdict(cfg.mesh), 'pipeline': dataclasses.asdict(cfg.pipeline),
           'model': dataclasses.asdict(cfg.model), 'micro_batch_size': cfg.train.micro_batch_size,
           # A ramp-up step padded to more micro-batches takes longer under a pipeline.
           'rampup_microbatch_multiple': cfg.train.rampup_microbatch_multiple,
           'software': software}
  return json.loads(json.dumps(setup))  # as the checkpoint's meta holds it (lists, not tuples)


def resumed_throughput_watch(cfg: Config, software: dict[str, Any], saved: dict[str, Any] | None
                             ) -> tuple[ThroughputWatch, dict[str, Any], str | None]:
  """The run's throughput watch, its setup, and the note on the checkpoint's baselines (`saved`:
  the meta's 'throughput'), which seed the watch when their job ran on the same setup."""
  # A GPU's step time is steady to 1-2%, so 5% is a real slowdown (tr11's slow GPU). A CPU's
  # moves by 10-20% with whatever else the machine runs: only a larger change is.
  watch = ThroughputWatch(threshold=0.25 if jax.devices()[0].platform == 'cpu' else 0.05)
  setup = throughput_setup(cfg, software)
  return watch, setup, seed_throughput(watch, saved, setup)


def seed_throughput(watch: ThroughputWatch, saved: dict[str, Any] | None,
                    setup: dict[str, Any]) -> str | None:
  """Seeds `watch` with the checkpoint's step-time baselines (its meta's 'throughput') when its
  job ran on the same setup; the note for the log, or None when there is nothing to say."""
  if not saved or not saved['baselines']:
    return None
  if saved['setup'] != setup:
    return ('> throughput: the checkpoint\'s job ran on another setup (devices, mesh, model or '
            'software); this job measures its own step-time baseline')
  watch.seed(saved['baselines'])
  first = saved['baselines'][0]
  return (f"> throughput: step times are compared with the earlier job's baseline from the "
          f"start ({first['step_s']:.3g} s at global batch size {first['global_batch_size']}"
          f"{', ...' if len(saved['baselines']) > 1 else ''}): a device slow from this job's "
          'start is reported too')


def throughput_hook(watch: ThroughputWatch, log: Callable[[str], None], alert,
                    curriculum: bool):
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


# TensorBoard runs, subdirectories of `runtime.tensorboard_dir` ('' is the directory itself), and
# the record field each uses as its x axis. Megatron-DeepSpeed also plots against consumed samples
# and tokens ("lm loss vs tokens": the only fair axis across runs with a batch-size ramp or a
# sequence-length curriculum). Each axis has its own run because a resumed run tells TensorBoard
# to drop the earlier events from its first step on (summaries.py), and that rule compares one
# step number across all tags of a run.
TENSORBOARD_RUNS = (('', 'iteration'), ('vs_samples', 'consumed_samples'),
                    ('vs_tokens', 'consumed_tokens'))

# (tag, record field) per iteration: Megatron-DeepSpeed's tag groups with '_' for their spaces
# (TensorBoard's own writers replace characters other than letters, digits, '-', '_', '.', '/'
# the same way).
_TRAINING_TAGS = (
    ('lm-loss-training/lm_loss', 'lm_loss'),
    ('learning-rate/learning-rate', 'learning_rate'),
    ('batch-size/batch-size', 'global_batch_size'),
    ('grad-norm/grad-norm', 'grad_norm'),
    ('num-zeros/num-zeros', 'num_zeros'),
    ('seqlen/curriculum_seqlen', 'curriculum_seq_len'))
# Only against the iteration: counters and speed.
_ITERATION_ONLY_TAGS = (
    ('consumed/samples', 'consumed_samples'),
    ('consumed/tokens', 'consumed_tokens'),
    ('iteration-time/iteration-time', 'step_time_s'),
    ('iteration-time/samples_per_second', 'samples_per_sec'),
    ('iteration-time/TFLOPs_per_device', 'tflops'),
    ('iteration-time/MFU', 'mfu'),
    ('skipped/skipped_iterations', 'skipped_iterations'),
    ('skipped/nan_iterations', 'nan_iterations'))


def _by_run(record: dict, tags: dict[str, tuple[tuple[str, str], ...]]
            ) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]}; a run's tags carry its axis as a suffix (`lm_loss_vs_tokens`,
  Megatron's "lm loss vs tokens"), so runs of several workdirs overlay by tag in TensorBoard."""
  out = {}
  for run, axis in TENSORBOARD_RUNS:
    if axis not in record:
      continue
    suffix = f'_{run}' if run else ''
    out[run] = [(tag + suffix, record[key], record[axis])
                for tag, key in tags[run] if key in record]
  return out


def tensorboard_scalars(record: dict) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]} of one iteration's record (TENSORBOARD_RUNS)."""
  return _by_run(record, {'': _TRAINING_TAGS + _ITERATION_ONLY_TAGS,
                          'vs_samples': _TRAINING_TAGS, 'vs_tokens': _TRAINING_TAGS})


def tensorboard_eval_scalars(record: dict) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]} of one evaluated set: `lm-loss-validation/<set>_lm_loss` and its
  PPL."""
  tag = f"lm-loss-validation/{record['set']}_lm_loss"
  tags = ((tag, 'lm_loss'), (f'{tag}_PPL', 'ppl'))
  return _by_run(record, {run: tags for run, _ in TENSORBOARD_RUNS})


class MetricsWriter:
  """Appends to WORKDIR/logs/main_log.txt, WORKDIR/metrics.jsonl (one record per trained
  iteration) and WORKDIR/eval_metrics.jsonl (one per evaluated set), and writes the same numbers
  as TensorBoard scalars (clu.metric_writers, summaries.py) under `tensorboard_dir` ('': none),
  with the config as text (`config_text`); only process 0 writes. Use as a
  context manager, or call close(), so the last TensorBoard events reach the disk."""

  def __init__(self, workdir: str, enabled: bool = True, tensorboard_dir: str = ''):
    self.enabled = enabled
    self.log_path = os.path.join(workdir, 'logs', 'main_log.txt')
    self.jsonl_path = os.path.join(workdir, 'metrics.jsonl')
    self.eval_jsonl_path = os.path.join(workdir, 'eval_metrics.jsonl')
    # Relative to the workdir; an absolute path is kept as it is.
    self.tensorboard_dir = os.path.join(workdir, tensorboard_dir) if tensorboard_dir else ''
    self._tensorboard: dict[str, summaries.RunWriter] = {}  # created on first use
    self._purge_steps: dict[str, int] = {}
    # Lines logged before the run started (`open`) are printed at once and kept for the log file:
    # a run refused at start-up leaves no file behind.
    self._pending: list[str] | None = []

  @property
  def opened(self) -> bool:
    return self._pending is None

  def open(self) -> None:
    """The run starts: creates the log directory and writes the lines logged so far."""
    pending, self._pending = self._pending, None
    if self.enabled:
      os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
      with open(self.log_path, 'a') as f:
        f.writelines(line + '\n' for line in pending or ())

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    for writer in self._tensorboard.values():
      writer.close()
    self._tensorboard = {}

  def truncate_after(self, iteration: int, consumed_samples: int, consumed_tokens: int) -> None:
    """Drops records past `iteration` (written after the checkpoint a restart resumes from, which
    had consumed these samples and tokens)."""
    if not self.enabled:
      return
    for path in (self.jsonl_path, self.eval_jsonl_path):
      if not os.path.exists(path):
        continue
      with open(path) as f:
        keep = [line for line in f if _iteration_of(line) <= iteration]
      tmp = path + '.tmp'
      with open(tmp, 'w') as f:
        f.writelines(keep)
      os.replace(tmp, path)
    # TensorBoard hides the events of a run's earlier files from this step on (summaries.py).
    at = {'iteration': iteration, 'consumed_samples': consumed_samples,
          'consumed_tokens': consumed_tokens}
    self._purge_steps = {run: at[axis] + 1 for run, axis in TENSORBOARD_RUNS}

  def info(self, message: str) -> None:
    """A line for stdout and main_log.txt."""
    if not self.enabled:
      return
    try:
      print(message, flush=True)
    except OSError:
      # The terminal is gone (a SIGHUP is on its way) or the reader of the pipe ended: the run
      # goes on, and the log file has every line.
      runtime.silence(sys.stdout)
    if self._pending is not None:
      self._pending.append(message)
      return
    with open(self.log_path, 'a') as f:
      f.write(message + '\n')

  def record(self, record: dict, total_iterations: int) -> None:
    self.info(log_line(record, total_iterations))
    self._append(self.jsonl_path, record)
    self._scalars(tensorboard_scalars(record))

  def eval_record(self, record: dict, at: str) -> None:
    for line in eval_lines(record, at):
      self.info(line)
    self._append(self.eval_jsonl_path, record)
    self._scalars(tensorboard_eval_scalars(record))

  def config_text(self, config_json: str, iteration: int) -> None:
    """The resolved config as TensorBoard text (tag `config`, run ''), at the job's first
    `iteration`: one entry per job, replaced with the iterations when a job is redone."""
    if not (self.enabled and self.tensorboard_dir):
      return
    code_block = ''.join(f'    {line}\n' for line in config_json.splitlines())  # Markdown
    self._run('').texts(iteration, {'config': code_block})

  def _run(self, run: str) -> summaries.RunWriter:
    if run not in self._tensorboard:
      self._tensorboard[run] = summaries.RunWriter(os.path.join(self.tensorboard_dir, run),
                                                   self._purge_steps.get(run))
    return self._tensorboard[run]

  def _scalars(self, scalars: dict[str, list[tuple[str, float, int]]]) -> None:
    if not (self.enabled and self.tensorboard_dir):
      return
    for run, run_scalars in scalars.items():
      by_step: dict[int, dict[str, float]] = {}
      for tag, value, step in run_scalars:
        by_step.setdefault(int(step), {})[tag] = float(value)
      for step, values in by_step.items():
        self._run(run).scalars(step, values)

  def _append(self, path: str, record: dict) -> None:
    if self.enabled:
      with open(path, 'a') as f:
        f.write(json.dumps(record) + '\n')


def _iteration_of(line: str) -> float:
  """A record's iteration; a line torn by a kill mid-write counts as past every checkpoint."""
  try:
    return json.loads(line)['iteration']
  except (ValueError, KeyError, TypeError):
    return float('inf')
