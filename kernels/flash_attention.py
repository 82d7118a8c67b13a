"""Flash attention with in-kernel ALiBi, forward and backward, as Pallas kernels.

    from t5x_like.kernels import flash_attention
    out = flash_attention(q, k, v, alibi_slopes=slopes, causal=True)

The kernels use the Triton lowering (`jax.experimental.pallas.triton`), so A100 and H100 both run
them; on CPU `interpret=True` runs the same kernel bodies through XLA, which is how the tests check
them against `attention_reference`.

* q, k, v: [batch, seq, heads, head_dim], the same shape and dtype (float32, bfloat16, float16);
  head_dim a power of two in [16, 256] (Triton's dot needs every tile dim >= 16).
* The ALiBi bias slope[h] * (key_pos - query_pos) is computed per tile from the slope of the
  program's head; no [heads, seq, seq] bias ever exists. Scores, the online softmax and every
  accumulator are fp32; p and dS are cast to the input dtype for their matmuls (as FlashAttention).
* Causal: tiles above the diagonal are never visited, and tiles fully below it skip the mask.
* segment_ids [batch, seq] (packed documents): a query sees only keys of its own segment.
* Any sequence length: q/k/v are padded up to the block multiple, padded keys are masked out of
  the softmax (causal needs no mask: real queries never reach them), and the output is cut back.
* Backward (`jax.custom_vjp`): the forward saves only the output and the log-sum-exp (named
  `residuals.ATTENTION_RESIDUALS`, so that remat_policy='save_dots' keeps them); one kernel
  recomputes the tiles for dK/dV (one program per key block, looping over query blocks) and one
  for dQ (one program per query block, looping over key blocks), so no atomics are needed.

Unsupported inputs raise `FlashAttentionConstraintError` naming the constraint, before any tracing
of the kernels (`unmet_constraints` lists them without raising).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from t5x_like.kernels.residuals import mark_residuals

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)
SUPPORTED_DTYPES = ('float32', 'bfloat16', 'float16')
MIN_BLOCK = 16  # Triton's dot needs tiles of at least 16 x 16.
_LOG2E = math.log2(math.e)
# Finite, so a row with every key masked (only padding rows can have one) gives a uniform softmax
# instead of NaNs that would leak into the backward pass through 0 * NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class FlashAttentionConstraintError(ValueError):
  """An input the Pallas flash-attention kernels do not support; the message names the rule."""


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two >= 16) and Triton launch parameters.

  Forward: one program per (block_q queries, batch, head), looping over block_k keys. Backward:
  dK/dV programs own block_k_dkv keys and loop over block_q_dkv queries; dQ programs own block_q_dq
  queries and loop over block_k_dq keys. Blocks larger than the (power-of-two rounded) sequence
  are shrunk to it, so short sequences are not padded to 128.
  """

  block_q: int = 128
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  block_q_dq: int = 64
  block_k_dq: int = 64
  num_warps: int | None = None  # None: 4 for head_dim <= 64, else 8.
  num_stages: int = 2

  @classmethod
  def for_head_dim(cls, head_dim: int) -> BlockSizes:
    """Defaults: head_dim 128 as measured on an H100; the others from the Triton fused-attention
    tutorial's configurations."""
    if head_dim <= 64:
      return cls(block_q=128, block_k=64, num_warps=4, num_stages=3)
    if head_dim <= 128:  # 128-row tiles throughout: the H100 sweep in docs/benchmarks.md.
      return cls(
        block_q=128,
        block_k=128,
        block_q_dkv=128,
        block_k_dkv=128,
        block_q_dq=128,
        block_k_dq=128,
        num_warps=8,
        num_stages=2,
      )
    return cls(
      block_q=64,
      block_k=32,
      block_q_dkv=32,
      block_k_dkv=32,
      block_q_dq=32,
      block_k_dq=32,
      num_warps=8,
      num_stages=1,
    )

  def blocks(self) -> tuple[int, ...]:
    return (
      self.block_q,
      self.block_k,
      self.block_q_dkv,
      self.block_k_dkv,
      self.block_q_dq,
      self.block_k_dq,
    )

  def fitted_to(self, seq_len: int) -> BlockSizes:
    cap = max(MIN_BLOCK, pl.next_power_of_2(seq_len))
    fitted = {
      f: min(getattr(self, f), cap)
      for f in ('block_q', 'block_k', 'block_q_dkv', 'block_k_dkv', 'block_q_dq', 'block_k_dq')
    }
    return dataclasses.replace(self, **fitted)


