"""Device memory: what JAX may allocate on one accelerator, what a compiled program needs there
by XLA's figure, and what the allocator counts as the run goes (Megatron's "memory (MB) |
allocated | max allocated" line, which the chronicles took from nvidia-smi by hand)."""

from __future__ import annotations

from collections.abc import Callable

import jax


def accelerator_memory() -> tuple[int, str] | None:
  """(bytes, device kind) that JAX may allocate on one local accelerator (its memory fraction,
  75% by default); None on CPU, whose devices share the host's memory."""
  device = jax.local_devices()[0]
  limit = (device.memory_stats() or {}).get('bytes_limit')
  return (int(limit), device.device_kind) if limit else None


def peak_bytes(memory) -> int:
  """XLA's peak per device of a compiled program from its `memory_analysis()`: the arguments,
  outputs and temporaries, less the outputs that reuse (alias) donated arguments. On a GPU the
  allocator's measured peak equals it (docs/benchmarks.md)."""
  return (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  )


def allocator_bytes() -> tuple[int, int] | None:
  """(peak, in use now) in bytes by the allocator's own count, on the most loaded of this
  process's devices; None where the devices keep no count (CPU)."""
  counts = [d.memory_stats() or {} for d in jax.local_devices()]
  counts = [c for c in counts if 'peak_bytes_in_use' in c]
  if not counts:
    return None
  return max(c['peak_bytes_in_use'] for c in counts), max(c.get('bytes_in_use', 0) for c in counts)


def report_hook(log: Callable[[str], None], limit: tuple[int, str] | None):
  """A hook (hooks.py) that logs the allocator's peak once a job, after its first trained
  iteration, against `limit` (accelerator_memory()'s); nothing where there is no count."""
  reported: list[int] = []

  def memory_report(info) -> None:
    if reported or not info.trained:
      return
    reported.append(info.iteration)
    counted = allocator_bytes()
    if counted is None:
      return
    gib = 2**30
    of = f' of the {limit[0] / gib:.2f} GiB JAX may use on one {limit[1]}' if limit else ''
    log(
      f'> device memory after iteration {info.iteration}: peak {counted[0] / gib:.2f} GiB{of}, '
      f"{counted[1] / gib:.2f} GiB in use between iterations (the allocator's count, the most "
      "loaded of this process's devices; metrics.jsonl's peak_memory_gib follows it)"
    )

  return memory_report
