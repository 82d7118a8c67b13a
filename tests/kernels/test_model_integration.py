"""model.attention_impl / model.cross_entropy_impl in the model and the train step, and their
fail-fast configuration rules."""

import functools
import os
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, run_steps, small_config
from jax._src.lib.mlir import ir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.config import ConfigError, ModelConfig, load_config_file
from t5x_like.kernels import flash_attention, mosaic_attention
from t5x_like.kernels.triton_lowering import TRITON_CALL_TARGET, lower_for_cuda
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import startup


def loss_and_grads(cfg: ModelConfig, tokens, params=None):
  model = model_lib.Transformer(cfg, padded_vocab=256)
  if params is None:
    params = nn.unbox(model.init(jax.random.PRNGKey(0), tokens[:, :8])['params'])
  fn = jax.jit(jax.value_and_grad(lambda p: losses.token_losses(model, p, tokens).mean()))
  return params, *fn(params)


def check_bf16_model_against_xla(impl: str, hidden_size: int, num_heads: int) -> None:
  """BLOOM's attention in bf16, one layer, no mesh: the loss and gradients with attention_impl
  `impl` against the xla model's, at the cuDNN tolerances (bf16 rounding of both)."""
  base = dict(
    num_layers=1,
    hidden_size=hidden_size,
    num_heads=num_heads,
    vocab_size=200,
    init_std=0.02,
    dtype='bfloat16',
  )
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, 200)
  params, xla_loss, xla_grads = loss_and_grads(ModelConfig(**base, attention_impl='xla'), tokens)
  _, loss, grads = loss_and_grads(ModelConfig(**base, attention_impl=impl), tokens, params)
  np.testing.assert_allclose(loss, xla_loss, rtol=1e-2)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(xla_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= 5e-2 * np.abs(want).max()


def refused_here(head_dim: int, dtype: str) -> bool:
  """Whether this device refuses tokamax for head_dim / dtype (on a GPU: its Mosaic kernels on
  Hopper multiply bf16 only); if so, checks the refusal is the ConfigError naming it."""
  device = attention_lib.Device.of(jax.devices()[0])
  cfg = ModelConfig(hidden_size=head_dim * 2, num_heads=2, dtype=dtype, attention_impl='tokamax')
  if not attention_lib.unmet_constraints(
    'tokamax',
    head_dim=head_dim,
    dtype=dtype,
    platform=device.platform,
    compute_capability=device.compute_capability,
  ):
    return False
  with pytest.raises(ConfigError, match="model.attention_impl='tokamax' cannot run this model"):
    attention_lib.choose(cfg, device)
  return True


NO_MESH_MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=200, init_std=0.02)