def unmet_constraints(
  *, head_dim: int, dtype, shapes_match: bool = True, block_sizes: BlockSizes | None = None
) -> list[str]:
  """Every constraint of the kernels the arguments violate (empty: supported)."""
  problems = []
  if not shapes_match:
    problems.append(
      'q, k and v must have the same shape [batch, seq, heads, head_dim] and dtype '
      '(self-attention; no grouped or cross attention)'
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    problems.append(
      f'head_dim must be one of {SUPPORTED_HEAD_DIMS} (a power of two >= 16 for '
      f"Triton's tiles), got {head_dim}"
    )
  if jnp.dtype(dtype).name not in SUPPORTED_DTYPES:
    problems.append(f'dtype must be one of {SUPPORTED_DTYPES}, got {jnp.dtype(dtype).name}')
  for size in block_sizes.blocks() if block_sizes else ():
    if size < MIN_BLOCK or size & (size - 1):
      problems.append(f'block sizes must be powers of two >= {MIN_BLOCK}, got {size}')
      break
  return problems


def flash_attention(
  q,
  k,
  v,
  *,
  alibi_slopes=None,
  causal: bool = True,
  segment_ids=None,
  sm_scale: float | None = None,
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
):
  """softmax(q k^T * sm_scale + alibi, causal, segments) v: [batch, seq, heads, head_dim].

  alibi_slopes: [heads]; bias slope[h] * (key_pos - query_pos). sm_scale None: 1/sqrt(head_dim).
  segment_ids: [batch, seq] integers. interpret=True runs the kernels on CPU through XLA.
  Differentiable in q, k and v (Pallas backward kernels).
  """
  if q.ndim != 4:
    raise FlashAttentionConstraintError(f'q must be [batch, seq, heads, head_dim], got {q.shape}')
  batch, seq_len, num_heads, head_dim = q.shape
  block_sizes = block_sizes or BlockSizes.for_head_dim(head_dim)
  same = q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
  problems = unmet_constraints(
    head_dim=head_dim, dtype=q.dtype, shapes_match=same, block_sizes=block_sizes
  )
  if alibi_slopes is not None and np.shape(alibi_slopes) != (num_heads,):
    problems.append(
      f'alibi_slopes must have shape [heads] = ({num_heads},), got {np.shape(alibi_slopes)}'
    )
  if segment_ids is not None and (
    np.shape(segment_ids) != (batch, seq_len) or not jnp.issubdtype(segment_ids.dtype, jnp.integer)
  ):
    problems.append(f'segment_ids must be integers of shape [batch, seq] = ({batch}, {seq_len})')
  if problems:
    raise FlashAttentionConstraintError('flash_attention: ' + '; '.join(problems))

  blocks = block_sizes.fitted_to(seq_len)
  padded_len = -(-seq_len // max(blocks.blocks())) * max(blocks.blocks())
  static = _Static(
    causal=causal,
    sm_scale=float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim),
    # Causal attention never lets a real query reach a padded key; otherwise mask them.
    kv_len=seq_len if padded_len != seq_len and not causal else None,
    blocks=blocks,
    interpret=interpret,
  )
  if padded_len != seq_len:
    pad = [(0, 0), (0, padded_len - seq_len), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
    if segment_ids is not None:
      segment_ids = jnp.pad(segment_ids, [(0, 0), (0, padded_len - seq_len)])
  slopes = None if alibi_slopes is None else jnp.asarray(alibi_slopes, jnp.float32)
  if segment_ids is not None:
    segment_ids = segment_ids.astype(jnp.int32)
  out = _flash(q, k, v, slopes, segment_ids, static)
  return out[:, :seq_len]


@dataclasses.dataclass(frozen=True)
class _Static:
  causal: bool
  sm_scale: float
  kv_len: int | None  # The real sequence length when padded keys must be masked.
  blocks: BlockSizes
  interpret: bool

  def compiler_params(self, head_dim: int):
    warps = self.blocks.num_warps or (4 if head_dim <= 64 else 8)
    return plgpu.CompilerParams(num_warps=warps, num_stages=self.blocks.num_stages)


# ------------------------------------------------------------------------------- tile algebra


def _tile_scores(
  q,
  k,
  *,
  q_start,
  k_start,
  block_q,
  block_k,
  scale2,
  slope2,
  q_seg,
  k_seg,
  causal_mask: bool,
  kv_len: int | None,
):
  """Masked scores of one [block_q, block_k] tile in the log2 domain (exp2 is the fast one)."""
  s = plgpu.dot(q, k, trans_b=True) * scale2
  q_pos = q_start + jnp.arange(block_q)
  k_pos = k_start + jnp.arange(block_k)
  if slope2 is not None:
    s = s + slope2 * (k_pos[None, :] - q_pos[:, None]).astype(jnp.float32)
  mask = None
  if causal_mask:
    mask = q_pos[:, None] >= k_pos[None, :]
  if kv_len is not None:
    tail = jnp.broadcast_to((k_pos < kv_len)[None, :], (block_q, block_k))
    mask = tail if mask is None else mask & tail
  if q_seg is not None:
    same = q_seg[:, None] == k_seg[None, :]
    mask = same if mask is None else mask & same
  return s if mask is None else jnp.where(mask, s, _MASK_VALUE)


# [first, end) of the blocks a loop visits: Python ints or traced scalars.
_BlockRange = tuple[int | jax.Array, int | jax.Array]


def _causal_ranges(
  causal: bool, own_start, own_block: int, other_block: int, num_other: int, own_is_query: bool
) -> tuple[_BlockRange, _BlockRange]:
  """(unmasked range, masked range) of the other axis's blocks that one program visits.

  A query block [qs, qs + bq) needs key blocks below cdiv(qs + bq, bk); those below qs // bk are
  entirely at or below the diagonal and need no causal mask. A key block [ks, ks + bk) is seen by
  query blocks from ks // bq; those from cdiv(ks + bk, bq) on see all of it.
  """
  if not causal:
    return (0, num_other), (0, 0)
  if own_is_query:
    full = lax.div(own_start, other_block)
    end = lax.div(own_start + own_block + other_block - 1, other_block)
    return (0, full), (full, end)
  first = lax.div(own_start, other_block)
  full = lax.div(own_start + own_block + other_block - 1, other_block)
  return (full, num_other), (first, full)


def _slope2(slope_ref):
  return None if slope_ref is None else slope_ref[0] * _LOG2E


# ------------------------------------------------------------------------------------ forward


def _forward_kernel(
  q_ref, k_ref, v_ref, slope_ref, seg_ref, o_ref, lse_ref, *, static: _Static, num_blocks: int
):
  block_q, block_k = static.blocks.block_q, static.blocks.block_k
  # Heaviest causal rows first: the last query blocks visit the most key blocks.
  q_block = num_blocks - 1 - pl.program_id(0) if static.causal else pl.program_id(0)
  q_start = q_block * block_q
  q = q_ref[...]
  scale2 = static.sm_scale * _LOG2E
  slope2 = _slope2(slope_ref)
  q_seg = None if seg_ref is None else seg_ref[pl.ds(q_start, block_q)]
  num_k = k_ref.shape[0] // block_k

  def visit(k_block, carry, causal_mask):
    acc, m, l = carry
    k_start = pl.multiple_of(k_block * block_k, block_k)
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    k_seg = None if seg_ref is None else seg_ref[pl.ds(k_start, block_k)]
    s = _tile_scores(
      q,
      k,
      q_start=q_start,
      k_start=k_start,
      block_q=block_q,
      block_k=block_k,
      scale2=scale2,
      slope2=slope2,
      q_seg=q_seg,
      k_seg=k_seg,
      causal_mask=causal_mask,
      kv_len=static.kv_len,
    )
    m_new = jnp.maximum(m, s.max(axis=-1))
    correction = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
    return acc, m_new, l

  carry = (
    jnp.zeros(q.shape, jnp.float32),
    jnp.full((block_q,), _MASK_VALUE, jnp.float32),
    jnp.zeros((block_q,), jnp.float32),
  )
  unmasked, masked = _causal_ranges(static.causal, q_start, block_q, block_k, num_k, True)
  carry = lax.fori_loop(*unmasked, functools.partial(visit, causal_mask=False), carry)
  if static.causal:
    carry = lax.fori_loop(*masked, functools.partial(visit, causal_mask=True), carry)
  acc, m, l = carry
  o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log2(l)


def _forward(q, k, v, slopes, segment_ids, static: _Static):
  batch, seq_len, num_heads, head_dim = q.shape
  block_q = static.blocks.block_q
  num_q = seq_len // block_q
  q_block_index = (
    (lambda i, b, h: (b, num_q - 1 - i, h, 0)) if static.causal else (lambda i, b, h: (b, i, h, 0))
  )
  lse_index = (
    (lambda i, b, h: (b, h, num_q - 1 - i)) if static.causal else (lambda i, b, h: (b, h, i))
  )
  whole = pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, h, 0))
  in_specs = [
    pl.BlockSpec((None, block_q, None, head_dim), q_block_index),
    whole,
    whole,
    None if slopes is None else pl.BlockSpec((1,), lambda i, b, h: (h,)),
    None if segment_ids is None else pl.BlockSpec((None, seq_len), lambda i, b, h: (b, 0)),
  ]
  out_specs = [
    pl.BlockSpec((None, block_q, None, head_dim), q_block_index),
    pl.BlockSpec((None, None, block_q), lse_index),
  ]
  out_shape = [
    jax.ShapeDtypeStruct(q.shape, q.dtype),
    jax.ShapeDtypeStruct((batch, num_heads, seq_len), jnp.float32),
  ]
  return pl.pallas_call(
    functools.partial(_forward_kernel, static=static, num_blocks=num_q),
    grid=(num_q, batch, num_heads),
    in_specs=in_specs,
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=static.compiler_params(head_dim),
    interpret=static.interpret,
    name='flash_attention_forward',
  )(q, k, v, slopes, segment_ids)


