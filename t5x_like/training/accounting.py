"""Throughput accounting: Megatron's model FLOPs per iteration, TFLOP/s and MFU against a
device's peak (a data-sheet table on GPUs, a matmul probe on CPU), the iteration's record and
the perplexity Megatron logs."""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

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
  return (
    24 * c * global_batch_size * seq_len * L * h * h * (1 + seq_len / (6 * h) + V / (16 * L * h))
  )


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
    raise RuntimeError(
      f'no bf16 peak known for GPU {device.device_kind!r}; add it to metrics.BF16_PEAK_TFLOPS'
    )
  machine = measure_matmul_tflops(dtype)
  share = machine / jax.local_device_count()
  return share, (
    f'CPU peak measured by a {dtype} matmul probe: {machine * 1e3:.1f} GFLOP/s for '
    f'the machine, shared by {jax.local_device_count()} virtual device(s)'
  )


class PeakReference:
  """A device's peak TFLOP/s for MFU (`device_peak_tflops`), measured when first asked for:
  on CPU its probe compiles a matmul, which waits until the run has started."""

  def __init__(self, dtype: str = 'float32'):
    self.dtype = dtype

  @functools.cached_property
  def measured(self) -> tuple[float, str]:
    """(TFLOP/s of one device, where the number comes from)."""
    return device_peak_tflops(self.dtype)

  def describe(self) -> str:
    """The log line that names the reference (it measures it, if not yet done)."""
    tflops, source = self.measured
    return f'> MFU reference: {tflops:.4f} TFLOP/s per device ({source})'


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


def perplexity(loss: float) -> float:
  """Megatron's logged PPL: exp(min(20, loss)), so a diverged loss still prints a number."""
  return math.exp(min(20.0, loss))


def iteration_record(
  cfg: Config,
  progress,
  learning_rate: float,
  global_batch_size: int,
  seq_len: int,
  padded_seq_len: int,
  step_microbatches: int,
  stats: dict,
  step_time_s: float,
  peak_tflops: float,
  pipeline_bubble: float | None,
) -> dict[str, Any]:
  """The metrics record of a trained iteration (metrics.jsonl): `progress` after it (a
  train_state.Progress), the step's `stats` on the host, and what it ran at."""
  gbs, seq = global_batch_size, seq_len
  tflops = megatron_flops_per_iteration(cfg, gbs, seq) / (step_time_s * cfg.mesh.num_devices * 1e12)
  record = {
    'iteration': progress.iteration,
    'consumed_samples': progress.consumed_samples,
    'consumed_tokens': progress.consumed_tokens,
    'learning_rate': learning_rate,
    'global_batch_size': gbs,
    'seq_len': seq,
    'lm_loss': float(stats['lm_loss']),
    'grad_norm': float(stats['grad_norm']),
    'num_zeros': float(stats['num_zeros']),
    'step_time_s': step_time_s,
    'samples_per_sec': gbs / step_time_s,
    'tokens_per_sec': gbs * seq / step_time_s,
    'tflops': tflops,
    'mfu': tflops / peak_tflops,
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
