"""Chunked, vocabulary-parallel cross-entropy against the dense logits + model.cross_entropy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from t5x_like.kernels import vocab_parallel_cross_entropy
from t5x_like.kernels.cross_entropy import fused_cross_entropy_mean, pick_chunk
from t5x_like.model.losses import cross_entropy

PADDED_VOCAB, VOCAB, WIDTH = 512, 450, 16


def problem(dtype=jnp.float32, vocab=PADDED_VOCAB, real_vocab=VOCAB, tokens=(2, 12), width=WIDTH):
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  hidden = jax.random.normal(keys[0], (*tokens, width)).astype(dtype)
  embedding = (jax.random.normal(keys[1], (vocab, width)) * 0.5).astype(dtype)
  labels = jax.random.randint(keys[2], tokens, 0, real_vocab)
  return hidden, embedding, labels


def dense_losses(hidden, embedding, labels, real_vocab=VOCAB):
  """What the model's 'dense' path computes: full fp32 logits, padded rows masked."""
  logits = jnp.einsum('...e,ve->...v', hidden, embedding, preferred_element_type=jnp.float32)
  logits = jnp.where(
    jnp.arange(embedding.shape[0]) < real_vocab, logits, jnp.finfo(jnp.float32).min
  )
  return cross_entropy(logits, labels)


def assert_mean_matches_dense(mean_loss_fn, hidden, embedding, labels):
  """mean_loss_fn(hidden, embedding) -> scalar: its value and gradients equal the dense mean's.
  Returns its gradients."""
  value_and_grads = lambda fn: jax.jit(jax.value_and_grad(fn, (0, 1)))(hidden, embedding)
  loss, grads = value_and_grads(mean_loss_fn)
  want_loss, want_grads = value_and_grads(lambda h, e: dense_losses(h, e, labels).mean())
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  return grads


def test_pick_chunk_divides_the_vocabulary():
  assert pick_chunk(512, 100) == 64  # 512 = 8 x 64: the largest divisor <= 100
  assert pick_chunk(62720, 4096) == 3920  # BLOOM's 250,880 rows over tensor=4: 16 chunks
  assert pick_chunk(128, 4096) == 128
  assert pick_chunk(97, 10) == 1  # a prime: one row per chunk, still correct


@pytest.mark.parametrize('chunk', [100, 512])
def test_values_and_gradients_match_dense(chunk):
  hidden, embedding, labels = problem()
  chunked = lambda h, e: vocab_parallel_cross_entropy(
    h, e, labels, vocab_size=VOCAB, chunk_size=chunk
  )
  np.testing.assert_allclose(
    chunked(hidden, embedding), dense_losses(hidden, embedding, labels), rtol=2e-6, atol=2e-6
  )
  grads = assert_mean_matches_dense(lambda h, e: chunked(h, e).mean(), hidden, embedding, labels)
  # Padded vocabulary rows are never predicted, so they get no gradient.
  assert float(jnp.abs(grads[1][VOCAB:]).max()) == 0.0


def test_label_logits_gradient_is_no_embedding_sized_scatter():
  """The label's logit is a gather of its embedding row, whose gradient (autodiff's transpose)
  would scatter-add into a zeroed [vocab, width] buffer (2 GB in fp32 for BLOOM's 250,880 x
  2048); the backward pass adds it to the softmax's gradient in each logit tile instead."""
  hidden, embedding, labels = problem(jnp.bfloat16)
  loss = lambda h, e: vocab_parallel_cross_entropy(
    h, e, labels, vocab_size=VOCAB, chunk_size=128
  ).mean()
  assert 'scatter' not in jax.jit(jax.grad(loss, (0, 1))).lower(hidden, embedding).as_text()


def test_bfloat16_inputs_keep_an_fp32_loss():
  hidden, embedding, labels = problem(jnp.bfloat16)
  got = vocab_parallel_cross_entropy(hidden, embedding, labels, vocab_size=VOCAB, chunk_size=128)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, dense_losses(hidden, embedding, labels), rtol=1e-5, atol=1e-5)