# ----------------------------------------------------------------------------------- backward


def _dkdv_kernel(
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  slope_ref,
  seg_ref,
  dk_ref,
  dv_ref,
  *,
  static: _Static,
):
  block_q, block_k = static.blocks.block_q_dkv, static.blocks.block_k_dkv
  num_q = q_ref.shape[0] // block_q
  k_start = pl.program_id(0) * block_k
  k = k_ref[...]
  v = v_ref[...]
  scale2 = static.sm_scale * _LOG2E
  slope2 = _slope2(slope_ref)
  k_seg = None if seg_ref is None else seg_ref[pl.ds(k_start, block_k)]

  def visit(q_block, carry, causal_mask):
    dk, dv = carry
    q_start = pl.multiple_of(q_block * block_q, block_q)
    rows = pl.ds(q_start, block_q)
    q = q_ref[rows, :]
    do = do_ref[rows, :]
    q_seg = None if seg_ref is None else seg_ref[rows]
    s = _tile_scores(
      q,
      k,
      q_start=q_start,
      k_start=k_start,
      block_q=block_q,
      block_k=block_k,
      scale2=scale2,
      slope2=slope2,
      q_seg=q_seg,
      k_seg=k_seg,
      causal_mask=causal_mask,
      kv_len=static.kv_len,
    )
    p = jnp.exp2(s - lse_ref[rows][:, None])
    dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
    dp = plgpu.dot(do, v, trans_b=True)
    ds = p * (dp - delta_ref[rows][:, None])
    dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
    return dk, dv

  carry = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
  unmasked, masked = _causal_ranges(static.causal, k_start, block_k, block_q, num_q, False)
  carry = lax.fori_loop(*unmasked, functools.partial(visit, causal_mask=False), carry)
  if static.causal:
    carry = lax.fori_loop(*masked, functools.partial(visit, causal_mask=True), carry)
  dk, dv = carry
  dk_ref[...] = (dk * static.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, slope_ref, seg_ref, dq_ref, *, static: _Static
):
  block_q, block_k = static.blocks.block_q_dq, static.blocks.block_k_dq
  num_k = k_ref.shape[0] // block_k
  q_start = pl.program_id(0) * block_q
  q = q_ref[...]
  do = do_ref[...]
  lse = lse_ref[...]
  delta = delta_ref[...]
  scale2 = static.sm_scale * _LOG2E
  slope2 = _slope2(slope_ref)
  q_seg = None if seg_ref is None else seg_ref[pl.ds(q_start, block_q)]

  def visit(k_block, dq, causal_mask):
    k_start = pl.multiple_of(k_block * block_k, block_k)
    k = k_ref[pl.ds(k_start, block_k), :]
    v = v_ref[pl.ds(k_start, block_k), :]
    k_seg = None if seg_ref is None else seg_ref[pl.ds(k_start, block_k)]
    s = _tile_scores(
      q,
      k,
      q_start=q_start,
      k_start=k_start,
      block_q=block_q,
      block_k=block_k,
      scale2=scale2,
      slope2=slope2,
      q_seg=q_seg,
      k_seg=k_seg,
      causal_mask=causal_mask,
      kv_len=static.kv_len,
    )
    p = jnp.exp2(s - lse[:, None])
    dp = plgpu.dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    return dq + plgpu.dot(ds.astype(k.dtype), k)

  dq = jnp.zeros(q.shape, jnp.float32)
  unmasked, masked = _causal_ranges(static.causal, q_start, block_q, block_k, num_k, True)
  dq = lax.fori_loop(*unmasked, functools.partial(visit, causal_mask=False), dq)
  if static.causal:
    dq = lax.fori_loop(*masked, functools.partial(visit, causal_mask=True), dq)
  dq_ref[...] = (dq * static.sm_scale).astype(dq_ref.dtype)


