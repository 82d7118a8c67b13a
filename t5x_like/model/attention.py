"""The one place that picks and runs the attention implementation (`model.attention_impl`).

* 'xla': `attention_reference` (plain JAX; the partitioner splits heads over `tensor`).
* 'pallas': the fused flash-attention kernels (`t5x_like.kernels.flash_attention`); Triton on GPU,
  interpret mode automatically on CPU.
* 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')` with a materialised ALiBi bias.

The fused ones run per shard under the mesh: a `shard_map` over the batch (`data`) and head
(`tensor`) axes, each shard with the ALiBi slopes of its own (contiguous) heads.

Decoding with a KV cache attends one new token per row to the cached keys (`cached_attention`):
plain JAX whatever the implementation, as a matrix-vector product gains nothing from tiling.

Fail fast, like Megatron's --abort-on-unmet-fused-kernel-constraints: a fused implementation that
cannot run the model's head_dim / dtype / platform is a ConfigError naming the constraint, at
config validation where the constraint is known then (the platform only when JAX has started or is
CPU-only) and again when the model is traced. With `model.attention_fallback=True` it is a warning
that says 'xla' runs instead.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from t5x_like.errors import ConfigError
from t5x_like.kernels.flash_attention import flash_attention
from t5x_like.kernels.flash_attention import unmet_constraints as flash_unmet_constraints
from t5x_like.kernels.reference import attention_reference
from t5x_like.mesh import partitioning

if TYPE_CHECKING:  # annotations only (they are strings here)
  from t5x_like.config import ModelConfig

IMPLEMENTATIONS = ('xla', 'pallas', 'cudnn')


def unmet_constraints(impl: str, *, head_dim: int, dtype, platform: str | None) -> list[str]:
  """What stops `impl` from running this head_dim / dtype on this platform (None: not known yet)."""
  dtype = jnp.dtype(dtype).name
  problems = []
  if impl == 'pallas':
    problems += flash_unmet_constraints(head_dim=head_dim, dtype=dtype)
    if platform not in (None, 'gpu', 'cpu'):
      problems.append(
        f'the Pallas kernels lower through Triton (GPU) or run in interpret mode '
        f'(CPU); this process has {platform} devices'
      )
  elif impl == 'cudnn':
    if platform not in (None, 'gpu'):
      problems.append(
        f'cuDNN attention needs a GPU (jax.nn.dot_product_attention('
        f"implementation='cudnn')); this process has {platform} devices"
      )
    if dtype not in ('bfloat16', 'float16'):
      problems.append(f'cuDNN fused attention needs model.dtype bfloat16 or float16, got {dtype}')
    if head_dim % 8 or head_dim > 128:
      problems.append(
        f'cuDNN fused attention needs head_dim a multiple of 8 and at most 128, got {head_dim}'
      )
  return problems


def check_config(cfg: ModelConfig) -> None:
  """Config-time check (no JAX backend is started here): raises unless fallback is allowed."""
  resolve_impl(cfg, _platform_if_known(), quiet=True)


def resolve_impl(cfg: ModelConfig, platform: str | None, quiet: bool = False) -> str:
  """The implementation that runs: cfg.attention_impl, or 'xla' with a warning if allowed."""
  impl = cfg.attention_impl
  if impl not in IMPLEMENTATIONS:
    raise ConfigError(f'model.attention_impl must be one of {IMPLEMENTATIONS}, got {impl!r}')
  problems = unmet_constraints(impl, head_dim=cfg.head_dim, dtype=cfg.dtype, platform=platform)
  if impl == 'xla' or not problems:
    return impl
  message = f'model.attention_impl={impl!r} cannot run this model: {"; ".join(problems)}'
  if not cfg.attention_fallback:
    raise ConfigError(
      f"{message}. Use model.attention_impl='xla', or set "
      "model.attention_fallback=True to run 'xla' with a warning"
    )
  if not quiet:
    warnings.warn(
      f"{message}; running model.attention_impl='xla' instead (model.attention_fallback=True)",
      RuntimeWarning,
      stacklevel=3,
    )
  return 'xla'


def attention(q, k, v, *, cfg: ModelConfig, mesh: Mesh | None, alibi_slopes=None, dropout_rng=None):
  """Causal self-attention of [batch, seq, heads, head_dim] q, k, v with the configured kernel."""
  platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
  impl = resolve_impl(cfg, platform)
  if impl == 'xla':
    return attention_reference(
      q,
      k,
      v,
      alibi_slopes=alibi_slopes,
      causal=True,
      dropout_rate=cfg.attention_dropout,
      dropout_rng=dropout_rng,
    )
  kernel: Callable[..., Any]
  if impl == 'pallas':
    kernel = functools.partial(flash_attention, causal=True, interpret=platform == 'cpu')
  else:
    kernel = cudnn_attention
  if mesh is None:
    return kernel(q, k, v, alibi_slopes=alibi_slopes)
  return _per_shard(kernel, q, k, v, alibi_slopes, mesh)


def cached_attention(q, k, v, positions, cache_k, cache_v, *, alibi_slopes=None):
  """Attention of new tokens to a KV cache and to each other (decoding), plain JAX under any
  attention_impl.

  q, k, v: [batch, new, heads, head_dim] of the new tokens, at `positions` [batch, new]
  (consecutive on each row, from the row's own start). cache_k: [batch, heads, head_dim, cache]
  and cache_v: [batch, heads, cache, head_dim], entry j the key and value of position j. A row's
  entries from its first new position on are masked out (not written yet, or what a longer
  prompt of the batch left there): the new tokens' keys and values are used instead, causally,
  and written by the caller after the layers (written here first, XLA copied each layer's
  cache to update it, docs/benchmarks.md). The arithmetic is
  attention_reference's (fp32 scores, the bias slope * (key - query), the mask as a finfo.min
  bias, the softmax normalised after the second matmul), so a token's output is the one a
  forward over its whole sequence computes, to rounding. Returns [batch, new, heads, head_dim].
  """
  f32 = jnp.float32
  scale = 1.0 / math.sqrt(q.shape[-1])
  q_pos = positions.astype(f32)[:, None, :, None]  # [batch, 1, new, 1]
  cache_pos = jnp.arange(cache_k.shape[-1], dtype=f32)[None, None, None, :]
  new_pos = positions.astype(f32)[:, None, None, :]  # [batch, 1, 1, new]

  def bias(k_pos, visible):  # [batch, heads|1, new, keys]
    if alibi_slopes is None:
      return jnp.where(visible, 0.0, jnp.finfo(f32).min)
    alibi = jnp.asarray(alibi_slopes, f32)[None, :, None, None] * (k_pos - q_pos)
    return jnp.where(visible, alibi, jnp.finfo(f32).min)

  first = q_pos[:, :, :1]  # each row's first new position
  scores = jnp.concatenate(
    [
      jnp.einsum('bqnd,bndk->bnqk', q, cache_k, preferred_element_type=f32) * scale
      + bias(cache_pos, cache_pos < first),
      jnp.einsum('bqnd,bknd->bnqk', q, k, preferred_element_type=f32) * scale
      + bias(new_pos, new_pos <= q_pos),
    ],
    -1,
  )
  weights = jnp.exp(scores - scores.max(-1, keepdims=True))
  total = weights.sum(-1, keepdims=True)
  weights = weights.astype(v.dtype)
  cached = cache_k.shape[-1]
  out = jnp.einsum('bnqk,bnkd->bnqd', weights[..., :cached], cache_v, preferred_element_type=f32)
  out = out + jnp.einsum('bnqk,bknd->bnqd', weights[..., cached:], v, preferred_element_type=f32)
  return jnp.swapaxes(out / total, 1, 2).astype(v.dtype)


def cudnn_attention(q, k, v, *, alibi_slopes=None):
  """Causal attention on cuDNN; ALiBi as a materialised [1, heads, seq, seq] bias."""
  bias = None
  if alibi_slopes is not None:
    pos = jnp.arange(q.shape[1], dtype=jnp.float32)
    slopes = jnp.asarray(alibi_slopes, jnp.float32)
    bias = (slopes[:, None, None] * (pos[None, None, :] - pos[None, :, None]))[None]
    bias = bias.astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation='cudnn')


def _per_shard(kernel, q, k, v, alibi_slopes, mesh: Mesh):
  """Runs `kernel` on each (batch, heads) shard; heads are split contiguously, so are the slopes."""
  qkv_spec = partitioning.logical_to_mesh(('batch', 'length', 'act_heads', None), mesh)
  heads_spec = partitioning.logical_to_mesh(('act_heads',), mesh)
  run: Callable[..., Any]
  operands: tuple[Any, ...]
  in_specs: tuple[P, ...]
  if alibi_slopes is None:
    run = lambda q, k, v: kernel(q, k, v)
    operands, in_specs = (q, k, v), (qkv_spec,) * 3
  else:
    run = lambda q, k, v, slopes: kernel(q, k, v, alibi_slopes=slopes)
    operands = (q, k, v, jnp.asarray(alibi_slopes, jnp.float32))
    in_specs = (qkv_spec,) * 3 + (heads_spec,)
  # The kernels are opaque to the varying-axes type system, hence check_vma=False; every operand
  # and the output are split exactly as the specs say, so nothing needs a collective.
  return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=qkv_spec, check_vma=False)(
    *operands
  )


def _platform_if_known() -> str | None:
  """The device platform without starting a backend (which would fix the CPU device count)."""
  if partitioning.backends_started():
    return jax.devices()[0].platform
  return 'cpu' if partitioning.cpu_only() else None
