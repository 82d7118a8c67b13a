"""losses.py: padding (losses.PAD_ID) after a sample's trained tokens changes nothing, in every
cross-entropy implementation and through the pipeline (what `curriculum.pad_to_multiple`
relies on)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from t5x_like.mesh import partitioning
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib
from t5x_like.parallel import pipeline
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import step as step_lib

TRAINED, PADDED = 9, 16  # tokens each row trains on, and the length the padded batch runs at


def padded(tokens: np.ndarray) -> np.ndarray:
  """The first TRAINED + 1 tokens of each row, then PAD_ID up to PADDED + 1."""
  out = np.full(tokens.shape[:-1] + (PADDED + 1,), losses.PAD_ID, np.int32)
  out[..., : TRAINED + 1] = tokens[..., : TRAINED + 1]
  return out


def random_tokens(cfg, shape) -> np.ndarray:
  return np.random.default_rng(1).integers(0, cfg.model.vocab_size, shape).astype(np.int32)


def test_split_tokens_reads_padding_as_token_0_with_weight_0():
  tokens = jnp.asarray([[5, 6, 7, losses.PAD_ID, losses.PAD_ID]])
  inputs, labels, weights = losses.split_tokens(tokens)
  assert inputs.tolist() == [[5, 6, 7, 0]]
  assert labels.tolist() == [[6, 7, 0, 0]]
  assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
  'impl, mesh', [('dense', (1, 1, 1)), ('chunked', (1, 1, 1)), ('fused', (2, 1, 2))]
)
def test_padding_changes_neither_the_loss_nor_the_gradients(impl, mesh):
  """'fused' on a (2, 1, 2) mesh: tokens over `data`, vocabulary over `tensor`, each token
  shard's share of the mean counting the targets of all of them."""
  cfg = small_config(
    model=dict(cross_entropy_impl=impl, cross_entropy_chunk=64),
    mesh=dict(data=mesh[0], tensor=mesh[2]),
  )
  layout = make_layout(cfg, partitioning.make_mesh(*mesh))
  params = layout.init(cfg.train.seed).params
  tokens = random_tokens(cfg, (4, PADDED + 1))
  value_and_grad = jax.jit(jax.value_and_grad(lambda p, t: losses.mean_loss(layout.model, p, t)))
  want_loss, want_grads = value_and_grad(params, jnp.asarray(tokens[:, : TRAINED + 1]))
  loss, grads = value_and_grad(params, jnp.asarray(padded(tokens)))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for path, got in jax.tree_util.tree_leaves_with_path(grads):
    want = dict(jax.tree_util.tree_leaves_with_path(want_grads))[path]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-8, err_msg=str(path))


def test_the_pipelined_loss_of_padded_micro_batches_is_the_loss_of_the_trained_tokens():
  """The pipeline schedule (2 stages, 4 micro-batches) has its own per-micro-batch head and loss:
  on a padded batch, the loss and gradients of the unpadded one. (The trainer's curriculum test
  checks the micro-batch accumulation without a pipeline, over whole runs.)"""
  cfg = small_config(
    model=dict(cross_entropy_impl='chunked', cross_entropy_chunk=64),
    mesh=dict(pipeline=2),
    train=dict(micro_batch_size=2),
  )
  layout = make_layout(cfg, partitioning.make_mesh(1, 2, 1))
  params = step_lib.gathered_params(layout.init(cfg.train.seed).params, layout)
  ctx = model_lib.Context(cfg.model, layout.mesh)
  value_and_grad = jax.jit(
    jax.value_and_grad(
      lambda p, batch: pipeline.pipeline_loss(
        p, batch, jax.random.PRNGKey(0), cfg=cfg, placement=layout.placement, ctx=ctx
      )
    )
  )
  tokens = random_tokens(cfg, (cfg.num_microbatches, cfg.train.micro_batch_size, PADDED + 1))
  want_loss, want_grads = value_and_grad(params, jnp.asarray(tokens[..., : TRAINED + 1]))
  loss, grads = value_and_grad(params, jnp.asarray(padded(tokens)))
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-8)
