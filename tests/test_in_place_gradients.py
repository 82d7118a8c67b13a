"""The no-pipeline micro-batch loop that adds each micro-batch's gradients into the fp32
accumulator in place (training/step.py's `add_microbatch_grads`), where the loop holds its whole
gradient: one data rank, or each rank under grad_sync 'step'."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from t5x_like.config import ConfigError
from t5x_like.mesh import partitioning
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import step as step_lib


@pytest.mark.parametrize(
  'architecture, cross_entropy_impl, remat_policy, unroll_layers',
  [
    ('bloom', 'chunked', 'save_dots', False),
    ('bloom', 'dense', 'none', False),
    ('bloom', 'fused', 'full', False),
    ('gpt2', 'chunked', 'none', False),
    ('bloom', 'fused', 'save_dots', True),  # configs/bloom_1b3.py's
  ],
)
def test_adding_in_place_gives_the_accumulator_plus_the_flax_models_gradients(
  architecture, cross_entropy_impl, remat_policy, unroll_layers
):
  """The accumulator plus `scale` x the gradient of the Flax model's mean loss, for every
  parameter: the layers' (added by the layer scan's transpose), the token table's (its use by
  the head, and the looked-up rows scattered in, a token's repeats each adding its row), the
  LayerNorms' and GPT-2's positions'; the loss is the Flax model's, times `scale`."""
  cfg = small_config(
    model=dict(
      architecture=architecture,
      cross_entropy_impl=cross_entropy_impl,
      remat_policy=remat_policy,
      unroll_layers=unroll_layers,
      cross_entropy_chunk=16,
    )
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  params = layout.init(cfg.train.seed).params
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 20, (2, cfg.train.seq_len + 1)).astype(np.int32)  # repeated tokens
  tokens[1, -4:] = losses.PAD_ID
  accumulator = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
  scale = 0.75

  loss, grads = jax.jit(
    lambda params, accumulator: step_lib.add_microbatch_grads(
      model_lib.Context(cfg.model, None),
      params,
      accumulator,
      jnp.asarray(tokens),
      jax.random.PRNGKey(0),
      deterministic=True,
      scale=scale,
    )
  )(params, accumulator)

  expected_loss, expected_grads = jax.value_and_grad(
    lambda p: scale * losses.mean_loss(layout.model, p, jnp.asarray(tokens))
  )(params)
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
  assert set(grads) == set(params)
  jax.tree.map(
    lambda got, acc, g: np.testing.assert_allclose(got, acc + g, rtol=1e-5, atol=1e-6),
    grads,
    accumulator,
    expected_grads,
  )


def loop_carried_shapes(hlo: str) -> list[list[str]]:
  """For each while loop of the compiled HLO text, the array shapes its tuple carries
  ('bf16[2,64,256]', ...)."""
  loops = []
  for line in hlo.splitlines():
    found = re.search(r'= \((.*)\) while\(', line)
    if found:
      loops.append(re.findall(r'([a-z]+\d+\[[\d,]*\])', found.group(1)))
  return loops


@pytest.mark.parametrize('remat_policy', ['none', 'save_dots'])
def test_the_layers_backward_adds_into_the_fp32_accumulator_and_stacks_no_gradient(
  remat_policy,
):
  """XLA's H100 compile of a small bf16 step on one GPU: the loop of the layers' backward
  carries the fp32 accumulator of the stacked MLP kernel [layers, hidden, ffn] and adds each
  layer's gradient into it; no loop carries a compute-dtype stack of that shape beside the
  compute copy (the Flax model's backward returned the layers' gradient stacked in bf16, and
  under remat_policy 'none' a forward that saved each layer's weights stacked a copy of them)."""
  from t5x_like.planning import gpu_target

  cfg = small_config(
    model=dict(dtype='bfloat16', num_layers=2, attention_impl='xla', remat_policy=remat_policy),
    train=dict(global_batch_size=8, micro_batch_size=4),
  ).validate()
  gpus = gpu_target.devices('h100-80gb', 1)
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1, gpus))
  lowered = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches)
  hlo = gpu_target.compile_without_cache(lowered, 'h100-80gb')[0].as_text()
  m = cfg.model
  stacked_mlp = f'[{m.num_layers},{m.hidden_size},{m.ffn_size}]'
  table = f'f32[{cfg.padded_vocab_size},{m.hidden_size}]'
  loops = loop_carried_shapes(hlo)
  # The micro-batch loop carries every accumulator (the token table's among them); the layers'
  # backward, inside it, only the layers'.
  layers_backward = [
    shapes for shapes in loops if f'f32{stacked_mlp}' in shapes and table not in shapes
  ]
  assert layers_backward, loops
  for shapes in loops:
    assert shapes.count(f'bf16{stacked_mlp}') <= 1, shapes


def test_mosaic_emulation_on_cpu_traces_without_a_checkpoint():
  """On CPU model.attention_impl='mosaic' runs in Mosaic GPU's interpret mode, whose ordered
  callbacks jax.checkpoint cannot hold ('Effects not supported in partial-eval'), so it runs
  only under remat_policy='none': there the in-place loop leaves its layers unchecked, and the
  step traces and lowers."""
  from t5x_like.training import startup

  cfg = small_config(
    model=dict(
      num_layers=2,
      hidden_size=256,
      num_heads=2,
      dtype='bfloat16',
      attention_impl='mosaic',
      remat_policy='none',
    ),
    train=dict(global_batch_size=2, seq_len=128),
  ).validate()
  with pytest.raises(
    ConfigError, match="rematerialisation cannot replay: model.remat_policy='full'"
  ):
    startup.check_config(cfg.replace(model={'remat_policy': 'full'}))
  cfg = startup.check_config(cfg)
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  assert step_lib.holds_whole_gradient(layout, step_lib.own_gradient_axes(cfg, layout))
  lowered = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches)
  assert 'xla_ffi_python_cpu_callback' in lowered.as_text()  # the interpreted kernels