def _backward(static: _Static, residuals, do):
  q, k, v, slopes, segment_ids, out, lse = residuals
  batch, seq_len, num_heads, head_dim = q.shape
  blocks = static.blocks
  # D_i = sum_d dO_id O_id, the softmax-backward row term; one fused elementwise pass in XLA.
  delta = jnp.einsum('bshd,bshd->bhs', out.astype(jnp.float32), do.astype(jnp.float32))
  do = do.astype(q.dtype)

  def specs(own_block: int, own_is_query: bool):
    """BlockSpecs of (q, k, v, dO, lse, delta, slopes, segments) for one backward kernel."""
    own = pl.BlockSpec((None, own_block, None, head_dim), lambda i, b, h: (b, i, h, 0))
    whole = pl.BlockSpec((None, seq_len, None, head_dim), lambda i, b, h: (b, 0, h, 0))
    own_row = pl.BlockSpec((None, None, own_block), lambda i, b, h: (b, h, i))
    whole_row = pl.BlockSpec((None, None, seq_len), lambda i, b, h: (b, h, 0))
    per_query = (own, own_row) if own_is_query else (whole, whole_row)
    per_key = whole if own_is_query else own
    return [
      per_query[0],
      per_key,
      per_key,
      per_query[0],
      per_query[1],
      per_query[1],
      None if slopes is None else pl.BlockSpec((1,), lambda i, b, h: (h,)),
      None if segment_ids is None else pl.BlockSpec((None, seq_len), lambda i, b, h: (b, 0)),
    ]

  operands = (q, k, v, do, lse, delta, slopes, segment_ids)
  key_block = pl.BlockSpec((None, blocks.block_k_dkv, None, head_dim), lambda i, b, h: (b, i, h, 0))
  dk, dv = pl.pallas_call(
    functools.partial(_dkdv_kernel, static=static),
    grid=(seq_len // blocks.block_k_dkv, batch, num_heads),
    in_specs=specs(blocks.block_k_dkv, own_is_query=False),
    out_specs=[key_block, key_block],
    out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
    compiler_params=static.compiler_params(head_dim),
    interpret=static.interpret,
    name='flash_attention_dkdv',
  )(*operands)
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, static=static),
    grid=(seq_len // blocks.block_q_dq, batch, num_heads),
    in_specs=specs(blocks.block_q_dq, own_is_query=True),
    out_specs=pl.BlockSpec((None, blocks.block_q_dq, None, head_dim), lambda i, b, h: (b, i, h, 0)),
    out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
    compiler_params=static.compiler_params(head_dim),
    interpret=static.interpret,
    name='flash_attention_dq',
  )(*operands)
  d_slopes = None if slopes is None else jnp.zeros_like(slopes)  # ALiBi slopes are constants.
  return dq, dk, dv, d_slopes, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash(q, k, v, slopes, segment_ids, static: _Static):
  return _forward(q, k, v, slopes, segment_ids, static)[0]


def _flash_fwd(q, k, v, slopes, segment_ids, static: _Static):
  out, lse = mark_residuals(*_forward(q, k, v, slopes, segment_ids, static))
  return out, (q, k, v, slopes, segment_ids, out, lse)


_flash.defvjp(_flash_fwd, _backward)
