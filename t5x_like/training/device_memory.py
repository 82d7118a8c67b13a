"""Device memory: what JAX may allocate on one accelerator, and what a compiled program needs
there by XLA's figure."""

from __future__ import annotations

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