def test_vocab_parallel_under_shard_map_matches_dense():
  """Tokens split over `data`, vocabulary rows over `tensor` (Megatron's vocab-parallel CE)."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ('data', 'tensor'))
  hidden, embedding, labels = problem()

  def sharded(h, e):
    local = lambda h, e, l: vocab_parallel_cross_entropy(
      h, e, l, vocab_size=VOCAB, chunk_size=64, axis_name='tensor', token_axis_names=('data',)
    )
    return jax.shard_map(
      local, mesh=mesh, in_specs=(P('data'), P('tensor'), P('data')), out_specs=P('data')
    )(h, e, labels).mean()

  assert_mean_matches_dense(sharded, hidden, embedding, labels)


def temp_bytes(losses_fn, tokens: int, vocab: int) -> int:
  """Scratch memory XLA plans for the loss and both gradients (compiled, not run)."""
  hidden = jax.ShapeDtypeStruct((tokens, 32), jnp.float32)
  embedding = jax.ShapeDtypeStruct((vocab, 32), jnp.float32)
  labels = jax.ShapeDtypeStruct((tokens,), jnp.int32)
  step = jax.jit(jax.value_and_grad(lambda h, e, l: losses_fn(h, e, l, vocab).mean(), (0, 1)))
  return step.lower(hidden, embedding, labels).compile().memory_analysis().temp_size_in_bytes


def test_peak_memory_grows_with_the_chunk_not_with_tokens_x_vocab():
  tokens, chunk = 512, 512
  chunked = lambda h, e, l, v: vocab_parallel_cross_entropy(
    h, e, l, vocab_size=v - 3, chunk_size=chunk
  )
  dense = lambda h, e, l, v: dense_losses(h, e, l, real_vocab=v - 3)
  small, large = 2048, 32768
  chunked_small, chunked_large = (
    temp_bytes(chunked, tokens, small),
    temp_bytes(chunked, tokens, large),
  )
  logits_bytes = tokens * large * 4  # one fp32 [tokens, vocab] buffer
  # The dense loss holds (at least) the fp32 logits; the chunked one never does.
  assert temp_bytes(dense, tokens, large) >= logits_bytes
  assert chunked_large < logits_bytes / 8
  # Growing the vocabulary 16x adds at most a few embedding-sized buffers (the gradient of the
  # embedding is itself [vocab, width]), far less than tokens x vocab fp32.
  per_row = (chunked_large - chunked_small) / (large - small)
  assert per_row <= 4 * 32 * 2, per_row


# ------------------------------------------------------- fused: the gradient in the forward pass


@pytest.mark.parametrize('token_chunk', [8, 24])  # three chunks of 8 tokens, or one of 24
def test_fused_mean_and_gradients_match_dense(token_chunk):
  hidden, embedding, labels = problem()
  fused = lambda h, e: fused_cross_entropy_mean(
    h, e, labels, vocab_size=VOCAB, token_chunk=token_chunk
  )
  grads = assert_mean_matches_dense(fused, hidden, embedding, labels)
  assert float(jnp.abs(grads[1][VOCAB:]).max()) == 0.0
  # The backward pass scales the gradients the forward pass stored by the incoming cotangent.
  tripled = jax.grad(lambda h, e: 3.0 * fused(h, e), (0, 1))(hidden, embedding)
  for got, want in zip(tripled, grads):
    np.testing.assert_allclose(got, 3.0 * want, rtol=1e-6, atol=1e-8)


def test_fused_vocab_parallel_under_shard_map_matches_dense():
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ('data', 'tensor'))
  hidden, embedding, labels = problem()

  def sharded(h, e):
    local = lambda h, e, l: fused_cross_entropy_mean(
      h, e, l, vocab_size=VOCAB, token_chunk=4, axis_name='tensor', token_axis_names=('data',)
    )[None]
    # Each token shard returns its share of the mean over all of them.
    return jax.shard_map(
      local, mesh=mesh, in_specs=(P('data'), P('tensor'), P('data')), out_specs=P('data')
    )(h, e, labels).sum()

  assert_mean_matches_dense(sharded, hidden, embedding, labels)


def test_fused_weights_average_over_the_weighted_tokens_of_every_shard():
  """A loss mask (weights 0 or 1), unequal across the token shards: the mean over the weighted
  tokens of all shards, and no gradient from a weight-0 token."""
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ('data', 'tensor'))
  hidden, embedding, labels = problem()
  weights = jnp.ones(labels.shape).at[0, 3:].set(0.0).at[1, 10:].set(0.0)  # 3 + 10 tokens

  def sharded(h, e):
    local = lambda h, e, l, w: fused_cross_entropy_mean(
      h,
      e,
      l,
      vocab_size=VOCAB,
      weights=w,
      token_chunk=4,
      axis_name='tensor',
      token_axis_names=('data',),
    )[None]
    return jax.shard_map(
      local, mesh=mesh, in_specs=(P('data'), P('tensor'), P('data'), P('data')), out_specs=P('data')
    )(h, e, labels, weights).sum()

  value_and_grads = lambda fn: jax.jit(jax.value_and_grad(fn, (0, 1)))(hidden, embedding)
  loss, grads = value_and_grads(sharded)
  want_loss, want_grads = value_and_grads(
    lambda h, e: (dense_losses(h, e, labels) * weights).sum() / 13.0
  )
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(grads[0][0, 3:]).max()) == float(jnp.abs(grads[0][1, 10:]).max()) == 0.0
  # Unweighted, each shard's mean would count: a different number.
  assert float(loss) != pytest.approx(
    float(
      0.5
      * (
        dense_losses(hidden, embedding, labels)[0, :3].mean()
        + dense_losses(hidden, embedding, labels)[1, :10].mean()
      )
    ),
    rel=1e-4,
  )


def test_fused_backward_does_no_matmul_over_the_vocabulary():
  """The point of 'fused': three vocabulary matmuls in all (logits, d_hidden, d_embedding), all in
  the forward pass; the recomputing 'chunked' backward does four."""
  hidden, embedding, labels = problem(vocab=512, tokens=(4, 32))

  def vocab_dots(loss_fn):
    step = jax.jit(jax.value_and_grad(lambda h, e: loss_fn(h, e), (0, 1)))
    hlo = step.lower(hidden, embedding).as_text()
    return sum(
      1
      for line in hlo.splitlines()
      if 'dot_general' in line and '512' in line and 'stablehlo.dot_general' in line
    )

  fused = vocab_dots(lambda h, e: fused_cross_entropy_mean(h, e, labels, vocab_size=VOCAB))
  chunked = vocab_dots(
    lambda h, e: vocab_parallel_cross_entropy(h, e, labels, vocab_size=VOCAB, chunk_size=512).mean()
  )
  assert (fused, chunked) == (3, 4)


@pytest.mark.parametrize('tokens', [1024, 1536])
def test_fused_holds_one_chunk_at_a_time_on_a_gpu(tokens):
  """XLA's H100 compile of the fused loss and its gradients (abstract devices, nothing runs):
  two chunks of 512 tokens need the scratch memory of three (one fp32 [chunk, vocab] tile at a
  time), not a tile more. (XLA unrolls a loop of one iteration, and the two chunks' tiles were
  alive together: 3.0 tiles against 2.13.)"""
  from t5x_like.planning import gpu_target

  sharding = jax.sharding.SingleDeviceSharding(gpu_target.devices('h100-80gb', 1)[0])
  vocab, chunk = 32768, 512

  def scratch(tokens: int) -> int:
    shape = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype, sharding=sharding)
    loss = lambda h, e, l: fused_cross_entropy_mean(h, e, l, vocab_size=vocab, token_chunk=chunk)
    lowered = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(
      shape(tokens, 64), shape(vocab, 64), shape(tokens, dtype=jnp.int32)
    )
    compiled = gpu_target.compile_without_cache(lowered, 'h100-80gb')[0]
    return compiled.memory_analysis().temp_size_in_bytes

  tile = chunk * vocab * 4
  assert scratch(tokens) <= scratch(2048) + tile / 100, scratch(tokens) / tile


def test_fused_refuses_weights_and_shares_together():
  """shares are weights already divided by a count: given both, one would be dropped silently."""
  hidden, embedding, labels = problem()
  ones = jnp.ones(labels.shape, jnp.float32)
  with pytest.raises(ValueError, match='not both'):
    fused_cross_entropy_mean(
      hidden, embedding, labels, vocab_size=VOCAB, weights=ones, shares=ones / ones.sum()
    )