@functools.cache
def no_mesh_xla_run():
  """(tokens, params, loss, grads) of the xla model: what the fused ones must reproduce."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 21), 0, 200)
  return tokens, *loss_and_grads(ModelConfig(**NO_MESH_MODEL, attention_impl='xla'), tokens)


@pytest.mark.parametrize('impl', ['pallas', 'tokamax'])
def test_fused_attention_gives_the_xla_loss_and_gradients(impl):
  """No mesh; seq 20 is not a multiple of the Pallas kernel's 32-row tiles (the tail is
  masked)."""
  if impl == 'tokamax' and refused_here(NO_MESH_MODEL['hidden_size'] // 4, 'float32'):
    return  # tokamax's Hopper kernels run bf16 only: test_tokamax_attention.py's bf16 model
  tokens, params, xla_loss, xla_grads = no_mesh_xla_run()
  _, loss, grads = loss_and_grads(ModelConfig(**NO_MESH_MODEL, attention_impl=impl), tokens, params)
  np.testing.assert_allclose(loss, xla_loss, rtol=1e-6)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads, xla_grads
  )


def shortened_tiny():
  """configs/tiny.py's model (8 heads of 32, vocab 8192) on its data=2 x tensor=2 mesh, shortened
  to 2 layers and 32 tokens: the kernels run per shard (4 heads, 4096 vocabulary rows each)."""
  overrides = {
    'model.num_layers': 2,
    'train.seq_len': 32,
    'train.global_batch_size': 4,
    'train.micro_batch_size': 1,
    'train.steps': 2,
    'optimizer.warmup_samples': 0,
  }
  return load_config_file(os.path.join(REPO, 'configs', 'tiny.py'), overrides)


@functools.cache
def tiny_reference_run():
  """xla attention + dense cross-entropy: what every other implementation must reproduce."""
  return run_steps(
    startup.check_config(
      shortened_tiny().replace(model={'attention_impl': 'xla', 'cross_entropy_impl': 'dense'})
    ),
    num_steps=2,
  )


@pytest.mark.parametrize(
  'model',
  [
    pytest.param(
      {'attention_impl': 'pallas', 'cross_entropy_impl': 'chunked', 'cross_entropy_chunk': 1024},
      id='pallas-attention-chunked-ce',
    ),
    # tokamax's XLA implementation on CPU, per (data, tensor) shard with its heads' slopes.
    pytest.param({'attention_impl': 'tokamax'}, id='tokamax-attention'),
    # 16 tokens per chunk: each data shard's 32 tokens take two chunks.
    pytest.param({'cross_entropy_impl': 'fused', 'cross_entropy_chunk': 16}, id='fused-ce'),
  ],
)
def test_tiny_config_trains_the_same_as_xla_attention_and_dense_cross_entropy(model):
  ref_losses, ref_norms, ref_params = tiny_reference_run()
  losses_, norms, params = run_steps(
    startup.check_config(shortened_tiny().replace(model=model)), num_steps=2
  )
  assert losses_[-1] < losses_[0]
  np.testing.assert_allclose(losses_, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
  # Adam divides by sqrt(v): for near-zero gradients fp32 reduction-order noise moves a weight by
  # up to a few percent of the learning rate (2e-3 here).
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4), params, ref_params
  )


def loss_temp_bytes(cfg) -> int:
  """Scratch memory of the sharded loss and its gradients (compiled, not run)."""
  mesh = partitioning.make_mesh(cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor)
  layout = make_layout(cfg, mesh)
  tokens_sharding = NamedSharding(mesh, P('data', None))
  loss = jax.jit(
    jax.value_and_grad(
      lambda params, tokens: losses.token_losses(layout.model, params, tokens).mean()
    ),
    in_shardings=(layout.compute_param_shardings, tokens_sharding),
  )
  tokens = jax.ShapeDtypeStruct(
    (cfg.mesh.data, cfg.train.seq_len + 1), jnp.int32, sharding=tokens_sharding
  )
  compiled = loss.lower(layout.abstract.params, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_cross_entropy_removes_the_fp32_logits_from_the_loss():
  """On a tensor=2 mesh each device has 128 tokens x 8192 vocabulary rows: 4 MiB of fp32 logits
  (and as much again for their gradient) that the chunked loss never allocates."""
  cfg = small_config(
    model=dict(num_layers=1, num_heads=4, vocab_size=16384),
    train=dict(seq_len=128, global_batch_size=1),
    mesh=dict(tensor=2),
  )
  dense = loss_temp_bytes(cfg)
  chunked = loss_temp_bytes(
    cfg.replace(model={'cross_entropy_impl': 'chunked', 'cross_entropy_chunk': 1024})
  )
  logits_bytes = 128 * (16384 // 2) * 4
  assert dense - chunked >= logits_bytes, (dense, chunked)


# ------------------------------------------------------------------------------ fail fast


def test_pallas_with_an_unsupported_head_dim_is_a_config_error_naming_the_constraint():
  cfg = small_config(model=dict(attention_impl='pallas'))  # hidden 64 / 8 heads: head_dim 8
  with pytest.raises(ConfigError, match=r"attention_impl='pallas'.*head_dim must be one of"):
    startup.check_config(cfg)


def test_fallback_warns_and_runs_xla():
  cfg = ModelConfig(
    num_layers=1,
    hidden_size=48,
    num_heads=6,
    vocab_size=200,
    init_std=0.02,
    attention_impl='pallas',
    attention_fallback=True,
  )  # head_dim 8
  startup.check_config(small_config(model=dict(attention_impl='pallas', attention_fallback=True)))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (1, 9), 0, 200)
  xla = model_lib.Transformer(ModelConfig(**{**cfg.__dict__, 'attention_impl': 'xla'}), 256)
  # The traced programs are compared: the fallback must be exactly the xla model.
  with warnings.catch_warnings():
    warnings.simplefilter('error')
    params = jax.eval_shape(xla.init, jax.random.PRNGKey(0), tokens)
    want = str(jax.make_jaxpr(xla.apply)(params, tokens))
  with pytest.warns(
    RuntimeWarning,
    match=r'head_dim must be one of.*running '
    r"model.attention_impl='xla' instead",
  ):
    got = str(jax.make_jaxpr(model_lib.Transformer(cfg, 256).apply)(params, tokens))
  assert got == want and 'pallas_call' not in got


def test_cudnn_attention_runs_on_a_gpu_only():
  """On CPU the config is refused (or falls back); on a GPU (the GPU suite) the bf16 model's loss
  and gradients through cuDNN match the xla path's."""
  cfg = small_config(model=dict(attention_impl='cudnn', num_heads=4, dtype='bfloat16'))
  if jax.default_backend() != 'gpu':
    with pytest.raises(ConfigError, match='cuDNN attention needs a GPU'):
      startup.check_config(cfg)
    startup.check_config(small_config(model=dict(attention_impl='cudnn', attention_fallback=True)))
    return
  startup.check_config(cfg)
  base = dict(
    num_layers=2, hidden_size=256, num_heads=4, vocab_size=200, init_std=0.02, dtype='bfloat16'
  )
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 65), 0, 200)
  params, xla_loss, xla_grads = loss_and_grads(ModelConfig(**base), tokens)
  _, loss, grads = loss_and_grads(ModelConfig(**base, attention_impl='cudnn'), tokens, params)
  np.testing.assert_allclose(loss, xla_loss, rtol=1e-2)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(xla_grads)):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(got - want).max() <= 5e-2 * np.abs(want).max()


