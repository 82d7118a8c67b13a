"""8-bit Adam: both Adam moments stored as block-wise dynamically quantised 8-bit codes
(bitsandbytes' Adam8bit, Dettmers et al. 2022), as an Optax transformation.

A quantised tensor is cut into blocks of B values along one axis of the parameter (its "block
axis"); each block keeps one fp32 scale (its absmax) and each value one uint8 code, an index into
a dynamic (non-linear, exponent-and-fraction) code of 256 values in [-1, 1] (signed, the first
moment) or [0, 1] (unsigned, the second moment). A value is `code_value * scale`. The codes are
stored so that byte 0 is the value 0: zero padding (ZeRO's, partitioning.zero_split) is zero
moments. Layout of one moment of a parameter of shape [..., n, ...] blocked on axis a:
  codes   uint8 [..., n / B, ..., B]   the parameter's shape, axis a cut into n / B blocks, plus a
                                       trailing axis of the B values of each block
  scales  fp32  [..., n / B, ...]      codes.shape[:-1]
Each step dequantises, updates the moments in fp32, computes the update from the fp32 moments
(as bitsandbytes' kernel does) and requantises them. The step count is stored as in AdamW.

The block axis is chosen from the parameter's mesh-independent shape (the same on every mesh, so
a checkpoint's codes restore anywhere): the last axis whose length B divides, never the stacked
`layers` axis. The codes and scales take the parameter's sharding, except that on the block axis a
mesh axis is kept only where it divides the number of blocks (`partitioning.fit_spec`): a shard
always holds whole blocks, and a state whose shards would cut a block is replicated along that
axis instead. Tensors with fewer than `quant_min_size` values per layer, with no axis that B
divides, listed as fp32-state, and the token embedding always (FP32_STATE) keep fp32 moments,
exactly as optax.scale_by_adam's.

The token embedding's moments stay fp32 because that is how bitsandbytes' Adam8bit runs language
models, and what its parity with 32-bit Adam is reported for: its StableEmbedding (which
Megatron-DeepSpeed's --use-bnb-optimizer uses) keeps its own state in 32 bits (GlobalOptimManager's
'optim_bits': 32 override). Quantised, the tied embedding's moments drift from AdamW's several
times more than the other matrices', here and in bitsandbytes' kernel alike, and the loss ends
above AdamW's; with fp32 embedding moments it does not (the figures: docs/model.md,
benchmarks/adam8bit_vs_bnb.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.mesh import partitioning


def dynamic_code(signed: bool) -> np.ndarray:
  """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`: 256 sorted
  values, each a power of ten (the exponent, 1e-6 .. 1) times a fraction in (0.1, 1), more
  fractions for larger exponents; plus 0 and 1."""
  values = []
  for exponent in range(7):
    items = 2**exponent if signed else 2 ** (exponent + 1)
    bounds = np.linspace(0.1, 1, items + 1)
    means = (bounds[:-1] + bounds[1:]) / 2
    values += list(10.0 ** (exponent - 6) * means)
    if signed:
      values += list(-(10.0 ** (exponent - 6)) * means)
  values += [0.0, 1.0]
  assert len(values) == 256
  return np.sort(np.asarray(values, np.float32))


SIGNED_CODE = dynamic_code(signed=True)
UNSIGNED_CODE = dynamic_code(signed=False)


def code_for(moment: str) -> np.ndarray:
  """The code of 'mu' (signed) or 'nu' (unsigned)."""
  return SIGNED_CODE if moment == 'mu' else UNSIGNED_CODE


def _zero_index(code: np.ndarray) -> int:
  return int(np.flatnonzero(code == 0)[0])


class QuantizedMoment(NamedTuple):
  codes: Any  # uint8 [..., n / B, ..., B]
  scales: Any  # fp32 codes.shape[:-1]: each block's absmax


class ScaleByAdam8bitState(NamedTuple):
  count: Any  # int32 scalar, as optax.ScaleByAdamState's
  mu: Any  # per parameter: an fp32 array (as AdamW's) or a QuantizedMoment
  nu: Any


@dataclasses.dataclass(frozen=True)
class BlockAxis:
  """Where one parameter's moments are quantised: blocks of `block_size` along `axis`, whose
  (mesh-independent) length is `length`."""

  axis: int
  length: int
  block_size: int


def is_quantized(x) -> bool:
  return isinstance(x, QuantizedMoment)


def _names(path) -> list[str]:
  return [str(getattr(k, 'key', getattr(k, 'name', ''))) for k in path]


# Params whose moments are fp32 whatever the config: the token embedding (and tied output
# layer), as bitsandbytes' StableEmbedding keeps its state in 32 bits (module docstring).
FP32_STATE = ('word_embeddings',)


def block_axes(params, block_size: int, min_size: int, fp32_state: tuple[str, ...] = ()):
  """Per parameter (a tree like `params`, of arrays or shapes): its BlockAxis, or None for fp32
  moments (see the module docstring for the choice). `fp32_state` names params kept fp32 on top
  of FP32_STATE."""
  fp32 = FP32_STATE + tuple(fp32_state)

  def one(path, leaf):
    names = _names(path)
    shape = tuple(leaf.shape)
    stacked = 'layers' in names
    per_layer = math.prod(shape[1:] if stacked else shape)
    if any(n in fp32 for n in names) or per_layer < min_size:
      return None
    candidates = [
      a for a in range(len(shape)) if not (stacked and a == 0) and shape[a] % block_size == 0
    ]
    if not candidates:
      return None
    return BlockAxis(candidates[-1], shape[candidates[-1]], block_size)

  return jax.tree_util.tree_map_with_path(one, params)


def quantize(x: jax.Array, where: BlockAxis, code: np.ndarray) -> QuantizedMoment:
  """x (fp32, the parameter's shape) as codes and per-block absmax scales; each value becomes
  the code nearest to value / absmax, except that in the signed code a negative value nearest to
  0 becomes the negative code nearest to 0 (bitsandbytes' kernel keeps the first moment's sign)."""
  a, b = where.axis, where.block_size
  blocks = x.reshape(x.shape[:a] + (x.shape[a] // b, b) + x.shape[a + 1 :])
  blocks = jnp.moveaxis(blocks, a + 1, -1)
  scales = jnp.max(jnp.abs(blocks), axis=-1)
  normalised = blocks / jnp.where(scales > 0, scales, 1.0)[..., None]
  table = jnp.asarray(code)
  above = jnp.clip(jnp.searchsorted(table, normalised), 1, len(code) - 1)
  lower, upper = table[above - 1], table[above]
  index = jnp.where(normalised - lower <= upper - normalised, above - 1, above)
  if code.min() < 0:
    index = jnp.where((normalised < 0) & (index == _zero_index(code)), index - 1, index)
  codes = ((index - _zero_index(code)) % 256).astype(jnp.uint8)
  return QuantizedMoment(codes, scales.astype(jnp.float32))


def dequantize(q: QuantizedMoment, where: BlockAxis, code: np.ndarray) -> jax.Array:
  """The fp32 moment, in the parameter's shape."""
  values = dequantize_blocks(q.codes, q.scales, code, xp=jnp)
  a = where.axis
  values = jnp.moveaxis(values, -1, a + 1)
  shape = values.shape
  return values.reshape(shape[:a] + (shape[a] * shape[a + 1],) + shape[a + 2 :])


def dequantize_blocks(codes, scales, code: np.ndarray, xp=np):
  """codes [..., B] and scales [...] as fp32 values [..., B], with numpy (xp=np, for checkpoint
  inspection) or jax.numpy."""
  index = (codes.astype(xp.int32) + _zero_index(code)) % 256
  return xp.asarray(code)[index] * scales[..., None]


def init_moment(param, where: BlockAxis | None):
  """Zero moments for `param` (an array or a shape); its block axis keeps `where.length`, which
  is the unpadded length when `param` holds ZeRO padding (the padding never joins a block)."""
  if where is None:
    return jnp.zeros(param.shape, jnp.float32)
  shape = list(param.shape)
  shape[where.axis] = where.length // where.block_size
  return QuantizedMoment(
    jnp.zeros(tuple(shape) + (where.block_size,), jnp.uint8), jnp.zeros(tuple(shape), jnp.float32)
  )


def scale_by_adam_8bit(b1: float, b2: float, eps: float, axes):
  """optax.scale_by_adam (eps_root 0, no Nesterov) with 8-bit moments where `axes` (a tree of
  BlockAxis or None like the params) says so."""

  def init(params):
    leaves_is = lambda x: x is None or isinstance(x, BlockAxis)
    mu = jax.tree.map(lambda where, p: init_moment(p, where), axes, params, is_leaf=leaves_is)
    nu = jax.tree.map(lambda where, p: init_moment(p, where), axes, params, is_leaf=leaves_is)
    return ScaleByAdam8bitState(jnp.zeros([], jnp.int32), mu, nu)

  def update(updates, state, params=None):
    # optax.scale_by_adam's update, step by step (the same ops, so the fp32 leaves are AdamW's
    # bitwise), on the dequantised moments; the update comes from the fp32 moments, which are
    # requantised for storage (as bitsandbytes' kernel does).
    del params
    mu = optax.tree.update_moment(updates, _map(dequantize, state.mu, SIGNED_CODE), b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(
      updates, _map(dequantize, state.nu, UNSIGNED_CODE), b2, 2
    )
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu_hat, nu_hat)
    return updates, ScaleByAdam8bitState(
      count, _map(quantize, mu, SIGNED_CODE), _map(quantize, nu, UNSIGNED_CODE)
    )

  def _map(fn, moments, code):
    """fn(moment, where, code) on the quantised params' moments, the others as they are."""
    return jax.tree.map(
      lambda where, m: m if where is None else fn(m, where, code),
      axes,
      moments,
      is_leaf=lambda x: x is None or isinstance(x, BlockAxis),
    )

  return optax.GradientTransformation(init, update)


def _fit_sharding(sharding: NamedSharding, shape) -> NamedSharding:
  return NamedSharding(sharding.mesh, partitioning.fit_spec(sharding.spec, shape, sharding.mesh))


def state_shardings(state: ScaleByAdam8bitState, param_shardings, replicated: NamedSharding):
  """Shardings of an (abstract) ScaleByAdam8bitState: an fp32 moment takes its parameter's; the
  codes and scales take it too on every axis but the block axis, and there keep the mesh axes
  that divide the number of blocks (whole blocks per shard); the count is replicated."""

  def moment(m, sharding):
    if not is_quantized(m):
      return sharding
    spec = tuple(sharding.spec) + (None,) * (m.scales.ndim - len(sharding.spec))
    scales = _fit_sharding(NamedSharding(sharding.mesh, P(*spec)), m.scales.shape)
    codes = NamedSharding(
      sharding.mesh, P(*tuple(scales.spec) + (None,) * (m.codes.ndim - len(scales.spec)))
    )
    return QuantizedMoment(codes, scales)

  is_sharding = lambda x: isinstance(x, NamedSharding)
  per_param = lambda tree: jax.tree.map(
    lambda s, m: moment(m, s), param_shardings, tree, is_leaf=is_sharding
  )
  return ScaleByAdam8bitState(replicated, per_param(state.mu), per_param(state.nu))


def unsplit_moments(state: ScaleByAdam8bitState, param_shardings) -> list[str]:
  """The quantised moments (by parameter path) whose shards would cut a block on some mesh axis
  that splits their parameter, so that they are held whole along it instead, with that axis."""
  problems = []
  mesh_axes = lambda sharding: {
    a
    for entry in sharding.spec
    for a in (entry if isinstance(entry, tuple) else (entry,))
    if a and sharding.mesh.shape[a] > 1
  }

  def check(path, sharding, moment):
    if is_quantized(moment):
      lost = mesh_axes(sharding) - mesh_axes(moment.scales.sharding)
      if lost:
        problems.append(f'{"/".join(_names(path))} ({" and ".join(sorted(lost))})')

  jax.tree_util.tree_map_with_path(
    check, param_shardings, state.mu, is_leaf=lambda x: isinstance(x, NamedSharding)
  )
  return problems


def bytes_per_param(params, axes) -> float:
  """Optimizer-state bytes per parameter (both moments with their scales, the count left out)."""
  total, count = 0, 0
  leaves_is = lambda x: x is None or isinstance(x, BlockAxis)
  for where, p in zip(jax.tree.leaves(axes, is_leaf=leaves_is), jax.tree.leaves(params)):
    n = math.prod(p.shape)
    count += n
    total += 8 * n if where is None else 2 * (n + 4 * (n // where.block_size))
  return total / max(count, 1)
