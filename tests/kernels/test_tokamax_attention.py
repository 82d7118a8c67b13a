"""model.attention_impl='tokamax' (tokamax.dot_product_attention with ALiBi as a float32
[1, heads, 1, seq] bias) and 'auto' (AUTO_ORDER, resolved per device).

On CPU the wrapper runs tokamax's XLA implementation: the bias, its dtype, the layout and the
per-shard slopes are what is tested; its GPU kernels are lowered for CUDA here (not run) to check
what they receive. The model's loss and train steps with 'tokamax' are in
test_model_integration.py, beside the other implementations'.
"""

import dataclasses
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from test_flash_attention import TOLERANCE, assert_close, inputs
from test_model_integration import check_bf16_model_against_xla, refused_here

from t5x_like import config as config_lib
from t5x_like.config import ConfigError, ModelConfig
from t5x_like.kernels import attention_reference
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib
from t5x_like.model.attention import AUTO_ORDER, Device
from t5x_like.model.transformer import alibi_slopes
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import startup

H100 = Device('gpu', 'NVIDIA H100 80GB HBM3', '9.0')
H200 = Device('gpu', 'NVIDIA H200', '9.0')
A100 = Device('gpu', 'NVIDIA A100-SXM4-80GB', '8.0')
CPU = Device('cpu', 'cpu')
# The tokamax implementation that runs here: the GPU suite runs this file on a GPU.
IMPL = attention_lib.tokamax_implementation(Device.of(jax.devices()[0]))
# BLOOM-176B's first head: 2 ** (-8 / 112).
LARGE_SLOPE = 0.952


def out_and_grads(fn, q, k, v, do):
  out, vjp = jax.vjp(fn, q, k, v)
  return (out, *vjp(do.astype(out.dtype)))


def check_against_reference(fn, q, k, v, do, slopes, tolerance):
  """fn's output and dq, dk, dv against attention_reference in fp32 (max error / max reference)."""
  got = jax.jit(lambda q, k, v: out_and_grads(fn, q, k, v, do))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  reference = lambda q, k, v: attention_reference(q, k, v, alibi_slopes=slopes, causal=True)
  want = jax.jit(lambda q, k, v: out_and_grads(reference, q, k, v, do))(f32(q), f32(k), f32(v))
  for name, a, b in zip(('out', 'dq', 'dk', 'dv'), got, want):
    assert a.dtype == q.dtype, name
    assert_close(a, b, tolerance, name)


@pytest.mark.parametrize(
  'batch, seq, heads, head_dim, alibi, dtype',
  [
    pytest.param(2, 50, 3, 64, True, 'float32', id='3-heads-tail'),
    pytest.param(1, 40, 4, 16, False, 'float32', id='no-alibi'),
    pytest.param(1, 64, 2, 128, True, 'bfloat16', id='bf16-d128'),
    pytest.param(2, 37, 5, 64, True, 'bfloat16', id='bf16-5-heads-tail'),
  ],
)
def test_forward_and_gradients_match_the_reference(batch, seq, heads, head_dim, alibi, dtype):
  if refused_here(head_dim, dtype):
    return
  q, k, v, do, _ = inputs(batch, seq, heads, head_dim, jnp.dtype(dtype), segments=False)
  slopes = alibi_slopes(heads) if alibi else None
  fn = lambda q, k, v: attention_lib.tokamax_attention(q, k, v, alibi_slopes=slopes)
  check_against_reference(fn, q, k, v, do, slopes, TOLERANCE[dtype])


def long_bf16_inputs():
  """seq 1024, bf16, slopes up to BLOOM-176B's largest: slope * key reaches 974 (bf16 spacing 4
  from 512 on)."""
  q, k, v, do, _ = inputs(1, 1024, 2, 16, jnp.bfloat16, segments=False, seed=3)
  return q, k, v, do, np.array([LARGE_SLOPE, 0.5], np.float32)


def test_a_float32_bias_keeps_long_sequences_within_the_bf16_tolerance():
  q, k, v, do, slopes = long_bf16_inputs()
  fn = lambda q, k, v: attention_lib.tokamax_attention(q, k, v, alibi_slopes=slopes)
  check_against_reference(fn, q, k, v, do, slopes, TOLERANCE['bfloat16'])


