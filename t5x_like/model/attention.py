"""The one place that picks and runs the attention implementation (`model.attention_impl`).

* 'xla': `attention_reference` (plain JAX; the partitioner splits heads over `tensor`).
* 'pallas': the fused flash-attention kernels (`t5x_like.kernels.flash_attention`); Triton on GPU,
  interpret mode automatically on CPU.
* 'cudnn': `jax.nn.dot_product_attention(implementation='cudnn')` with a materialised ALiBi bias.
* 'tokamax': openxla's `tokamax.dot_product_attention` (`tokamax_attention`): its Mosaic GPU
  kernels on compute capability >= 9.0 (Hopper, Blackwell), its Triton kernels on other CUDA GPUs
  (>= 8.0), its XLA implementation on CPU (so the wrapper is tested there). ALiBi is a broadcast
  [1, heads, 1, seq] float32 bias `slope * key_position` (`alibi_key_bias`).
* 'mosaic': ours for Hopper (`t5x_like.kernels.mosaic_attention`): Mosaic GPU kernels with TMA,
  wgmma and warp specialisation, ALiBi added in the kernel a key tile at a time; compute
  capability >= 9.0, Mosaic GPU's interpret mode on CPU.
* 'auto' (the default): resolved per device when the model is traced (and at start-up, for the
  log) to the first implementation of the device's row of `AUTO_ORDER` that can run the model: the
  fastest measured there. `choose` returns the choice and the reason the log gives.

The fused ones run per shard under the mesh: a `shard_map` over the batch (`data`) and head
(`tensor`) axes, each shard with the ALiBi slopes of its own (contiguous) heads. The model passes
no segment ids (packed documents attend across their boundaries, as Megatron without
--reset-attention-mask), so no implementation here takes them.

Decoding with a KV cache attends one new token per row to the cached keys (`cached_attention`):
plain JAX whatever the implementation, as a matrix-vector product gains nothing from tiling.

Fail fast, like Megatron's --abort-on-unmet-fused-kernel-constraints: a fused implementation that
cannot run the model's head_dim / dtype / platform is a ConfigError naming the constraint, at
config validation where the constraint is known then (the platform only when JAX has started or is
CPU-only) and again when the model is traced. With `model.attention_fallback=True` it is a warning
that says 'xla' runs instead. 'auto' never fails: 'xla', last in every row, runs anything.
"""

from __future__ import annotations

import dataclasses
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
from t5x_like.kernels.mosaic_attention import cuda_runtime_version as mosaic_cuda_runtime_version
from t5x_like.kernels.mosaic_attention import mosaic_attention
from t5x_like.kernels.mosaic_attention import unmet_constraints as mosaic_unmet_constraints
from t5x_like.kernels.reference import attention_reference
from t5x_like.mesh import partitioning

if TYPE_CHECKING:  # annotations only (they are strings here)
  from t5x_like.config import ModelConfig

IMPLEMENTATIONS = ('xla', 'pallas', 'cudnn', 'tokamax', 'mosaic')
# What model.attention_impl may be: the implementations, or 'auto' (config.py's Literal says the
# same; tests/kernels/test_tokamax_attention.py checks that they agree).
CHOICES = ('auto', *IMPLEMENTATIONS)
# Ours, whose forward names its output and log-sum-exp (kernels/residuals.py): under
# remat_policy='save_dots' their backward runs no second forward. The others' residuals are inside
# a library's custom_vjp ('cudnn', 'tokamax') or are the scores themselves ('xla'): the backward
# recomputes their forward.
KEEPS_RESIDUALS_UNDER_SAVE_DOTS = ('pallas', 'mosaic')