def live_gpu_kernels(operation) -> list[str]:
  """The Triton (by name) and Mosaic GPU kernels of a module lowered for CUDA whose results
  something reads. A kernel nothing reads is dead code that XLA drops (neither custom call has
  side effects): jax's rematerialisation leaves a pallas_call it no longer needs in place."""
  found = []
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        op = op.operation
        if op.name == 'stablehlo.custom_call' and any(list(r.uses) for r in op.results):
          target = ir.StringAttr(op.attributes['call_target_name']).value
          if target == TRITON_CALL_TARGET:
            config = ir.DictAttr(op.attributes['mhlo.backend_config'])
            found.append(ir.StringAttr(config['name']).value)
          elif target.startswith('mosaic_gpu'):
            found.append(target)
        found += live_gpu_kernels(op)
  return found


def kernels_lowered_for_cuda(impl: str, remat_policy: str) -> list[str]:
  """The live GPU kernels of one layer's attention (a saved matmul in, the kernel, a matmul out)
  under the model's `remat_policy`, its loss and gradients lowered for CUDA."""
  kernel = mosaic_attention if impl == 'mosaic' else flash_attention
  policy = model_lib.remat_policy(remat_policy)

  def layer(w, x):
    q = jnp.einsum('bshd,de->bshe', x, w).astype(jnp.bfloat16)
    out = kernel(q, q, q, alibi_slopes=np.array([0.5, 0.25], np.float32))
    return jnp.einsum('bshd,de->bshe', out.astype(jnp.float32), w).sum()

  x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
  w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  module = lower_for_cuda(jax.value_and_grad(jax.checkpoint(layer, policy=policy)), w, x)
  return live_gpu_kernels(module.operation)


def test_save_dots_keeps_our_kernels_residuals_so_the_backward_runs_no_second_forward():
  """remat_policy='save_dots' keeps our kernels' output and log-sum-exp (named in their forward):
  the step runs the forward kernel once, then the two backward kernels. Under 'full' the backward
  runs the forward again, which this count sees."""
  assert kernels_lowered_for_cuda('pallas', 'save_dots') == [
    'flash_attention_forward',
    'flash_attention_dkdv',
    'flash_attention_dq',
  ]
  assert kernels_lowered_for_cuda('pallas', 'full').count('flash_attention_forward') == 2
  # Forward, dQ, dK/dV; under 'full' the forward twice.
  assert len(kernels_lowered_for_cuda('mosaic', 'save_dots')) == 3
  assert len(kernels_lowered_for_cuda('mosaic', 'full')) == 4


def test_fused_attention_has_no_dropout():
  cfg = small_config(model=dict(attention_impl='pallas', num_heads=4, attention_dropout=0.1))
  with pytest.raises(ConfigError, match='attention_dropout=0.1 needs model.attention_impl'):
    startup.check_config(cfg)


def test_unknown_implementations_are_rejected():
  with pytest.raises(
    ConfigError,
    match="attention_impl must be 'auto', 'xla', 'pallas', 'cudnn', 'tokamax' or 'mosaic'",
  ):
    startup.check_config(small_config(model=dict(attention_impl='triton')))
  with pytest.raises(ConfigError, match="cross_entropy_impl must be 'dense', 'chunked' or 'fused'"):
    startup.check_config(small_config(model=dict(cross_entropy_impl='sparse')))


def test_fused_cross_entropy_is_refused_with_a_gpipe_pipeline_only():
  """GPipe runs every forward before the backwards, so the fused loss's embedding-sized
  gradient would be kept for each micro-batch; 1F1B uses it in the same tick (tested against
  one device in tests/test_pipeline.py)."""
  cfg = small_config(
    model=dict(cross_entropy_impl='fused'),
    mesh=dict(pipeline=2),
    train=dict(global_batch_size=4, micro_batch_size=1),
  )
  with pytest.raises(
    ConfigError, match=r"cross_entropy_impl='fused'.*use pipeline.schedule='1f1b'.*or 'chunked'"
  ):
    startup.check_config(cfg)
  startup.check_config(cfg.replace(pipeline={'schedule': '1f1b'}))