def test_a_bf16_bias_breaks_the_tolerance_at_long_sequences():
  """Why the bias is float32: the same keys-only bias rounded to bf16 moves scores near the
  diagonal by up to 2 at these positions."""
  q, k, v, _, slopes = long_bf16_inputs()
  bias = attention_lib.alibi_key_bias(slopes, 1024)
  assert bias.dtype == jnp.float32 and bias.shape == (1, 2, 1, 1024)
  rounded = bias.astype(jnp.bfloat16)
  assert float(jnp.abs(rounded.astype(jnp.float32) - bias).max()) == 2.0
  import tokamax

  attend = lambda bias: tokamax.dot_product_attention(
    q, k, v, bias=bias, is_causal=True, implementation=IMPL
  )
  want = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), alibi_slopes=slopes)
  error = lambda out: float(jnp.abs(out.astype(jnp.float32) - want).max() / jnp.abs(want).max())
  assert error(attend(bias)) <= TOLERANCE['bfloat16']
  assert error(attend(rounded)) > 4 * TOLERANCE['bfloat16'], error(attend(rounded))


def test_every_shard_gets_its_heads_slopes_on_a_tensor_parallel_mesh():
  """data 2 x tensor 2 (4 devices: the CPU suite's): each shard's kernel call gets its own 2
  heads' slopes."""
  mesh = partitioning.make_mesh(2, 1, 2)
  q, k, v, do, _ = inputs(2, 24, 4, 16, jnp.float32, segments=False)
  slopes = alibi_slopes(4)
  cfg = ModelConfig(hidden_size=64, num_heads=4, attention_impl='tokamax')
  fn = lambda q, k, v: attention_lib.attention(q, k, v, cfg=cfg, mesh=mesh, alibi_slopes=slopes)
  check_against_reference(fn, q, k, v, do, slopes, TOLERANCE['float32'])


def test_the_bf16_model_through_tokamax_matches_xla():
  """BLOOM's attention in bf16, no mesh: the loss and gradients through tokamax (its GPU kernels
  in the GPU suite, its XLA implementation on CPU) against the xla model's, at
  test_model_integration's cuDNN tolerances."""
  check_bf16_model_against_xla('tokamax', hidden_size=64, num_heads=4)


# ---------------------------------------------------------- tokamax's GPU kernels, lowered here


@dataclasses.dataclass(frozen=True)
class FakeGpu:
  """What tokamax reads of the default device to pick its kernels."""

  platform: str
  device_kind: str
  compute_capability: str | None


LOWERING_WARNINGS = pytest.mark.filterwarnings('ignore::DeprecationWarning')  # tokamax's


def lowered_kernel_calls(implementation: str, device: Device):
  """(call target, operand types, result types) of each kernel that the loss gradient of
  tokamax_attention launches, lowered for CUDA on this machine as on `device` (bf16 q, k, v of
  seq 200, 2 heads of 64)."""
  from tokamax._src import config as tokamax_config
  from tokamax._src import gpu_utils

  x = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
  slopes = np.array([LARGE_SLOPE, 0.5], np.float32)

  def loss(q, k, v):
    out = attention_lib.tokamax_attention(
      q, k, v, alibi_slopes=slopes, implementation=implementation
    )
    return out.astype(jnp.float32).sum()

  # tokamax picks its kernels by the default device's compute capability: that of `device`.
  gpu = FakeGpu('gpu', device.kind, device.compute_capability)
  with (
    mock.patch.object(gpu_utils.backend, 'get_default_device', lambda: gpu),
    tokamax_config.cross_compile(True),
  ):
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grads.trace(x, x, x).lower(lowering_platforms=('cuda',)).as_text()
  calls = re.findall(r'custom_call @(\S+)\(.*: \((.*)\) -> \((.*)\)', text)
  return [
    (target, operands.split(', '), results.split(', ')) for target, operands, results in calls
  ]


@LOWERING_WARNINGS
def test_hopper_runs_tokamax_mosaic_kernels_with_the_float32_bias():
  """Forward, dq (+ ds) and dk/dv: three Mosaic GPU kernels, each given the [heads, 1, seq]
  float32 bias (never a bf16 copy), and ds written in bf16 (TOKAMAX_DS_DTYPE), not float32."""
  calls = lowered_kernel_calls(attention_lib.tokamax_implementation(H100), H100)
  assert [target for target, _, _ in calls] == ['mosaic_gpu_v2'] * 3
  for _, operands, _ in calls:
    # The broadcast bias, [heads, 1, seq]; tokamax >= 0.0.15 also passes [1, 1] int32 scalars.
    assert sum(bool(re.fullmatch(r'tensor<\d+x1x\d+x\w+>', o)) for o in operands) == 1
    assert any(re.fullmatch(r'tensor<2x1x\d+xf32>', o) for o in operands), operands
    assert not any(re.fullmatch(r'tensor<2x1x\d+xbf16>', o) for o in operands), operands
  dq_and_ds = calls[1][2]
  assert dq_and_ds[0] == 'tensor<200x2x64xbf16>'
  assert re.fullmatch(r'tensor<2x(\d+)x(\d+)xbf16>', dq_and_ds[1]), dq_and_ds  # ds, padded