# model.attention_impl='auto': per device family (`Device.family`), the implementations fastest
# first and the measurement that orders them; 'auto' runs the first one that can run the model
# (`unmet_constraints` empty). 'xla' ends every row, so every model runs. The GPU suite decides
# the order: `python benchmarks/gpu_suite.py --json OUT` (the attention benchmark and a train step
# per implementation), its numbers recorded in docs/benchmarks.md; change a row only with a
# measurement there. A family not listed runs 'xla'.
AUTO_ORDER: dict[str, tuple[tuple[str, ...], str]] = {
  'hopper': (
    ('mosaic', 'pallas', 'tokamax', 'cudnn', 'xla'),
    'H200, BLOOM-1.3B step (docs/benchmarks.md, 2026-11-28): mosaic 856 ms, pallas 868, '
    'tokamax 875, xla 1346 (H100, 2026-11-27: cudnn 1009 against mosaic 937); attention '
    'fwd+bwd at seq 4096, head_dim 128, causal + ALiBi: mosaic 402 TFLOP/s, tokamax 278, '
    'pallas 255, cudnn 163',
  ),
  'ampere': (
    ('pallas', 'xla'),
    'the Triton flash kernels (Pallas), on an H100 the fastest after mosaic, which needs Hopper; '
    'none measured on Ampere yet',
  ),
  'cpu': (
    ('xla',),
    'the fused kernels run on CPU only in interpret mode, an emulation slower than XLA',
  ),
}

# The backward of tokamax's GPU kernels writes the score gradient ds ([batch, heads, q, k],
# padded to its tiles) whenever a bias is given, then sums it into dbias. ALiBi is a constant,
# so dbias is never used: XLA drops the sum, not the kernel's write. Only ds's dtype is ours to
# choose (the kernels' `dbias_intermediate_dtype`; the bias's, float32, otherwise): bfloat16 halves
# the buffer. dq, dk and dv do not depend on it (the kernel keeps ds in float32 registers for them).
TOKAMAX_DS_DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Device:
  """What choosing an implementation needs to know of a device, as data (tests need no GPU)."""

  platform: str  # jax's: 'cpu', 'gpu', 'tpu'
  kind: str = ''  # jax's device_kind, e.g. 'NVIDIA H100 80GB HBM3'
  compute_capability: str | None = None  # CUDA's 'major.minor' ('9.0'); None elsewhere

  @classmethod
  def of(cls, device) -> Device:
    """The Device of a jax.Device."""
    cc = getattr(device, 'compute_capability', None)
    return cls(device.platform, getattr(device, 'device_kind', ''), None if cc is None else str(cc))

  @property
  def cuda_capability(self) -> float | None:
    """The compute capability as a number; None off CUDA (ROCm's names are not numbers)."""
    if self.platform != 'gpu' or self.compute_capability is None:
      return None
    try:
      return float(self.compute_capability)
    except ValueError:
      return None

  @property
  def family(self) -> str:
    """AUTO_ORDER's key: 'hopper' (compute capability 9.x), 'ampere' (8.x), else the platform
    ('cpu', 'gpu' for other GPUs, 'tpu')."""
    cc = self.cuda_capability
    if cc is not None and 9.0 <= cc < 10.0:
      return 'hopper'
    if cc is not None and 8.0 <= cc < 9.0:
      return 'ampere'
    return self.platform

  def describe(self) -> str:
    """'cpu', or 'gpu (NVIDIA H100 80GB HBM3, compute capability 9.0)'."""
    details = [self.kind] if self.kind and self.kind != self.platform else []
    if self.compute_capability:
      details.append(f'compute capability {self.compute_capability}')
    return f'{self.platform} ({", ".join(details)})' if details else self.platform


