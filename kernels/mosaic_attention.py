"""Causal flash attention with in-kernel ALiBi for Hopper, forward and backward, in Mosaic GPU.

    from t5x_like.kernels import mosaic_attention
    out = mosaic_attention(q, k, v, alibi_slopes=slopes)

The kernels are written for sm90 with `jax.experimental.pallas.mosaic_gpu`: TMA copies into
swizzled shared memory, `wgmma` with float32 accumulators in registers, and warp specialisation
(FlashAttention-3's plan): each program has `compute_wgs` warpgroups of math and one warpgroup that
only issues copies into a ring of `stages` buffers, so loads overlap the matmuls.

* q, k, v: [batch, seq, heads, head_dim], bfloat16 or float16; head_dim 64 or 128
  (`unmet_constraints` lists what does not fit). Any seq: it is padded up to a multiple of every
  tile span (`MosaicBlocks.multiple`); causal, so real queries never see the padded keys, and the
  padded rows' zero output gradient gives them no gradient either.
* ALiBi: the bias slope[h] * (key - query) differs from slope[h] * (key - seq / 2) by a
  constant per query, which softmax cancels, so the kernels add a [block_kv] float32 row of the
  latter per key tile (copied with the keys) instead of a [seq, seq] tensor. In float32
  (bfloat16 would not do: model/attention.py's `alibi_key_bias`) the row, slope * (key - seq /
  2) * log2(e), stays below 8,192 in magnitude at seq 8192 and rounds by at most 2.4e-4 (half
  float32's spacing there): 0.017% of a probability. The log-sum-exp the forward saves is of
  those shifted scores; the backward adds the same rows, so its probabilities are the forward's.
  With `MosaicBlocks.bias_in_product` the tensor cores add the rows instead (`bias_columns`).
* Causal: key tiles above the diagonal are never loaded, and only tiles that cross it are masked.
* `MosaicBlocks` also holds options, off until a GPU run shows one faster: a persistent forward
  (a program per SM running a sequence of query tiles through one key ring), orders of the
  hand-over of the tensor cores between the forward's math warpgroups (`early_handoff`,
  `issue_handoff`, `own_turn_barriers`, FlashAttention-3's `paired_turns`) or, instead of
  turns, each warpgroup's softmax beneath its own next product (`intra_overlap`), the
  backward's independent products issued in pairs, Mosaic GPU's own barriers left out
  (`no_auto_barriers`), and the ALiBi rows added by the tensor cores (`bias_in_product`).
* Backward (`jax.custom_vjp`): the forward saves the output and the log-sum-exp (named
  `residuals.ATTENTION_RESIDUALS`, so that remat_policy='save_dots' keeps them). One kernel
  computes dK and dV (a program per key tile, looping over the query tiles from the diagonal),
  one dQ (a program per query tile, looping over the key tiles up to it); no atomics.
* `interpret=True` runs the same kernel bodies on the CPU in Mosaic GPU's interpret mode (a
  simulation of shared memory, TMA copies, barriers and warpgroups): the tests check the tiling,
  the causal ranges, the ALiBi rows, the online softmax and the copy pipeline there against
  `attention_reference`. jax 0.10's interpreter runs neither `wgmma` with a transposed or
  register operand nor register layouts, so in that mode `mma` and `mma_accumulate` are XLA dots
  of the same tiles and `in_layout`, `iota` and `load_vector` drop the layouts: the only code
  that differs from the GPU's. The GPU's own path is checked by lowering it for CUDA
  (tests/kernels/test_mosaic_attention.py) and run against the reference in the GPU suite.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from t5x_like.kernels.residuals import mark_residuals

# 256 would need 320 KiB of shared memory for the forward's tiles; Hopper has 227.
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ('bfloat16', 'float16')
LOG2E = math.log2(math.e)
# 128-byte swizzle over 64-element (128-byte) rows of 16-bit values: the layout wgmma reads
# without bank conflicts.
_TILING = plgpu.TilingTransform((8, 64))
_SWIZZLE = plgpu.SwizzleTransform(128)
# bias_in_product: a key tile's ALiBi row rides in a [block_kv, BIAS_COLUMNS] tile of the keys'
# dtype, row / qk_scale split into BIAS_PARTS parts that sum to it within float32's precision,
# and the queries' [block_q, BIAS_COLUMNS] partner holds ones in those columns, so that the
# scores' wgmma (Q K^T, or K Q^T in dK/dV) adds the row. 16 columns: wgmma's K for 16-bit
# operands (32-byte rows, 32-byte swizzle).
BIAS_COLUMNS = 16
BIAS_PARTS = 3
_BIAS_TILING = plgpu.TilingTransform((8, BIAS_COLUMNS))
_BIAS_SWIZZLE = plgpu.SwizzleTransform(32)
# The persistent forward orders its items in groups of (batch row, head) pairs whose keys and
# values take at most this much: a third of Hopper's 50 MB L2, so the programs running at once
# read them from L2 while the rest of it holds the outputs and the next group's first tiles.
L2_GROUP_BYTES = 16 * 2**20
# Programs of the persistent forward in interpret mode: more than one, fewer than the items of a
# small test, so that programs run different numbers of items.
INTERPRET_PROGRAMS = 3
H100_SMS = 132
REGISTERS_PER_SM = 65536  # sm90's register file, 32-bit registers
MAX_COMPUTE_WGS = 2  # math warpgroups a program may have (MosaicBlocks.compute_wgs)
# CPU devices that give interpret mode enough of XLA's CPU threads for any MosaicBlocks
# (interpret_threads_needed's largest); docs/benchmarks.md, "The GPU suite".
INTERPRET_CPU_DEVICES = MAX_COMPUTE_WGS + 2


# CUDA runtimes (cudaRuntimeGetVersion's numbers, 12080 for 12.8) whose ptxas miscompiles Mosaic
# GPU's causal masks: jax's own Hopper attention example (jax/experimental/pallas/ops/gpu/
# attention_mgpu.py) refuses causal masking from 12080 up to, not including, 12091.
PTXAS_MISCOMPILES_CAUSAL = (12080, 12091)


def cuda_runtime_version() -> int | None:
  """cudaRuntimeGetVersion's number (12090 for 12.9) in this process, None without jax's CUDA
  plugin (a CPU-only install)."""
  try:
    from jax._src.lib import cuda_versions  # jax exports it under no public name
  except ImportError:
    return None
  return None if cuda_versions is None else int(cuda_versions.cuda_runtime_get_version())


class MosaicAttentionConstraintError(ValueError):
  """An input the Mosaic GPU attention kernels do not support; the message names the rule."""


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
  """Tile sizes (multiples of 64, wgmma's warpgroup M) and pipeline depth.

  Forward: a program owns compute_wgs * block_q queries (block_q per math warpgroup) and streams
  key/value tiles of block_kv. dK/dV: a program owns compute_wgs * block_kv_dkv keys and streams
  query tiles of block_q_dkv. dQ: a program owns compute_wgs * block_q_dq queries and streams key
  tiles of block_kv_dq. stages: buffers in each ring (at least 2, so a copy overlaps the math).
  copy_registers: the copy warpgroup's registers a thread (`setmaxnreg`); the math warpgroups
  share what it leaves of the program's (`math_registers`): 40 leaves two of them 232 each,
  FlashAttention-3's 24 leaves them 240.

  persistent (forward): one program per SM runs a sequence of query tiles (`forward_item_order`)
  through one key ring, so the next tile's keys and query are copied while the current one's
  math ends and its output is stored (FlashAttention-3's persistent kernel), where otherwise
  every tile's program starts with empty buffers. early_handoff (forward): a math warpgroup lets
  the other one onto the tensor cores as soon as its QK^T is issued, not once it has finished,
  and waits for the next key tile while its P V runs (the order of jax's Hopper attention
  example). paired_backward: dQ issues Q K^T and dO V^T together and waits once, dK/dV
  dV += P^T dO and V dO^T (as jax's example does), where otherwise each product is waited for
  before the next is issued. issue_handoff (forward, tokamax's sm90 order): a math warpgroup
  signals its turn over once its QK^T is issued, loads the ALiBi row and builds the diagonal
  mask while QK^T runs, and waits for the other warpgroup only after QK^T ends, so one product
  is always queued on the tensor cores; the copy warpgroup refills a slot's keys and ALiBi row
  as soon as they are free, before waiting for its values to be. own_turn_barriers (with
  issue_handoff, tokamax 0.0.17's form of it): each math warpgroup has a barrier of its own, at
  which the other arrives once its QK^T is issued; a warpgroup waits at it only before its P V,
  never after its QK^T. no_auto_barriers (every kernel, tokamax's setting): Mosaic GPU inserts
  no warpgroup barrier of its own around shared-memory stores and before each copy a warpgroup
  issues (the copy warpgroup's three a key tile); the kernels' only stores are their epilogues,
  each followed by `commit_smem` (a fence and a warpgroup barrier) before the copy that reads it.
  intra_overlap (forward, FlashAttention-3's intra-warpgroup overlap): a math warpgroup issues
  the next key tile's Q K^T before the current tile's softmax and P V, so the tensor cores run
  it beneath them, in place of the turns the warpgroups otherwise take (a second [block_q,
  block_kv] float32 tile in registers); the copy warpgroup refills keys first, as for
  issue_handoff, since the next tile's keys are read a P V before its values. bias_in_product
  (every kernel, bfloat16): the ALiBi rows are added by the tensor cores, as a second wgmma into
  the scores' accumulator (`bias_columns`: one more HGMMA a tile), so the float32 work per score
  is what it is without a bias: in the forward the max of the raw scores and one fused
  multiply-add into exp2, in the backward one fused multiply-add with the log-sum-exp (where
  otherwise a multiply-add with the row and a subtraction, and the forward's and dQ's rows are
  read from shared memory each tile). paired_turns (forward, FlashAttention-3's order of the
  products with its turns): a math warpgroup's turn on the tensor cores issues a key tile's
  Q K^T and then the previous tile's P V back to back and ends once both are issued (a barrier
  of each warpgroup's own, the other's turn ending at it; persistent programs too); the
  softmax of the tile follows its Q K^T, where otherwise each P V is waited for before the next
  Q K^T is issued. All off: the
  kernels first measured on an H100 (docs/benchmarks.md).
  """

  block_q: int = 64
  block_kv: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  compute_wgs: int = 2
  stages: int = 2
  copy_registers: int = 40
  persistent: bool = False
  early_handoff: bool = False
  paired_backward: bool = False
  issue_handoff: bool = False
  own_turn_barriers: bool = False
  no_auto_barriers: bool = False
  intra_overlap: bool = False
  bias_in_product: bool = False
  paired_turns: bool = False

  @property
  def math_registers(self) -> int:
    """A math warpgroup's registers a thread: what copy_registers leaves of the program's
    (65,536 over its threads at launch, rounded down to 8 a thread), split among compute_wgs, in
    multiples of 8, at most 240."""
    warpgroups = self.compute_wgs + 1
    at_launch = REGISTERS_PER_SM // (128 * warpgroups) // 8 * 8
    share = (at_launch * warpgroups - self.copy_registers) // self.compute_wgs
    return min(240, share // 8 * 8)

  @property
  def multiple(self) -> int:
    """The sequence is padded to a multiple of this: every kernel's tile span."""
    spans = (
      self.compute_wgs * self.block_q,
      self.block_kv,
      self.compute_wgs * self.block_kv_dkv,
      self.block_q_dkv,
      self.compute_wgs * self.block_q_dq,
      self.block_kv_dq,
    )
    return functools.reduce(math.lcm, spans)

  def problems(self) -> list[str]:
    found = []
    for name in ('block_q', 'block_kv', 'block_q_dkv', 'block_kv_dkv', 'block_q_dq', 'block_kv_dq'):
      size = getattr(self, name)
      if size % 64:
        found.append(f'MosaicBlocks.{name}={size} must be a multiple of 64 (wgmma tiles)')
    if self.stages < 2:
      found.append(f'MosaicBlocks.stages={self.stages} must be at least 2')
    if not 1 <= self.compute_wgs <= MAX_COMPUTE_WGS:
      found.append(
        f'MosaicBlocks.compute_wgs={self.compute_wgs} must be from 1 to {MAX_COMPUTE_WGS}'
      )
    if self.copy_registers % 8 or not 24 <= self.copy_registers <= 64:
      found.append(
        f'MosaicBlocks.copy_registers={self.copy_registers} must be a multiple of 8 from 24 '
        "(setmaxnreg's least) to 64 (more would only take them from the math warpgroups)"
      )
    if self.early_handoff and self.issue_handoff:
      found.append(
        'MosaicBlocks.early_handoff and issue_handoff are two orders of the same hand-over: '
        'set one of them'
      )
    if self.own_turn_barriers and not self.issue_handoff:
      found.append('MosaicBlocks.own_turn_barriers is a form of issue_handoff: set both')
    if self.intra_overlap and (
      self.early_handoff or self.issue_handoff or self.own_turn_barriers or self.persistent
    ):
      found.append(
        'MosaicBlocks.intra_overlap runs without turns on the tensor cores and without '
        'persistent programs: unset early_handoff, issue_handoff, own_turn_barriers and persistent'
      )
    others = ('early_handoff', 'issue_handoff', 'own_turn_barriers', 'intra_overlap')
    if self.paired_turns and any(getattr(self, name) for name in others):
      found.append('MosaicBlocks.paired_turns is an order of its own: unset ' + ', '.join(others))
    if self.own_turn_barriers and self.persistent:
      # An item's last turn and the next item's first could both reach the other warpgroup's
      # barrier before it waits, two phases at once.
      found.append('MosaicBlocks.own_turn_barriers does not run with persistent: set one of them')
    return found


def unmet_constraints(
  *, head_dim: int, dtype, blocks: MosaicBlocks | None = None, cuda_version: int | None = None
) -> list[str]:
  """What stops the kernels from running these inputs ([] when they can); cuda_version: the
  CUDA runtime's (`cuda_runtime_version`) where the kernels are compiled for a GPU."""
  found = []
  low, high = PTXAS_MISCOMPILES_CAUSAL
  if cuda_version is not None and low <= cuda_version < high:
    found.append(
      f'CUDA runtime {cuda_version}: ptxas from CUDA 12.8 up to 12.9.0 miscompiles causal masks '
      "in Mosaic GPU kernels (jax's Hopper attention refuses them too); use CUDA >= 12.9.1, or "
      "model.attention_impl='pallas'"
    )
  if head_dim not in SUPPORTED_HEAD_DIMS:
    found.append(f'head_dim must be one of {SUPPORTED_HEAD_DIMS} (wgmma tiles), got {head_dim}')
  if jnp.dtype(dtype).name not in SUPPORTED_DTYPES:
    found.append(
      f'q, k and v must be bfloat16 or float16 (wgmma operands), got {jnp.dtype(dtype).name}'
    )
  blocks = blocks or MosaicBlocks()
  if blocks.bias_in_product and jnp.dtype(dtype).name != 'bfloat16':
    found.append(
      'MosaicBlocks.bias_in_product needs bfloat16 q, k and v (float16 cannot hold the ALiBi '
      f'row / scale of long sequences), got {jnp.dtype(dtype).name}: unset it'
    )
  return found + blocks.problems()


def cpu_client_threads() -> int:
  """The threads of XLA's CPU client in this process: max(its default pool size, the CPU
  devices), the default being NPROC where that is set, else the cores this process may run on
  (XLA's DefaultThreadPoolSize)."""
  nproc = os.environ.get('NPROC', '')
  if nproc.isdigit() and int(nproc) > 0:
    cores = int(nproc)
  elif hasattr(os, 'sched_getaffinity'):
    cores = len(os.sched_getaffinity(0))
  else:
    cores = os.cpu_count() or 1
  return max(cores, jax.local_device_count(backend='cpu'))


def interpret_threads_needed(blocks: MosaicBlocks) -> int:
  """XLA CPU threads interpret mode holds at once: each of a program's warpgroups (the math ones
  and the copy one) is a computation of its own, all waiting for each other at barriers, and
  the computation that started them waits for them on one more."""
  return blocks.compute_wgs + 2


def check_interpret_threads(blocks: MosaicBlocks) -> None:
  """A MosaicAttentionConstraintError where interpret mode would hang for want of threads."""
  needed, threads = interpret_threads_needed(blocks), cpu_client_threads()
  if threads < needed:
    raise MosaicAttentionConstraintError(
      f"interpret mode runs this kernel's {blocks.compute_wgs + 1} warpgroups as computations "
      f"that wait for each other on XLA's CPU threads, and needs {needed} of them; this "
      f'process has {threads} (max(cores, CPU devices)), so it would hang. Start JAX with '
      f"{INTERPRET_CPU_DEVICES} CPU devices: jax.config.update('jax_num_cpu_devices', "
      f'{INTERPRET_CPU_DEVICES}) before anything uses JAX'
    )


def mosaic_attention(
  q,
  k,
  v,
  *,
  alibi_slopes=None,
  sm_scale: float | None = None,
  blocks: MosaicBlocks | None = None,
  interpret: bool = False,
):
  """Causal softmax(q k^T * sm_scale + ALiBi) v for [batch, seq, heads, head_dim] q, k, v.

  alibi_slopes: [heads] (None: no bias); sm_scale None means 1/sqrt(head_dim). Differentiable in
  q, k and v; the slopes are constants.
  """
  if q.shape != k.shape or q.shape != v.shape or q.ndim != 4:
    raise MosaicAttentionConstraintError(
      f'q, k and v must share one [batch, seq, heads, head_dim] shape, got {q.shape}, '
      f'{k.shape}, {v.shape}'
    )
  if not q.dtype == k.dtype == v.dtype:
    raise MosaicAttentionConstraintError(
      f'q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}'
    )
  blocks = blocks or MosaicBlocks()
  _, seq, heads, head_dim = q.shape
  cuda_version = None if interpret else cuda_runtime_version()
  problems = unmet_constraints(
    head_dim=head_dim, dtype=q.dtype, blocks=blocks, cuda_version=cuda_version
  )
  if problems:
    raise MosaicAttentionConstraintError('; '.join(problems))
  if interpret:
    check_interpret_threads(blocks)
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
  padded = -(-seq // blocks.multiple) * blocks.multiple
  if alibi_slopes is None:
    key_bias = jnp.zeros((heads, padded), jnp.float32)
  else:
    slopes = jnp.asarray(alibi_slopes, jnp.float32)
    # Keys counted from the middle: a constant per head, which softmax cancels, that halves the
    # row's largest magnitude and so its rounding.
    positions = jnp.arange(padded, dtype=jnp.float32) - padded // 2
    key_bias = slopes[:, None] * positions[None, :]
  # Scores are exponentiated in base 2 (exp2 is one instruction): scale and bias carry log2(e).
  key_bias = key_bias * LOG2E
  if blocks.bias_in_product:  # the form all three kernels read, made once
    key_bias = bias_columns(key_bias, scale * LOG2E, q.dtype)
  key_bias = lax.stop_gradient(key_bias)
  if padded != seq:
    q, k, v = (jnp.pad(x, ((0, 0), (0, padded - seq), (0, 0), (0, 0))) for x in (q, k, v))
  return _attention(q, k, v, key_bias, scale, blocks, interpret)[:, :seq]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _attention(q, k, v, key_bias, scale, blocks, interpret):
  return _forward(q, k, v, key_bias, scale, blocks, interpret)[0]


def _attention_fwd(q, k, v, key_bias, scale, blocks, interpret):
  out, lse = mark_residuals(*_forward(q, k, v, key_bias, scale, blocks, interpret))
  return out, (q, k, v, key_bias, out, lse)


def _attention_bwd(scale, blocks, interpret, residuals, d_out):
  q, k, v, key_bias, out, lse = residuals
  # delta[b, h, i] = sum_d out * d_out: the row term of softmax's gradient, [batch, heads, seq].
  delta = jnp.einsum('bqhd,bqhd->bhq', out.astype(jnp.float32), d_out.astype(jnp.float32))
  d_out = d_out.astype(q.dtype)
  dq = _backward_dq(q, k, v, d_out, key_bias, lse, delta, scale, blocks, interpret)
  dk, dv = _backward_dkv(q, k, v, d_out, key_bias, lse, delta, scale, blocks, interpret)
  return dq, dk, dv, jnp.zeros_like(key_bias)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _interpret_params(interpret: bool):
  if not interpret:
    return None
  # Mosaic GPU's interpret mode; jax exports its parameters under no public name yet.
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

  return InterpretGPUParams()


def _tile_smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=(_TILING, _SWIZZLE))


def _bias_tile_smem(shape, dtype):
  return plgpu.SMEM(shape, dtype, transforms=(_BIAS_TILING, _BIAS_SWIZZLE))


def bias_columns(key_bias, qk_scale: float, dtype):
  """bias_in_product's [heads, seq, BIAS_COLUMNS] key-side tiles of a [heads, seq] float32
  ALiBi row: row / qk_scale in BIAS_PARTS parts of `dtype`, each the rounding of what the parts
  before it left, then zeros. With the queries' ones (`query_ones`) their product is the row /
  qk_scale to float32's precision (the tensor cores multiply exactly and add in float32), and
  the scores times qk_scale carry the row."""
  rest = key_bias / qk_scale
  parts = []
  for _ in range(BIAS_PARTS):
    part = rest.astype(dtype)
    parts.append(part)
    rest = rest - part.astype(jnp.float32)
  zeros = jnp.zeros((*key_bias.shape, BIAS_COLUMNS - BIAS_PARTS), dtype)
  return jnp.concatenate([jnp.stack(parts, axis=-1), zeros], axis=-1)


def query_ones(block_q: int, dtype):
  """bias_in_product's query-side partner of `bias_columns`: ones in its parts' columns."""
  columns = jnp.arange(BIAS_COLUMNS) < BIAS_PARTS
  return jnp.broadcast_to(columns, (block_q, BIAS_COLUMNS)).astype(dtype)


def mma(a, b, interpret: bool, transpose_b: bool = False, while_running=None, also=()):
  """A fresh float32 a @ b (a @ b^T with transpose_b) of [M, K] and [K, N] (or [N, K]) tiles in
  shared memory, into registers; `while_running()` runs between the wgmma's issue and its end.
  also: `mma_while`'s."""
  return mma_while(a, b, interpret, while_running or (lambda: None), transpose_b, also)[0]


def mma_while(a, b, interpret: bool, while_running, transpose_b: bool = False, also=()):
  """(`mma`'s a @ b, what `while_running()` returns): it runs between the wgmma's issue and its
  end, so what it computes is ready when the product is. also: more (a, b) tile pairs, b
  transposed as the first is, whose products add to the same accumulator (issued right after)."""
  pairs = ((a, b), *also)
  if interpret:
    return _dot_sum(pairs, transpose_b), while_running()

  def run(acc_ref):
    _issue_products(acc_ref, pairs, transpose_b)
    meanwhile = while_running()
    return acc_ref[...], meanwhile  # reading the accumulator waits for the wgmmas

  columns = b.shape[0] if transpose_b else b.shape[1]
  return pl.run_scoped(run, plgpu.ACC((a.shape[0], columns), jnp.float32))


def _dot_sum(pairs, transpose_b: bool):
  """Interpret mode's float32 sum of a @ b (a @ b^T with transpose_b) over (a, b) tile pairs."""
  total = None
  for a, b in pairs:
    rhs = b[...].T if transpose_b else b[...]
    product = jnp.dot(a[...], rhs, preferred_element_type=jnp.float32)
    total = product if total is None else total + product
  return total


def _issue_products(acc_ref, pairs, transpose_b: bool) -> None:
  """One wgmma a pair into acc_ref, back to back (the tensor cores add them up)."""
  for a, b in pairs:
    plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(b, (1, 0)) if transpose_b else b)


def mma_accumulate(acc, a, b, interpret: bool, while_running=None):
  """acc + a @ b: a ([M, K]) in registers, b ([K, N]) in shared memory; the product accumulates
  into acc's registers. `while_running()` runs between the wgmma's issue and its end."""
  if interpret:
    result = acc + jnp.dot(a, b[...], preferred_element_type=jnp.float32)
    if while_running is not None:
      while_running()
    return result

  def run(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
    if while_running is not None:
      while_running()

  return pl.run_state(run)(plgpu.ACC.init(acc))


class Fresh(NamedTuple):
  """A product for `mma_together`: float32 a @ b (a @ b^T with transpose_b), a and b tiles in
  shared memory, plus the products of `also`'s (a, b) pairs (`mma_while`'s)."""

  a: Any
  b: Any
  transpose_b: bool = False
  also: tuple = ()


class Accumulate(NamedTuple):
  """A product for `mma_together`: acc + a @ b, acc (float32) and a in registers, b a tile in
  shared memory."""

  acc: Any
  a: Any
  b: Any


def mma_together(products, interpret: bool) -> tuple:
  """The products (`Fresh`, `Accumulate`) issued one after the other and waited for once, so
  the tensor cores run them back to back; their results in order."""
  if interpret:
    results = []
    for p in products:
      if isinstance(p, Fresh):
        results.append(_dot_sum(((p.a, p.b), *p.also), p.transpose_b))
      else:
        results.append(p.acc + jnp.dot(p.a, p.b[...], preferred_element_type=jnp.float32))
    return tuple(results)

  def initial(p):
    if isinstance(p, Accumulate):
      return plgpu.ACC.init(p.acc)
    columns = p.b.shape[0] if p.transpose_b else p.b.shape[1]
    return plgpu.ACC.init(zeros_tile((p.a.shape[0], columns), interpret))

  def run(acc_refs):
    for acc_ref, p in zip(acc_refs, products):
      if isinstance(p, Accumulate):
        plgpu.wgmma(acc_ref, p.a, p.b)
      else:
        _issue_products(acc_ref, ((p.a, p.b), *p.also), p.transpose_b)

  return tuple(pl.run_state(run)(tuple(initial(p) for p in products)))


def scores_then_values(pairs, values, interpret: bool, after_issue, under):
  """FlashAttention-3's pair of products: a fresh float32 sum of a @ b^T over `pairs` (the
  scores, `mma_while`'s pairs with b transposed), then acc + p @ v, (acc, p, v) being what
  `values()` returns, issued back to back; `after_issue()` runs once both are, and
  `under(scores)` once the scores are done while the second product still runs. Returns
  (acc + p @ v, what under returned)."""
  if interpret:
    scores = _dot_sum(pairs, transpose_b=True)
    acc, probs, v = values()
    after_issue()
    meanwhile = under(scores)
    return acc + jnp.dot(probs, v[...], preferred_element_type=jnp.float32), meanwhile

  a, b = pairs[0]

  def issue_scores(scores_ref):
    _issue_products(scores_ref, pairs, transpose_b=True)
    acc, probs, v = values()

    def issue_values(acc_ref):
      acc_ref[...] = acc
      plgpu.wgmma(acc_ref, probs, v)  # one wgmma group, the last one issued
      after_issue()
      meanwhile = under(plgpu.wgmma_accumulator_load(scores_ref, wait_n=1))
      return acc_ref[...], meanwhile  # reading the accumulator waits for the P V

    return pl.run_scoped(issue_values, plgpu.ACC(acc.shape, jnp.float32))

  return pl.run_scoped(issue_scores, plgpu.ACC((a.shape[0], b.shape[0]), jnp.float32))


def load_vector(ref, layout, interpret: bool):
  """A [n] float32 vector from shared memory in `layout` (interpret mode has no `plgpu.load`:
  there a plain read)."""
  if interpret:
    return ref[...]
  return plgpu.load(ref, (), layout=layout)


def in_layout(value, layout, interpret: bool):
  """value with its register layout fixed (interpret mode has no layouts: value itself)."""
  return value if interpret else plgpu.layout_cast(value, layout)


def iota(shape, dimension: int, interpret: bool):
  """An int32 iota along `dimension` in wgmma's result layout."""
  if interpret:
    return lax.broadcasted_iota(jnp.int32, shape, dimension)
  return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def causal_mask(shape, row_start, col_start, rows_are_queries: bool, interpret: bool):
  """True where the query may see the key, for a tile whose rows start at row_start and columns
  at col_start."""
  rows = iota(shape, 0, interpret) + row_start
  cols = iota(shape, 1, interpret) + col_start
  return rows >= cols if rows_are_queries else cols >= rows


def exponentiated(scores, bias, lse, qk_scale: float, visible, rows_are_queries: bool):
  """The backward's probabilities of a tile of raw scores: exp2(scores * qk_scale + the ALiBi
  row - the log-sum-exp), masked where `visible` (None: nothing masked) is False. bias: the
  keys' float32 rows, or None where the product added them (bias_in_product); then the scale
  and the log-sum-exp are one fused multiply-add a score. The keys run along the columns when
  rows_are_queries (dQ), along the rows otherwise (dK/dV)."""
  key_axis, query_axis = (1, 0) if rows_are_queries else (0, 1)
  if bias is not None:
    scores = scores * qk_scale + lax.broadcast_in_dim(bias, scores.shape, [key_axis])
  if visible is not None:
    scores = jnp.where(visible, scores, -jnp.inf)
  row_lse = lax.broadcast_in_dim(lse, scores.shape, [query_axis])
  return jnp.exp2((scores if bias is not None else scores * qk_scale) - row_lse)


def full_rows(value, size: int, interpret: bool):
  """A per-row [size] float32 vector in the layout of wgmma's [size, N] results."""
  return in_layout(jnp.full((size,), value, jnp.float32), plgpu.Layout.WGMMA.reduce(1), interpret)


def zeros_tile(shape, interpret: bool):
  return in_layout(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA, interpret)


def _wait_consumed(consumed, ring_step, stages: int) -> None:
  for barrier in consumed:
    plgpu.barrier_wait(barrier.at[lax.rem(ring_step, stages)])


def wait_output_read() -> None:
  """A math warpgroup's end: its output copies have read shared memory. Not until they have
  written HBM: the kernel's end makes its writes visible, and the SM goes to the next program
  a write's latency sooner (the end of CUTLASS's and tokamax's epilogues)."""
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _stream(step_count, stages, consumed, issue, start=0, ring_base=0, then=()):
  """The copy warpgroup's loop: for steps [start, start + step_count), the ring's ring_base-th
  tile on, it waits until the ring slot's previous tile is consumed, then `issue(step, slot)`
  starts the next copies. then: further (consumed, issue) pairs, each waited for and issued in
  turn after the first, so a buffer freed early is refilled without waiting for the others."""

  @pl.loop(0, step_count)
  def _(i):
    ring_step = ring_base + i
    for barriers, copies in ((consumed, issue), *then):
      pl.when(ring_step >= stages)(
        lambda barriers=barriers: _wait_consumed(barriers, ring_step - stages, stages)
      )
      copies(start + i, lax.rem(ring_step, stages))


def _wait_last_consumed(ring_steps, stages, consumed) -> None:
  """The copy warpgroup's end: waits for the release of the last tiles of its ring_steps too,
  so it sees every phase of its barriers."""
  pl.loop(jnp.maximum(ring_steps - stages, 0), ring_steps)(
    lambda i: _wait_consumed(consumed, i, stages)
  )


def heaviest_first(index, count: int):
  """The query tile of the index-th program along a grid axis of `count`: the last first. Under
  a causal mask a query tile's work grows with its position, and the GPU starts programs in
  grid order, so the longest start first and the short ones fill the end of the launch."""
  return count - 1 - index


def key_ring_types(
  stages: int, block_kv: int, head_dim: int, dtype, wgs: int, bias_in_product: bool = False
):
  """(shared memory, barriers) of a `KeyRing`: `stages` key tiles, ALiBi rows (float32, or with
  bias_in_product `bias_columns` tiles) and value tiles, a ready barrier per buffer and a free
  barrier per key and value slot (one arrival per math warpgroup)."""
  bias = (
    _bias_tile_smem((stages, block_kv, BIAS_COLUMNS), dtype)
    if bias_in_product
    else plgpu.SMEM((stages, block_kv), jnp.float32)
  )
  buffers = (
    _tile_smem((stages, block_kv, head_dim), dtype),
    bias,
    _tile_smem((stages, block_kv, head_dim), dtype),
  )
  barriers = (
    *(plgpu.Barrier(num_barriers=stages) for _ in range(3)),
    *(plgpu.Barrier(num_arrivals=wgs, num_barriers=stages) for _ in range(2)),
  )
  return buffers, barriers


@dataclasses.dataclass(frozen=True)
class KeyRing:
  """The forward's and dQ's ring of key tiles, their ALiBi rows and value tiles, filled by the
  copy warpgroup (`fill`) from key tile 0 on, read by the math warpgroups."""

  k: Any
  bias: Any
  v: Any
  k_ready: Any
  bias_ready: Any
  v_ready: Any
  k_free: Any
  v_free: Any

  @classmethod
  def of(cls, buffers, barriers) -> KeyRing:
    return cls(*buffers, *barriers)

  def fill(
    self,
    k_ref,
    v_ref,
    bias_ref,
    b,
    h,
    block_kv: int,
    steps,
    stages: int,
    ring_base=0,
    keys_first: bool = False,
  ) -> None:
    """The copy warpgroup: key tiles [0, steps) of batch row b, head h, into the ring from its
    ring_base-th tile on. keys_first: a slot's keys and ALiBi row are copied once they are free,
    before its values are (the math frees the keys a P V earlier than the values)."""

    def copy_keys(step, slot):
      keys = (b, pl.ds(step * block_kv, block_kv), h)
      plgpu.copy_gmem_to_smem(k_ref.at[keys], self.k.at[slot], self.k_ready.at[slot])
      row = bias_ref.at[h, pl.ds(step * block_kv, block_kv)]
      plgpu.copy_gmem_to_smem(row, self.bias.at[slot], self.bias_ready.at[slot])

    def copy_values(step, slot):
      keys = (b, pl.ds(step * block_kv, block_kv), h)
      plgpu.copy_gmem_to_smem(v_ref.at[keys], self.v.at[slot], self.v_ready.at[slot])

    if keys_first:
      then = (((self.v_free,), copy_values),)
      _stream(steps, stages, (self.k_free,), copy_keys, ring_base=ring_base, then=then)
    else:

      def copy_both(step, slot):
        copy_keys(step, slot)
        copy_values(step, slot)

      _stream(steps, stages, (self.k_free, self.v_free), copy_both, ring_base=ring_base)

  def wait_all_free(self, ring_steps, stages: int) -> None:
    """The copy warpgroup's end, after `fill`s of ring_steps tiles in all."""
    _wait_last_consumed(ring_steps, stages, (self.k_free, self.v_free))

  def key_bias(self, slot, interpret: bool):
    """The slot's ALiBi row as a column vector of wgmma's result layout, once it is there."""
    plgpu.barrier_wait(self.bias_ready.at[slot])
    return load_vector(self.bias.at[slot], plgpu.Layout.WGMMA.reduce(0), interpret)

  def release(self, slot) -> None:
    """A tile only another warpgroup of the program needed: waited for (so every barrier phase
    is seen), then freed."""
    for ready in (self.k_ready, self.bias_ready, self.v_ready):
      plgpu.barrier_wait(ready.at[slot])
    plgpu.barrier_arrive(self.k_free.at[slot])
    plgpu.barrier_arrive(self.v_free.at[slot])


def forward_item_order(batch: int, heads: int, tiles: int, seq: int, head_dim: int, itemsize: int):
  """The persistent forward's work items, (batch row, head, query tile), as a function of the item
  index: heaviest tile first (`heaviest_first`), in groups of (batch row, head) pairs whose keys
  and values fit `L2_GROUP_BYTES`, so the programs running at once share them through L2 instead
  of each reading its own pair's from HBM."""
  pairs = batch * heads
  group = max(1, min(pairs, L2_GROUP_BYTES // (2 * seq * head_dim * itemsize)))

  def item(index):
    first_pair = lax.div(index, group * tiles) * group
    size = jnp.minimum(group, pairs - first_pair)  # the last group may be smaller
    offset = index - first_pair * tiles
    pair = first_pair + lax.rem(offset, size)
    return lax.div(pair, heads), lax.rem(pair, heads), heaviest_first(lax.div(offset, size), tiles)

  return item


def persistent_programs(items: int, interpret: bool) -> int:
  """One program per SM, or INTERPRET_PROGRAMS in interpret mode."""
  return min(items, INTERPRET_PROGRAMS if interpret else gpu_sm_count())


def gpu_sm_count() -> int:
  """The GPU's SMs (its core_count); an H100's where none is attached (lowering for CUDA on a
  CPU)."""
  try:
    return jax.devices('gpu')[0].core_count
  except RuntimeError:
    return H100_SMS


def _forward(q, k, v, key_bias, scale, blocks: MosaicBlocks, interpret: bool):
  batch, seq, heads, head_dim = q.shape
  dtype = q.dtype
  wgs, block_q, block_kv, stages = (
    blocks.compute_wgs,
    blocks.block_q,
    blocks.block_kv,
    blocks.stages,
  )
  span = wgs * block_q
  tiles = seq // span
  qk_scale = scale * LOG2E
  items = batch * heads * tiles
  grid: tuple[int, ...]
  grid_names: tuple[str, ...]
  if blocks.persistent:
    programs = persistent_programs(items, interpret)
    grid, grid_names = (programs,), ('program',)
    order = forward_item_order(batch, heads, tiles, seq, head_dim, jnp.dtype(dtype).itemsize)
  else:
    grid, grid_names = (heads, tiles, batch), ('heads', 'q_tile', 'batch')

  def program_items():
    """(how many items this program runs, the index-th's (batch row, head, query tile))."""
    if not blocks.persistent:
      b, h = lax.axis_index('batch'), lax.axis_index('heads')
      return 1, lambda _: (b, h, heaviest_first(lax.axis_index('q_tile'), tiles))
    program = lax.axis_index('program')
    return pl.cdiv(items - program, programs), lambda index: order(program + index * programs)

  def over_items(count, run):
    """run(index, ring_base) -> the next ring_base, over this program's items; the final count
    of key tiles."""
    if not blocks.persistent:  # its one item (a loop of one deadlocks the interpreter under jit)
      return run(0, 0)
    return lax.fori_loop(0, count, run, 0)

  # Both orders wait for the next key tile while P V runs, not before its QK^T.
  handed_over_early = blocks.early_handoff or blocks.issue_handoff
  own_turns = (blocks.own_turn_barriers or blocks.paired_turns) and wgs > 1

  def item_steps(tile):  # key tiles an item's program needs: up to its last query's diagonal
    return pl.cdiv((tile + 1) * span, block_kv)

  def attention_forward(
    q_ref, k_ref, v_ref, bias_ref, ones_ref, out_ref, lse_ref, scratch, barriers
  ):
    q_smem, ones_smem, out_smem, lse_smem, ring_buffers = scratch
    q_ready, ones_ready, schedule, ring_barriers = barriers
    ring = KeyRing.of(ring_buffers, ring_barriers)
    wg = lax.axis_index('wg')
    count, item = program_items()

    def rendezvous():  # the math warpgroups take turns on the tensor cores (FA3's ping-pong)
      if wgs > 1:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    # own_turn_barriers (and paired_turns): schedule is a barrier per math warpgroup; the other
    # warpgroup arrives at a warpgroup's once its products are issued, and the warpgroup waits
    # at its own before its next turn. One math warpgroup takes no turns.
    def pass_turn():
      if wgs > 1:
        plgpu.barrier_arrive(schedule.at[1 - wg] if own_turns else schedule)

    def take_turn():
      if wgs > 1:
        plgpu.barrier_wait(schedule.at[wg] if own_turns else schedule)

    @pl.when(wg < wgs)
    def _math():
      plgpu.set_max_registers(blocks.math_registers, action='increase')
      q_tile_smem = q_smem.at[wg]
      # Without persistence the output goes through the query's buffer; with it the next item's
      # query arrives there while this one's output is being stored.
      out_tile_smem = out_smem.at[wg] if blocks.persistent else q_tile_smem

      def load_query(index):
        b, h, tile = item(index)
        rows = (b, pl.ds(tile * span + wg * block_q, block_q), h)
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_tile_smem, q_ready.at[wg])

      def qk_pairs(slot):
        """The (a, b^T) tile pairs whose products sum to the slot's scores: Q K^T, and with
        bias_in_product the ALiBi row's product, once the row is there."""
        if not blocks.bias_in_product:
          return ((q_tile_smem, ring.k.at[slot]),)
        plgpu.barrier_wait(ring.bias_ready.at[slot])
        return ((q_tile_smem, ring.k.at[slot]), (ones_smem.at[wg], ring.bias.at[slot]))

      def qk_product(slot, while_running=lambda: None):
        """(Q K^T of the slot's keys, what `while_running()` returns beneath it)."""
        (a, b), *also = qk_pairs(slot)
        return mma_while(a, b, interpret, while_running, transpose_b=True, also=tuple(also))

      def row_bias(slot):
        """The slot's ALiBi row for the softmax; None where the product added it."""
        return None if blocks.bias_in_product else ring.key_bias(slot, interpret)

      def run_item(index, ring_base):
        b, h, tile = item(index)
        program_steps = item_steps(tile)
        q_start = tile * span + wg * block_q
        steps = pl.cdiv(q_start + block_q, block_kv)  # the last one crosses the diagonal
        unmasked_steps = lax.div(q_start, block_kv)
        plgpu.barrier_wait(q_ready.at[wg])

        def slot_of(step):
          return lax.rem(ring_base + step, stages)

        def query_tile_done(step):
          """After the item's last QK^T the query buffer is free: the next item's query."""
          if blocks.persistent:
            pl.when((step == steps - 1) & (index + 1 < count))(lambda: load_query(index + 1))

        def diagonal_mask(step):
          shape = (block_q, block_kv)
          return causal_mask(shape, q_start, step * block_kv, True, interpret)

        def key_scores(step, after_product=lambda: None):
          """(Q K^T of key tile `step`, its ALiBi row), waited for, `after_product()` run once
          the product is done; the key slot is freed."""
          slot = slot_of(step)
          plgpu.barrier_wait(ring.k_ready.at[slot])
          scores = qk_product(slot)[0]
          after_product()
          bias = row_bias(slot)
          plgpu.barrier_arrive(ring.k_free.at[slot])
          return scores, bias

        def values_step(step, probs, acc, before=lambda: None, while_running=None):
          """acc + P V with key tile `step`'s values, `before()` run once they are there and
          `while_running()` beneath the product; the value slot is freed."""
          slot = slot_of(step)
          plgpu.barrier_wait(ring.v_ready.at[slot])
          before()
          acc = mma_accumulate(acc, probs, ring.v.at[slot], interpret, while_running=while_running)
          plgpu.barrier_arrive(ring.v_free.at[slot])
          return acc

        def scores_of(step, slot, masked: bool):
          """(Q K^T, the ALiBi row, the diagonal mask or None), with the tensor cores handed
          over as the options say; the key slot is freed."""
          if blocks.issue_handoff:

            def while_issued():
              bias = row_bias(slot)
              if wgs > 1:
                pass_turn()
              return bias, diagonal_mask(step) if masked else None

            scores, (bias, visible) = qk_product(slot, while_issued)
            plgpu.barrier_arrive(ring.k_free.at[slot])
            if wgs > 1 and not own_turns:
              take_turn()
            return scores, bias, visible
          if blocks.early_handoff:
            scores = qk_product(slot, rendezvous)[0]
            bias = row_bias(slot)
            plgpu.barrier_arrive(ring.k_free.at[slot])
          else:
            scores, bias = key_scores(step, after_product=rendezvous)
          return scores, bias, diagonal_mask(step) if masked else None

        def softmax_rows(scores, bias, visible, row_max, row_sum):
          """The online softmax of a key tile's scores: (the new row maxima and sums, the float32
          probabilities, the factor of the accumulator's rows)."""
          if bias is None:  # bias_in_product: the scores carry the row; qk_scale goes into exp2's
            # multiply-add, and the maxima of the raw scores are scaled a row at a time
            if visible is not None:
              scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(row_max, scores.max(axis=1) * qk_scale)
            exponents = scores * qk_scale - lax.broadcast_in_dim(new_max, scores.shape, [0])
          else:
            scores = scores * qk_scale + lax.broadcast_in_dim(bias, scores.shape, [1])
            if visible is not None:
              scores = jnp.where(visible, scores, -jnp.inf)
            new_max = jnp.maximum(row_max, scores.max(axis=1))
            exponents = scores - lax.broadcast_in_dim(new_max, scores.shape, [0])
          correction = jnp.exp2(row_max - new_max)
          probs = jnp.exp2(exponents)
          row_sum = row_sum * correction + probs.sum(axis=1)
          return new_max, row_sum, probs, correction

        def rescaled(acc, correction):
          return acc * lax.broadcast_in_dim(correction, acc.shape, [0])

        def softmax(scores, bias, visible, carry):
          """softmax_rows with the accumulator rescaled: (acc, new maxima, sums, probabilities in
          the inputs' dtype)."""
          acc, row_max, row_sum = carry
          new_max, row_sum, probs, correction = softmax_rows(
            scores, bias, visible, row_max, row_sum
          )
          return rescaled(acc, correction), new_max, row_sum, probs.astype(dtype)

        def kv_step(step, carry, masked: bool):
          slot = slot_of(step)
          scores, bias, visible = scores_of(step, slot, masked)
          if masked:
            query_tile_done(step)
          acc, new_max, row_sum, probs = softmax(scores, bias, visible, carry)
          if handed_over_early:  # keep the softmax before the turn (jax's Hopper attention)
            acc, row_sum, new_max, probs = lax.optimization_barrier((acc, row_sum, new_max, probs))
          if wgs > 1 and not own_turns:
            pass_turn()

          def next_keys():  # while P V runs
            next_slot = slot_of(step + 1)
            pl.when(step + 1 < steps)(lambda: plgpu.barrier_wait(ring.k_ready.at[next_slot]))

          acc = values_step(
            step,
            probs,
            acc,
            before=take_turn,
            while_running=next_keys if handed_over_early else None,
          )
          return acc, new_max, row_sum

        def overlapped_step(step, carry, masked: bool):
          """intra_overlap: key tile `step`'s softmax and P V while the tensor cores run the
          next tile's Q K^T (FlashAttention-3's intra-warpgroup overlap)."""
          acc, row_max, row_sum, scores, bias = carry
          next_slot = slot_of(step + 1)
          plgpu.barrier_wait(ring.k_ready.at[next_slot])

          def softmax_and_values():
            visible = diagonal_mask(step) if masked else None
            acc_, new_max, row_sum_, probs = softmax(scores, bias, visible, (acc, row_max, row_sum))
            return values_step(step, probs, acc_), new_max, row_sum_

          next_scores, (acc, row_max, row_sum) = qk_product(next_slot, softmax_and_values)
          next_bias = row_bias(next_slot)
          plgpu.barrier_arrive(ring.k_free.at[next_slot])
          return acc, row_max, row_sum, next_scores, next_bias

        def overlapped(carry):
          """intra_overlap's key loop: the first tile's scores, then each tile's softmax and P V
          beneath the next one's Q K^T, then the last (diagonal) tile's alone."""
          carry = (*carry, *key_scores(0))
          last = steps - 1
          carry = lax.fori_loop(
            0,
            lax.min(unmasked_steps, last),
            functools.partial(overlapped_step, masked=False),
            carry,
          )
          carry = lax.fori_loop(
            unmasked_steps, last, functools.partial(overlapped_step, masked=True), carry
          )
          acc, row_max, row_sum, scores, bias = carry
          acc, row_max, row_sum, probs = softmax(
            scores, bias, diagonal_mask(last), (acc, row_max, row_sum)
          )
          return values_step(last, probs, acc), row_max, row_sum

        # paired_turns: a turn is the issue of a key tile's Q K^T and the previous tile's P V;
        # the second warpgroup's first turn waits for the first's, and the first waits for the
        # second's last at the end.
        def paired_step(step, carry, masked: bool):
          """paired_turns (FlashAttention-3's order): key tile `step`'s Q K^T, then the previous
          tile's P V (on the accumulator rescaled for it), issued in one turn; this tile's softmax
          runs once its Q K^T is done. Its probabilities are made bfloat16 after the P V (which
          reads the previous ones from registers) is done: written while it runs, ptxas would
          wait for every product of the kernel."""
          acc, row_max, row_sum, probs, correction = carry
          slot, previous = slot_of(step), slot_of(step - 1)
          plgpu.barrier_wait(ring.k_ready.at[slot])
          take_turn()

          def previous_values():
            plgpu.barrier_wait(ring.v_ready.at[previous])
            return rescaled(acc, correction), probs, ring.v.at[previous]

          def scores_softmax(scores):
            bias = row_bias(slot)
            plgpu.barrier_arrive(ring.k_free.at[slot])
            if masked:
              query_tile_done(step)
            visible = diagonal_mask(step) if masked else None
            return softmax_rows(scores, bias, visible, row_max, row_sum)

          acc, (row_max, row_sum, probs, correction) = scores_then_values(
            qk_pairs(slot), previous_values, interpret, pass_turn, scores_softmax
          )
          plgpu.barrier_arrive(ring.v_free.at[previous])
          return acc, row_max, row_sum, probs.astype(dtype), correction

        def paired(carry):
          """paired_turns' key loop: the first tile's Q K^T in a turn of its own and its
          softmax (masked: it may cross the diagonal), each later tile's Q K^T with the P V of
          the one before, then the last tile's P V in a turn of its own."""
          acc, row_max, row_sum = carry
          first = slot_of(0)
          plgpu.barrier_wait(ring.k_ready.at[first])
          pl.when(wg == 1)(take_turn)
          scores = qk_product(first, pass_turn)[0]
          bias = row_bias(first)
          plgpu.barrier_arrive(ring.k_free.at[first])
          query_tile_done(0)
          row_max, row_sum, probs, correction = softmax_rows(
            scores, bias, diagonal_mask(0), row_max, row_sum
          )
          carry = (acc, row_max, row_sum, probs.astype(dtype), correction)
          carry = lax.fori_loop(
            1, unmasked_steps, functools.partial(paired_step, masked=False), carry
          )
          carry = lax.fori_loop(
            lax.max(unmasked_steps, 1),
            steps,
            functools.partial(paired_step, masked=True),
            carry,
          )
          acc, row_max, row_sum, probs, correction = carry
          take_turn()
          acc = rescaled(acc, correction)
          acc = values_step(steps - 1, probs, acc, while_running=pass_turn)
          return acc, row_max, row_sum

        def drain(step, _):  # key tiles another warpgroup needed: release them, keep the turns
          ring.release(slot_of(step))
          if blocks.intra_overlap:
            return
          if blocks.paired_turns:
            take_turn()
            pass_turn()
          elif own_turns:
            pass_turn()
            take_turn()
          else:
            rendezvous()
            rendezvous()

        carry = (
          zeros_tile((block_q, head_dim), interpret),
          full_rows(-jnp.inf, block_q, interpret),
          full_rows(0.0, block_q, interpret),
        )
        if blocks.intra_overlap:  # no turns: each warpgroup overlaps its own softmax
          carry = overlapped(carry)
          lax.fori_loop(steps, program_steps, drain, None)
        elif blocks.paired_turns:
          carry = paired(carry)
          lax.fori_loop(steps, program_steps, drain, None)
          pl.when(wg == 0)(take_turn)
        else:
          if handed_over_early:
            plgpu.barrier_wait(ring.k_ready.at[slot_of(0)])
          # The first warpgroup goes first: the second waits for its first QK^T, and at the end
          # the first lets the second's last P V go.
          pl.when(wg == 1)(take_turn if own_turns else rendezvous)
          carry = lax.fori_loop(0, unmasked_steps, functools.partial(kv_step, masked=False), carry)
          carry = lax.fori_loop(
            unmasked_steps, steps, functools.partial(kv_step, masked=True), carry
          )
          lax.fori_loop(steps, program_steps, drain, None)
          pl.when(wg == 0)(pass_turn if own_turns else rendezvous)
        acc, row_max, row_sum = carry
        out = acc / lax.broadcast_in_dim(row_sum, acc.shape, [0])
        if blocks.persistent:  # the previous item's output has left the buffers
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_tile_smem[...] = out.astype(dtype)
        lse_smem.at[wg][...] = row_max + jnp.log(row_sum) * LOG2E
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_tile_smem, out_ref.at[b, pl.ds(q_start, block_q), h])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q_start, block_q)])
        return ring_base + program_steps

      load_query(0)
      if blocks.bias_in_product:  # once a program, beside its first query tile
        plgpu.copy_gmem_to_smem(ones_ref, ones_smem.at[wg], ones_ready.at[wg])
        plgpu.barrier_wait(ones_ready.at[wg])
      over_items(count, run_item)
      wait_output_read()

    @pl.when(wg == wgs)
    def _copies():
      def fill_item(index, ring_base):
        b, h, tile = item(index)
        steps = item_steps(tile)
        ring.fill(
          k_ref,
          v_ref,
          bias_ref,
          b,
          h,
          block_kv,
          steps,
          stages,
          ring_base=ring_base,
          keys_first=blocks.issue_handoff or blocks.intra_overlap,
        )
        return ring_base + steps

      plgpu.set_max_registers(blocks.copy_registers, action='decrease')
      ring.wait_all_free(over_items(count, fill_item), stages)

  ring_buffers, ring_barriers = key_ring_types(
    stages, block_kv, head_dim, dtype, wgs, blocks.bias_in_product
  )
  scratch = (
    _tile_smem((wgs, block_q, head_dim), dtype),
    _bias_tile_smem((wgs, block_q, BIAS_COLUMNS), dtype) if blocks.bias_in_product else None,
    _tile_smem((wgs, block_q, head_dim), dtype) if blocks.persistent else None,
    plgpu.SMEM((wgs, block_q), jnp.float32),
    ring_buffers,
  )
  # The query tiles' copies, and the math warpgroups' turns on the tensor cores: one barrier
  # both arrive at, or one of each's own that the other arrives at.
  turns = plgpu.Barrier(num_barriers=2) if own_turns else plgpu.Barrier(num_arrivals=wgs)
  ones_ready = plgpu.Barrier(num_barriers=wgs) if blocks.bias_in_product else None
  barriers = (plgpu.Barrier(num_barriers=wgs), ones_ready, turns, ring_barriers)
  out_type = (
    jax.ShapeDtypeStruct(q.shape, dtype),
    jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32),
  )
  call = _kernel_call(
    attention_forward, out_type, scratch, barriers, grid, grid_names, wgs, blocks, interpret
  )
  out, lse = call(q, k, v, key_bias, query_ones(block_q, dtype))
  return out, lse


def _kernel_call(body, out_type, scratch, barriers, grid, grid_names, wgs, blocks, interpret):
  return plgpu.kernel(
    body,
    out_type=out_type,
    scratch_types=(scratch, barriers),
    grid=grid,
    grid_names=grid_names,
    num_threads=wgs + 1,
    thread_name='wg',
    compiler_params=plgpu.CompilerParams(
      approx_math=True, unsafe_no_auto_barriers=blocks.no_auto_barriers
    ),
    interpret=_interpret_params(interpret),
  )


def _backward_dq(q, k, v, d_out, key_bias, lse, delta, scale, blocks: MosaicBlocks, interpret):
  """dQ: a program per compute_wgs * block_q_dq queries, streaming the key tiles up to them."""
  batch, seq, heads, head_dim = q.shape
  dtype = q.dtype
  wgs, block_q, block_kv, stages = (
    blocks.compute_wgs,
    blocks.block_q_dq,
    blocks.block_kv_dq,
    blocks.stages,
  )
  span = wgs * block_q
  qk_scale = scale * LOG2E

  def attention_dq(
    q_ref, k_ref, v_ref, do_ref, bias_ref, ones_ref, lse_ref, delta_ref, dq_ref, scratch, barriers
  ):
    q_smem, do_smem, lse_smem, delta_smem, ones_smem, ring_buffers = scratch
    own_ready, ring_barriers = barriers
    ring = KeyRing.of(ring_buffers, ring_barriers)
    b, h = lax.axis_index('batch'), lax.axis_index('heads')
    tile = heaviest_first(lax.axis_index('q_tile'), seq // span)
    wg = lax.axis_index('wg')
    program_steps = pl.cdiv((tile + 1) * span, block_kv)

    @pl.when(wg < wgs)
    def _math():
      plgpu.set_max_registers(blocks.math_registers, action='increase')
      q_start = tile * span + wg * block_q
      rows = (b, pl.ds(q_start, block_q), h)
      vector = (b, h, pl.ds(q_start, block_q))
      ready = own_ready.at[wg]
      plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[wg], ready)
      plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[wg], ready)
      plgpu.copy_gmem_to_smem(lse_ref.at[vector], lse_smem.at[wg], ready)
      plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem.at[wg], ready)
      if blocks.bias_in_product:
        plgpu.copy_gmem_to_smem(ones_ref, ones_smem.at[wg], ready)
      plgpu.barrier_wait(ready)
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      lse = load_vector(lse_smem.at[wg], row_layout, interpret)
      delta = load_vector(delta_smem.at[wg], row_layout, interpret)
      steps = pl.cdiv(q_start + block_q, block_kv)
      unmasked_steps = lax.div(q_start, block_kv)

      def kv_step(step, dq, masked: bool):
        slot = lax.rem(step, stages)
        plgpu.barrier_wait(ring.k_ready.at[slot])
        also: tuple = ()
        if blocks.bias_in_product:  # the key tile's ALiBi row joins Q K^T
          plgpu.barrier_wait(ring.bias_ready.at[slot])
          also = ((ones_smem.at[wg], ring.bias.at[slot]),)
        if blocks.paired_backward:
          plgpu.barrier_wait(ring.v_ready.at[slot])
          scores, d_probs = mma_together(
            (
              Fresh(q_smem.at[wg], ring.k.at[slot], transpose_b=True, also=also),
              Fresh(do_smem.at[wg], ring.v.at[slot], transpose_b=True),
            ),
            interpret,
          )
          plgpu.barrier_arrive(ring.v_free.at[slot])
        else:
          scores = mma(q_smem.at[wg], ring.k.at[slot], interpret, transpose_b=True, also=also)
        bias = None if blocks.bias_in_product else ring.key_bias(slot, interpret)
        probs = exponentiated(
          scores,
          bias,
          lse,
          qk_scale,
          causal_mask(scores.shape, q_start, step * block_kv, True, interpret) if masked else None,
          rows_are_queries=True,
        )
        if not blocks.paired_backward:
          plgpu.barrier_wait(ring.v_ready.at[slot])
          d_probs = mma(do_smem.at[wg], ring.v.at[slot], interpret, transpose_b=True)
          plgpu.barrier_arrive(ring.v_free.at[slot])
        d_scores = probs * (d_probs - lax.broadcast_in_dim(delta, probs.shape, [0]))
        dq = mma_accumulate(dq, d_scores.astype(dtype), ring.k.at[slot], interpret)
        plgpu.barrier_arrive(ring.k_free.at[slot])
        return dq

      def drain(step, _):  # key tiles only the other warpgroup needed
        ring.release(lax.rem(step, stages))

      dq = zeros_tile((block_q, head_dim), interpret)
      dq = lax.fori_loop(0, unmasked_steps, functools.partial(kv_step, masked=False), dq)
      dq = lax.fori_loop(unmasked_steps, steps, functools.partial(kv_step, masked=True), dq)
      lax.fori_loop(steps, program_steps, drain, None)
      q_smem.at[wg][...] = (dq * scale).astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[rows])
      wait_output_read()

    @pl.when(wg == wgs)
    def _copies():
      plgpu.set_max_registers(blocks.copy_registers, action='decrease')
      ring.fill(k_ref, v_ref, bias_ref, b, h, block_kv, program_steps, stages)
      ring.wait_all_free(program_steps, stages)

  ring_buffers, ring_barriers = key_ring_types(
    stages, block_kv, head_dim, dtype, wgs, blocks.bias_in_product
  )
  scratch = (
    _tile_smem((wgs, block_q, head_dim), dtype),
    _tile_smem((wgs, block_q, head_dim), dtype),
    plgpu.SMEM((wgs, block_q), jnp.float32),
    plgpu.SMEM((wgs, block_q), jnp.float32),
    _bias_tile_smem((wgs, block_q, BIAS_COLUMNS), dtype) if blocks.bias_in_product else None,
    ring_buffers,
  )
  # q, dO, lse and delta of a warpgroup (and its ones) arrive on one barrier.
  own_copies = 5 if blocks.bias_in_product else 4
  barriers = (plgpu.Barrier(num_arrivals=own_copies, num_barriers=wgs), ring_barriers)
  call = _kernel_call(
    attention_dq,
    jax.ShapeDtypeStruct(q.shape, dtype),
    scratch,
    barriers,
    (heads, seq // span, batch),
    ('heads', 'q_tile', 'batch'),
    wgs,
    blocks,
    interpret,
  )
  return call(q, k, v, d_out, key_bias, query_ones(block_q, dtype), lse, delta)


def _backward_dkv(q, k, v, d_out, key_bias, lse, delta, scale, blocks: MosaicBlocks, interpret):
  """dK and dV: a program per compute_wgs * block_kv_dkv keys, streaming the query tiles from
  the first that sees them (the diagonal) to the end."""
  batch, seq, heads, head_dim = q.shape
  dtype = q.dtype
  wgs, block_q, block_kv, stages = (
    blocks.compute_wgs,
    blocks.block_q_dkv,
    blocks.block_kv_dkv,
    blocks.stages,
  )
  span = wgs * block_kv
  qk_scale = scale * LOG2E
  q_tiles = seq // block_q

  def attention_dkv(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    bias_ref,
    ones_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    scratch,
    barriers,
  ):
    k_smem, v_smem, bias_smem, ones_smem, q_smem, do_smem, lse_smem, delta_smem = scratch
    own_ready, q_ready, lse_ready, do_ready, delta_ready, q_free, do_free = barriers
    b, h, tile = lax.axis_index('batch'), lax.axis_index('heads'), lax.axis_index('kv_tile')
    wg = lax.axis_index('wg')
    first_step = lax.div(tile * span, block_q)  # the program's first query tile

    @pl.when(wg < wgs)
    def _math():
      plgpu.set_max_registers(blocks.math_registers, action='increase')
      kv_start = tile * span + wg * block_kv
      keys = (b, pl.ds(kv_start, block_kv), h)
      ready = own_ready.at[wg]
      plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[wg], ready)
      plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[wg], ready)
      plgpu.copy_gmem_to_smem(bias_ref.at[h, pl.ds(kv_start, block_kv)], bias_smem.at[wg], ready)
      if blocks.bias_in_product:
        plgpu.copy_gmem_to_smem(ones_ref, ones_smem.at[wg], ready)
      plgpu.barrier_wait(ready)
      # bias_in_product: the keys' ALiBi rows join K Q^T as the product of their parts and the
      # queries' ones; otherwise they are added to its result.
      also = ((bias_smem.at[wg], ones_smem.at[wg]),) if blocks.bias_in_product else ()
      bias = (
        None
        if blocks.bias_in_product
        else load_vector(bias_smem.at[wg], plgpu.Layout.WGMMA.reduce(1), interpret)
      )
      own_first = lax.div(kv_start, block_q)  # this warpgroup's diagonal query tile
      unmasked_from = pl.cdiv(kv_start + block_kv, block_q)
      column_layout = plgpu.Layout.WGMMA.reduce(0)

      def q_step(step, carry, masked: bool):
        dk, dv = carry
        slot = lax.rem(step - first_step, stages)
        plgpu.barrier_wait(q_ready.at[slot])
        scores = mma(  # [keys, queries]
          k_smem.at[wg], q_smem.at[slot], interpret, transpose_b=True, also=also
        )
        plgpu.barrier_wait(lse_ready.at[slot])
        lse = load_vector(lse_smem.at[slot], column_layout, interpret)
        probs = exponentiated(
          scores,
          bias,
          lse,
          qk_scale,
          causal_mask(scores.shape, kv_start, step * block_q, False, interpret) if masked else None,
          rows_are_queries=False,
        )
        plgpu.barrier_wait(do_ready.at[slot])
        if blocks.paired_backward:
          dv, d_probs = mma_together(
            (
              Accumulate(dv, probs.astype(dtype), do_smem.at[slot]),
              Fresh(v_smem.at[wg], do_smem.at[slot], transpose_b=True),
            ),
            interpret,
          )
        else:
          dv = mma_accumulate(dv, probs.astype(dtype), do_smem.at[slot], interpret)
          d_probs = mma(v_smem.at[wg], do_smem.at[slot], interpret, transpose_b=True)
        plgpu.barrier_wait(delta_ready.at[slot])
        delta = load_vector(delta_smem.at[slot], column_layout, interpret)
        plgpu.barrier_arrive(do_free.at[slot])
        d_scores = probs * (d_probs - lax.broadcast_in_dim(delta, probs.shape, [1]))
        dk = mma_accumulate(dk, d_scores.astype(dtype), q_smem.at[slot], interpret)
        plgpu.barrier_arrive(q_free.at[slot])
        return dk, dv

      def skip(step, _):  # query tiles before this warpgroup's diagonal: see none of its keys
        slot = lax.rem(step - first_step, stages)
        for ready_slots in (q_ready, lse_ready, do_ready, delta_ready):
          plgpu.barrier_wait(ready_slots.at[slot])
        plgpu.barrier_arrive(q_free.at[slot])
        plgpu.barrier_arrive(do_free.at[slot])

      lax.fori_loop(first_step, own_first, skip, None)
      carry = (
        zeros_tile((block_kv, head_dim), interpret),
        zeros_tile((block_kv, head_dim), interpret),
      )
      carry = lax.fori_loop(own_first, unmasked_from, functools.partial(q_step, masked=True), carry)
      dk, dv = lax.fori_loop(unmasked_from, q_tiles, functools.partial(q_step, masked=False), carry)
      k_smem.at[wg][...] = (dk * scale).astype(dtype)
      v_smem.at[wg][...] = dv.astype(dtype)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[keys])
      plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[keys])
      wait_output_read()

    @pl.when(wg == wgs)
    def _copies():
      plgpu.set_max_registers(blocks.copy_registers, action='decrease')

      def issue(step, slot):
        rows = (b, pl.ds(step * block_q, block_q), h)
        vector = (b, h, pl.ds(step * block_q, block_q))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], q_ready.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[vector], lse_smem.at[slot], lse_ready.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], do_ready.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem.at[slot], delta_ready.at[slot])

      _stream(q_tiles - first_step, stages, (q_free, do_free), issue, start=first_step)
      _wait_last_consumed(q_tiles - first_step, stages, (q_free, do_free))

  scratch = (
    _tile_smem((wgs, block_kv, head_dim), dtype),
    _tile_smem((wgs, block_kv, head_dim), dtype),
    _bias_tile_smem((wgs, block_kv, BIAS_COLUMNS), dtype)
    if blocks.bias_in_product
    else plgpu.SMEM((wgs, block_kv), jnp.float32),
    _bias_tile_smem((wgs, block_q, BIAS_COLUMNS), dtype) if blocks.bias_in_product else None,
    _tile_smem((stages, block_q, head_dim), dtype),
    _tile_smem((stages, block_q, head_dim), dtype),
    plgpu.SMEM((stages, block_q), jnp.float32),
    plgpu.SMEM((stages, block_q), jnp.float32),
  )
  barriers = (
    # k, v and the bias row of a warpgroup (and its ones)
    plgpu.Barrier(num_arrivals=4 if blocks.bias_in_product else 3, num_barriers=wgs),
    *(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
    plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
    plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
  )
  kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
  call = _kernel_call(
    attention_dkv,
    (kv_type, kv_type),
    scratch,
    barriers,
    (heads, seq // span, batch),
    ('heads', 'kv_tile', 'batch'),
    wgs,
    blocks,
    interpret,
  )
  return call(q, k, v, d_out, key_bias, query_ones(block_q, dtype), lse, delta)