@LOWERING_WARNINGS
def test_ampere_runs_tokamax_triton_kernels_with_the_float32_bias():
  calls = lowered_kernel_calls(attention_lib.tokamax_implementation(A100), A100)
  assert [target for target, _, _ in calls] == ['__gpu$xla.gpu.triton'] * 2
  for _, operands, _ in calls:
    assert 'tensor<2x1x200xf32>' in operands, operands
  assert calls[1][2][-1] == 'tensor<2x200x200xbf16>'  # ds


def test_the_private_tokamax_parts_used_are_there():
  """tokamax_attention reads tokamax's op registry and its VJPs' dbias_intermediate_dtype: a
  tokamax that renamed them fails here, not on the GPU."""
  for implementation in ('mosaic', 'triton'):
    op = attention_lib.tokamax_op(implementation)
    assert op.vjp.dbias_intermediate_dtype == attention_lib.TOKAMAX_DS_DTYPE
  assert attention_lib.tokamax_op('xla') == 'xla'


# ------------------------------------------------------------------------------------- auto


def model(**overrides) -> ModelConfig:
  """BLOOM-1B3's attention (16 heads of 128, bf16) unless overridden."""
  return ModelConfig(**{'hidden_size': 2048, 'num_heads': 16, 'dtype': 'bfloat16', **overrides})


@pytest.mark.parametrize(
  'device, cfg, want',
  [
    pytest.param(H100, model(), 'mosaic', id='h100'),
    pytest.param(H200, model(), 'mosaic', id='h200'),
    pytest.param(A100, model(), 'pallas', id='a100'),
    pytest.param(CPU, model(), 'xla', id='cpu'),
    pytest.param(Device('tpu', 'TPU v5 lite'), model(), 'xla', id='tpu-not-measured'),
    pytest.param(Device('gpu', 'NVIDIA B200', '10.0'), model(), 'xla', id='b200-not-measured'),
    # head_dim 80 (BLOOM-3B): no Mosaic or Pallas tiles; tokamax's on Hopper, none on Ampere.
    pytest.param(H100, model(hidden_size=2560, num_heads=32), 'tokamax', id='h100-head-dim-80'),
    pytest.param(A100, model(hidden_size=2560, num_heads=32), 'xla', id='a100-head-dim-80'),
    # head_dim 256: beyond Mosaic's wgmma tiles (64, 128); Pallas has them.
    pytest.param(H100, model(num_heads=8), 'pallas', id='h100-head-dim-256'),
    # head_dim 192: no Mosaic or Pallas tiles; tokamax, the next candidate, runs it.
    pytest.param(H100, model(hidden_size=1920, num_heads=10), 'tokamax', id='h100-head-dim-192'),
    pytest.param(
      H100, model(hidden_size=1920, num_heads=10, dtype='float32'), 'xla', id='h100-192-fp32'
    ),
    pytest.param(H100, model(attention_dropout=0.1), 'xla', id='h100-dropout'),
  ],
)
def test_auto_picks_the_first_runnable_implementation_of_the_device_row(device, cfg, want):
  cfg = ModelConfig(**{**cfg.__dict__, 'attention_impl': 'auto'})
  impl, why = attention_lib.choose(cfg, device)
  assert impl == want, why
  if cfg.attention_dropout > 0:
    assert 'only xla has attention dropout' in why
    return
  order, _ = AUTO_ORDER.get(device.family, (('xla',), ''))
  assert impl == next(
    c
    for c in order
    if not attention_lib.unmet_constraints(
      c,
      head_dim=cfg.head_dim,
      dtype=cfg.dtype,
      platform=device.platform,
      compute_capability=device.compute_capability,
    )
  )
  assert f"{device.family}'s {' > '.join(order)}" in why


def test_the_auto_table():
  assert {H100.family, H200.family, A100.family, CPU.family} == {'hopper', 'ampere', 'cpu'}
  assert Device('gpu', 'NVIDIA L4', '8.9').family == 'ampere'
  for family, (order, measured) in AUTO_ORDER.items():
    assert order[-1] == 'xla' and set(order) <= set(attention_lib.IMPLEMENTATIONS), family
    assert measured, family
  assert AUTO_ORDER['hopper'][0][:2] == ('mosaic', 'pallas')  # docs/benchmarks.md, H100
  assert AUTO_ORDER['cpu'][0] == ('xla',)
  assert config_lib.allowed_values('model.attention_impl') == attention_lib.CHOICES
  assert ModelConfig().attention_impl == 'auto'