def unmet_constraints(
  impl: str, *, head_dim: int, dtype, platform: str | None, compute_capability: str | None = None
) -> list[str]:
  """What stops `impl` from running this head_dim / dtype on this platform (None: not known yet;
  compute_capability: CUDA's, for tokamax's choice of kernels)."""
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
  elif impl == 'tokamax':
    problems += _tokamax_unmet_constraints(head_dim, dtype, platform, compute_capability)
  elif impl == 'mosaic':
    problems += mosaic_unmet_constraints(
      head_dim=head_dim,
      dtype=dtype,
      cuda_version=mosaic_cuda_runtime_version() if platform == 'gpu' else None,
    )
    cc = Device('gpu', compute_capability=compute_capability).cuda_capability
    if platform not in (None, 'gpu', 'cpu'):
      problems.append(
        f'the Mosaic GPU kernels run on NVIDIA GPUs (or in interpret mode on CPU); this process '
        f'has {platform} devices'
      )
    elif platform == 'gpu' and compute_capability is not None and (cc is None or cc // 1 != 9):
      problems.append(
        'the Mosaic GPU attention kernels use Hopper instructions (wgmma): they need compute '
        f"capability 9.x, got {compute_capability}; model.attention_impl='auto' picks one that "
        'runs here'
      )
  return problems


def _tokamax_unmet_constraints(
  head_dim: int, dtype: str, platform: str | None, compute_capability: str | None
) -> list[str]:
  if platform not in (None, 'gpu', 'cpu'):
    return [
      'tokamax attention is wired here for GPUs (its Mosaic or Triton kernels) and CPU (its XLA '
      f'implementation); this process has {platform} devices'
    ]
  if platform == 'cpu':
    return []  # tokamax's XLA implementation runs any head_dim and dtype
  problems = []
  if head_dim > 256:  # platform gpu, or not known yet
    problems.append(
      f"tokamax's GPU attention is tested up to head_dim 256 (its own tests), got {head_dim}"
    )
  cc = Device('gpu', compute_capability=compute_capability).cuda_capability
  if platform == 'gpu' and compute_capability is not None and (cc is None or cc < 8.0):
    problems.append(
      "tokamax's GPU attention needs an NVIDIA GPU of compute capability >= 8.0 (its Triton "
      f'kernels; Mosaic from 9.0), got {compute_capability}'
    )
  if cc is not None and cc >= 9.0 and dtype not in ('bfloat16', 'float16'):
    problems.append(
      "tokamax's Mosaic GPU attention (compute capability >= 9.0) multiplies bfloat16 or "
      f'float16 only (float32 q, k, v would be rounded to bfloat16), got model.dtype {dtype}'
    )
  return problems


def check_config(cfg: ModelConfig, device: Device | None = None) -> None:
  """Config-time check (no JAX backend is started here): raises unless fallback is allowed.
  device: the one the model will run or be compiled for (`plan --gpu`'s); default: this
  process's, where known."""
  device = device or device_if_known()
  if cfg.attention_impl == 'auto' and device is None:
    return  # resolved when the model is traced; 'xla' runs whatever else cannot
  resolve_impl(cfg, device, quiet=True)


def choose(cfg: ModelConfig, device: Device | str | None) -> tuple[str, str]:
  """(the implementation that runs cfg on `device`, why): cfg.attention_impl, its 'auto'
  resolved with AUTO_ORDER, or 'xla' with model.attention_fallback=True for a fused one that
  cannot run here (without it, a ConfigError naming the constraints). device None: not known
  yet (then 'auto' is taken for 'xla', the one that runs anywhere)."""
  if isinstance(device, str):
    device = Device(device)
  impl = cfg.attention_impl
  if impl not in CHOICES:
    raise ConfigError(f'model.attention_impl must be one of {CHOICES}, got {impl!r}')
  platform = None if device is None else device.platform
  cc = None if device is None else device.compute_capability
  constraints = functools.partial(
    unmet_constraints,
    head_dim=cfg.head_dim,
    dtype=cfg.dtype,
    platform=platform,
    compute_capability=cc,
  )
  if impl == 'auto':
    return _auto(cfg, device, constraints)
  problems = constraints(impl)
  if not rematerialisable(impl, platform) and cfg.remat_policy != 'none':
    problems.append(
      f"on CPU the Mosaic GPU kernels run in interpret mode, whose callbacks JAX's "
      f"rematerialisation cannot replay: model.remat_policy={cfg.remat_policy!r} needs 'none' there"
    )
  if impl == 'xla' or not problems:
    return impl, 'model.attention_impl'
  message = f'model.attention_impl={impl!r} cannot run this model: {"; ".join(problems)}'
  if not cfg.attention_fallback:
    raise ConfigError(
      f"{message}. Use model.attention_impl='auto' (the fastest implementation that runs here) "
      "or 'xla', or set model.attention_fallback=True to run 'xla' with a warning"
    )
  return (
    'xla',
    f"{message}; running model.attention_impl='xla' instead (model.attention_fallback=True)",
  )


def rematerialisable(impl: str, platform: str | None) -> bool:
  """Whether `impl`'s kernel can run inside `jax.checkpoint` on `platform`: not Mosaic GPU's
  interpret mode on CPU, whose ordered callbacks JAX's rematerialisation cannot replay (jax
  0.10.2: 'Effects not supported in partial-eval of `checkpoint`/`remat`')."""
  return not (impl == 'mosaic' and platform == 'cpu')


def _auto(cfg: ModelConfig, device: Device | None, constraints) -> tuple[str, str]:
  if cfg.attention_dropout > 0:
    return 'xla', f'model.attention_dropout={cfg.attention_dropout}: only xla has attention dropout'
  if device is None:
    return 'xla', 'the device is not known yet'
  family = device.family
  order, measured = AUTO_ORDER.get(
    family, (('xla',), f'no {family} measurement: set model.attention_impl to choose another')
  )
  skipped: list[str] = []
  for candidate in order:
    problems = constraints(candidate)
    if not problems:
      why = f"the first that runs this model of {family}'s {' > '.join(order)} ({measured})"
      if skipped:
        why += f'; skipped {"; ".join(skipped)}'
      return candidate, why
    skipped.append(f'{candidate} ({"; ".join(problems)})')
  return 'xla', f'no implementation of {order} runs this model: {"; ".join(skipped)}'


def resolve_impl(cfg: ModelConfig, device: Device | str | None, quiet: bool = False) -> str:
  """The implementation that runs (`choose`), warning when model.attention_fallback chose it."""
  impl, why = choose(cfg, device)
  if not quiet and cfg.attention_impl not in ('auto', impl):
    warnings.warn(why, RuntimeWarning, stacklevel=3)
  return impl


def resolved(cfg: ModelConfig, device: Device | None) -> str:
  """cfg.attention_impl with 'auto' resolved for `device` (None, not known yet: 'xla', the one
  that runs anywhere); a fixed implementation as it is, unchecked (what the planner and
  `generate`'s memory bound count)."""
  return choose(cfg, device)[0] if cfg.attention_impl == 'auto' else cfg.attention_impl


def describe(cfg: ModelConfig, device: Device) -> str:
  """The start-up log's line on attention: the implementation that runs on `device`, and why."""
  impl, why = choose(cfg, device)
  if cfg.attention_impl == 'auto':
    return f"> attention: model.attention_impl='auto' runs {impl!r} on {device.describe()}: {why}"
  if impl == cfg.attention_impl:
    return f'> attention: model.attention_impl={impl!r} on {device.describe()}'
  return f'> attention: {why}'


def attention(q, k, v, *, cfg: ModelConfig, mesh: Mesh | None, alibi_slopes=None, dropout_rng=None):
  """Causal self-attention of [batch, seq, heads, head_dim] q, k, v with the configured kernel."""
  device = Device.of(mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
  platform = device.platform
  impl = resolve_impl(cfg, device)
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
  elif impl == 'tokamax':
    kernel = functools.partial(tokamax_attention, implementation=tokamax_implementation(device))
  elif impl == 'mosaic':
    if platform == 'cpu' and mesh is not None and mesh.devices.size > 1:
      raise ConfigError(
        "model.attention_impl='mosaic' runs on CPU in Mosaic GPU's interpret mode, which "
        f'simulates one GPU at a time: it cannot run per shard of a {mesh.devices.size}-device '
        "mesh. Use 'auto' or 'xla' (or 'pallas') with a mesh on CPU"
      )
    kernel = functools.partial(mosaic_attention, interpret=platform == 'cpu')
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


def tokamax_implementation(device: Device) -> str:
  """The tokamax implementation `tokamax_attention` uses on `device`: 'mosaic' (its Mosaic GPU
  kernels) from compute capability 9.0, 'triton' below, 'xla' on CPU."""
  cc = device.cuda_capability
  if device.platform == 'cpu':
    return 'xla'
  if cc is not None and cc >= 9.0:
    return 'mosaic'
  if cc is not None and cc >= 8.0:
    return 'triton'
  raise ConfigError(
    f"model.attention_impl='tokamax' cannot run on {device.describe()}: tokamax's attention runs "
    "on CPU and on NVIDIA GPUs of compute capability >= 8.0; use model.attention_impl='auto'"
  )


def alibi_key_bias(alibi_slopes, seq: int) -> jax.Array:
  """ALiBi as a [1, heads, 1, seq] float32 bias: slope[h] * key position. ALiBi's
  slope[h] * (key - query) minus this is -slope[h] * query, a constant of each score row, which
  softmax cancels, so a bias broadcast over the queries (one row per head, never [seq, seq])
  gives the same attention. float32 because slope * key reaches slope * (seq - 1) (about 1,950 at
  seq 2048 for BLOOM-176B's first head), where bfloat16's spacing is 8: rounded to bfloat16 the
  bias would move the scores near the diagonal by up to 4 (tests/kernels/test_tokamax_attention.py
  shows the error). In float32 those scores are rounded by at most 6.1e-5 at seq 2048 (half
  float32's spacing below 2,048), far less than bf16 q and k's own rounding."""
  slopes = jnp.asarray(alibi_slopes, jnp.float32)
  return (slopes[:, None] * jnp.arange(seq, dtype=jnp.float32)[None, :])[None, :, None, :]


def tokamax_attention(q, k, v, *, alibi_slopes=None, implementation: str | None = None):
  """Causal attention of [batch, seq, heads, head_dim] q, k, v through
  `tokamax.dot_product_attention`, ALiBi as `alibi_key_bias` (float32 whatever q's dtype: every
  tokamax implementation adds it to float32 scores, docs/kernels.md). implementation: tokamax's
  ('mosaic', 'triton', 'xla'); None: `tokamax_implementation` of the default device. The bias
  is a constant (stop_gradient); its kernels' score gradient is written in TOKAMAX_DS_DTYPE."""
  import tokamax  # imported here: only this implementation needs it (and its import time)

  _absl_flags_parsed()
  if implementation is None:
    implementation = tokamax_implementation(Device.of(jax.devices()[0]))
  bias = None
  if alibi_slopes is not None:
    bias = jax.lax.stop_gradient(alibi_key_bias(alibi_slopes, k.shape[1]))
  # A one-op sequence: tokamax 0.0.15 and 0.0.17 (the GPU suite's) take an op object only there.
  return tokamax.dot_product_attention(
    q, k, v, bias=bias, is_causal=True, implementation=(tokamax_op(implementation),)
  )


@functools.cache
def tokamax_op(implementation: str) -> Any:
  """tokamax's op for `implementation` with its backward's ds in TOKAMAX_DS_DTYPE ('xla', whose
  backward is XLA's autodiff, as it is)."""
  if implementation == 'xla':
    return 'xla'
  from tokamax._src.ops.attention import api  # the registry dot_product_attention reads

  name = {'mosaic': 'mosaic_gpu', 'triton': 'triton'}[implementation]
  if name not in api.IMPLEMENTATIONS:
    raise ConfigError(
      f"tokamax's {implementation!r} attention did not import here; "
      "model.attention_impl='pallas' runs the Triton flash kernels instead"
    )
  op = api.IMPLEMENTATIONS[name]
  return op.replace(vjp=dataclasses.replace(op.vjp, dbias_intermediate_dtype=TOKAMAX_DS_DTYPE))


def _absl_flags_parsed() -> None:
  """tokamax reads its options from absl flags, and parses sys.argv for them when no one has:
  every t5x_like command line (argparse) would be refused as unknown flags. Unless a program
  parsed absl flags itself, they are marked parsed here, at their defaults."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


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


def device_if_known() -> Device | None:
  """This process's first device, without starting a backend (which would fix the CPU device
  count): None while it is not known."""
  if partitioning.backends_started():
    return Device.of(jax.devices()[0])
  return Device('cpu') if partitioning.cpu_only() else None