def test_auto_runs_xla_on_cpu_and_the_log_says_why():
  cfg = small_config()
  assert cfg.model.attention_impl == 'auto'
  startup.check_config(cfg)
  assert attention_lib.resolve_impl(cfg.model, CPU) == 'xla'
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  lines = startup.report_lines(cfg, layout, {}, 1, 'cpu', CPU)
  assert lines[2] == (
    "> attention: model.attention_impl='auto' runs 'xla' on cpu: the first that runs this model "
    f"of cpu's xla ({AUTO_ORDER['cpu'][1]})"
  )
  hopper = startup.report_lines(
    cfg.replace(model={'dtype': 'bfloat16', 'num_heads': 4}), layout, {}, 8, 'gpu', H100
  )[2]
  assert hopper.startswith(
    "> attention: model.attention_impl='auto' runs 'pallas' on gpu (NVIDIA H100 80GB HBM3, "
    "compute capability 9.0): the first that runs this model of hopper's mosaic > pallas > "
  )
  assert hopper.endswith(
    '; skipped mosaic (head_dim must be one of (64, 128) (wgmma tiles), got 16)'
  )
  fixed = startup.report_lines(
    cfg.replace(model={'attention_impl': 'tokamax'}), layout, {}, 1, 'cpu'
  )
  assert fixed[2] == "> attention: model.attention_impl='tokamax' on cpu"


def test_auto_with_attention_dropout_is_a_valid_config_that_runs_xla():
  cfg = startup.check_config(small_config(model=dict(attention_dropout=0.1)))
  assert attention_lib.choose(cfg.model, H100) == (
    'xla',
    'model.attention_dropout=0.1: only xla has attention dropout',
  )
  with pytest.raises(ConfigError, match=r"needs model.attention_impl='xla' \(or 'auto'"):
    startup.check_config(small_config(model=dict(attention_dropout=0.1, attention_impl='tokamax')))


def test_planner_and_generate_count_what_auto_runs(monkeypatch):
  from t5x_like.cli import generate
  from t5x_like.planning import cost_model

  cfg = small_config()  # fp32, head_dim 8: auto plans xla on a GPU (Pallas needs 16+)
  assert cost_model.score_traffic_bytes(cfg) == (8.0, 14.0)
  fused = cfg.replace(model={'hidden_size': 256})  # head_dim 32: Pallas
  assert cost_model.score_traffic_bytes(fused) == (0.0, 0.0)
  monkeypatch.setattr(attention_lib, 'device_if_known', lambda: CPU)
  assert generate.largest_array(cfg.model, 64, 1)[1].startswith('attention scores')  # xla
  monkeypatch.setattr(attention_lib, 'device_if_known', lambda: H100)
  assert generate.largest_array(fused.model, 64, 1)[1].startswith('the MLP')  # pallas


# -------------------------------------------------------------------------- fail fast


@pytest.mark.parametrize(
  'device, overrides, constraint',
  [
    (Device('tpu', 'TPU v5 lite'), {}, 'tokamax attention is wired here for GPUs'),
    (H100, {'dtype': 'float32'}, "tokamax's Mosaic GPU attention .* bfloat16 or float16 only"),
    (H100, {'hidden_size': 1024, 'num_heads': 2}, r'tested up to head_dim 256 \(.*\), got 512'),
    (None, {'hidden_size': 1024, 'num_heads': 2}, r'tested up to head_dim 256 \(.*\), got 512'),
    (Device('gpu', 'Tesla V100', '7.0'), {}, 'compute capability >= 8.0'),
  ],
)
def test_tokamax_constraints_are_config_errors_naming_the_fix(device, overrides, constraint):
  cfg = model(attention_impl='tokamax', **overrides)
  with pytest.raises(
    ConfigError,
    match=rf"model.attention_impl='tokamax' cannot run this model: .*{constraint}.*Use "
    r"model.attention_impl='auto' \(the fastest implementation that runs here\) or 'xla'",
  ):
    attention_lib.choose(cfg, device)
  fallback = ModelConfig(**{**cfg.__dict__, 'attention_fallback': True})
  impl, why = attention_lib.choose(fallback, device)
  assert impl == 'xla' and "running model.attention_impl='xla' instead" in why


def test_tokamax_runs_any_head_dim_and_dtype_on_cpu_and_bf16_on_hopper():
  for cfg in (model(attention_impl='tokamax', dtype='float32'), model(attention_impl='tokamax')):
    assert attention_lib.choose(cfg, CPU)[0] == 'tokamax'
  assert attention_lib.choose(model(attention_impl='tokamax'), H100)[0] == 'tokamax'
  assert attention_lib.tokamax_implementation(CPU) == 'xla'
  assert attention_lib.tokamax_implementation(H100) == 'mosaic'
  assert attention_lib.tokamax_implementation(A100) == 'triton'
  with pytest.raises(ConfigError, match='compute capability >= 8.0'):
    attention_lib.tokamax_implementation(Device('gpu', 'Tesla V100', '7.0'))
