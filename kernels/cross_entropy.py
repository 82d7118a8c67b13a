"""Vocabulary-parallel, chunked softmax cross-entropy that never holds the full fp32 logits.

    from t5x_like.kernels import vocab_parallel_cross_entropy
    losses = vocab_parallel_cross_entropy(hidden, embedding, labels, vocab_size=V)

`hidden` [..., E] are the final hidden states and `embedding` [V_pad, E] the (tied) output
projection; the loss of each token is logsumexp(hidden . embedding^T) - the label's logit, with
rows >= `vocab_size` (vocabulary padding) excluded from the softmax. The logits exist one
[tokens, chunk] fp32 tile at a time, in the forward pass and again (recomputed) in the backward
pass of a `custom_vjp`, so the loss needs memory for one chunk instead of tokens x vocab; the
gradient of the embedding is written chunk by chunk.

Vocabulary parallelism (Megatron's): inside a `shard_map` whose `axis_name` splits the vocabulary,
`embedding` is the local [V_pad / n, E] shard; each shard reduces its own rows and the shards
combine their log-sum-exps and label logits with [tokens]-sized collectives.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from t5x_like.kernels.residuals import LOSS_RESIDUALS

# Finite, so a chunk (or a whole shard) of padding rows contributes exp(-huge) = 0 without the
# NaNs of -inf - -inf.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def pick_chunk(num_rows: int, chunk_size: int) -> int:
  """The largest chunk <= chunk_size that divides num_rows (no padded copy of the embedding)."""
  for num_chunks in range(-(-num_rows // max(1, chunk_size)), num_rows + 1):
    if num_rows % num_chunks == 0:
      return num_rows // num_chunks
  return num_rows


def _chunk_logits(hidden, embedding_chunk, chunk_index, chunk: int, valid_rows):
  logits = jnp.einsum('ne,ce->nc', hidden, embedding_chunk, preferred_element_type=jnp.float32)
  rows = chunk_index * chunk + jnp.arange(chunk)
  return jnp.where(rows[None, :] < valid_rows, logits, _MASK_VALUE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def chunked_logsumexp(hidden, embedding, local_labels, valid_rows, chunk: int):
  """(log sum_v exp(hidden . embedding[v]) over rows v < valid_rows, the label's logit
  hidden . embedding[local_labels]), fp32 [N] each; the label's logit is 0 for a label that is
  not a row of `embedding` (another vocabulary shard's, or negative).

  hidden [N, E], embedding [V, E] with chunk dividing V, local_labels [N]; valid_rows an int32
  scalar (traced is fine). Only one [N, chunk] fp32 tile of logits is live at a time. The
  label's logit is a gather of its embedding row in the forward pass, and its gradient joins
  the softmax's in the backward pass's tiles (a select there): no embedding-sized scatter.
  """
  return _logsumexp_fwd(hidden, embedding, local_labels, valid_rows, chunk)[0]


def _logsumexp_fwd(hidden, embedding, local_labels, valid_rows, chunk: int):
  num_rows, width = embedding.shape
  chunks = embedding.reshape(num_rows // chunk, chunk, width)

  def visit(carry, xs):
    running_max, running_sum = carry
    logits = _chunk_logits(hidden, *xs, chunk, valid_rows)
    new_max = jnp.maximum(running_max, logits.max(-1))
    new_sum = running_sum * jnp.exp(running_max - new_max)
    return (new_max, new_sum + jnp.exp(logits - new_max[:, None]).sum(-1)), None

  # *_like of the inputs: inside a shard_map the carries get their varying-axes types.
  token = hidden[:, 0].astype(jnp.float32)
  init = (jnp.full_like(token, -jnp.inf), jnp.zeros_like(token))
  (top, total), _ = jax.lax.scan(visit, init, (chunks, jnp.arange(num_rows // chunk)))
  lse = checkpoint_name(top + jnp.log(total), LOSS_RESIDUALS)
  here = (local_labels >= 0) & (local_labels < valid_rows)
  rows = jnp.take(embedding, jnp.clip(local_labels, 0, num_rows - 1), axis=0)
  label_logit = jnp.einsum('ne,ne->n', hidden, rows, preferred_element_type=jnp.float32)
  label_logit = jnp.where(here, label_logit, 0.0)
  return (lse, label_logit), (hidden, embedding, local_labels, valid_rows, lse)


def _logsumexp_bwd(chunk: int, residuals, cotangents):
  """d lse_n / d logit_nv = softmax_nv and d label_logit_n / d logit_nv = one_hot_nv: each tile
  recomputed, never the whole [N, V]."""
  hidden, embedding, local_labels, valid_rows, lse = residuals
  d_lse, d_label_logit = cotangents
  num_rows, width = embedding.shape
  chunks = embedding.reshape(num_rows // chunk, chunk, width)

  def visit(d_hidden, xs):
    embedding_chunk, index = xs
    logits = _chunk_logits(hidden, embedding_chunk, index, chunk, valid_rows)
    rows = index * chunk + jnp.arange(chunk)
    d_logits = jnp.exp(logits - lse[:, None]) * d_lse[:, None]
    d_logits = d_logits + jnp.where(
      rows[None, :] == local_labels[:, None], d_label_logit[:, None], 0.0
    )
    d_logits = d_logits.astype(hidden.dtype)
    d_hidden = d_hidden + jnp.einsum(
      'nc,ce->ne', d_logits, embedding_chunk, preferred_element_type=jnp.float32
    )
    d_chunk = jnp.einsum('nc,ne->ce', d_logits, hidden, preferred_element_type=jnp.float32)
    return d_hidden, d_chunk.astype(embedding.dtype)

  d_hidden, d_chunks = jax.lax.scan(
    visit, jnp.zeros_like(hidden, jnp.float32), (chunks, jnp.arange(num_rows // chunk))
  )
  return d_hidden.astype(hidden.dtype), d_chunks.reshape(num_rows, width), None, None


chunked_logsumexp.defvjp(_logsumexp_fwd, _logsumexp_bwd)


def _local_problem(hidden, embedding, labels, vocab_size: int, axis_name, token_axis_names):
  """Flattened tokens, and this vocabulary shard's row offset and count of real (unpadded) rows.

  Every vocabulary shard sees the same tokens; marking them varying over axis_name makes the
  transpose sum the shards' partial d_hidden (a psum). The embedding is replicated over the token
  axes; marking it varying there sums its gradient over them.
  """
  hidden = hidden.reshape(-1, hidden.shape[-1])
  labels = labels.reshape(-1)
  local_rows = embedding.shape[0]
  offset = 0
  if axis_name is not None:
    offset = jax.lax.axis_index(axis_name) * local_rows
    hidden = jax.lax.pcast(hidden, axis_name, to='varying')
  if token_axis_names:
    embedding = jax.lax.pcast(embedding, tuple(token_axis_names), to='varying')
  valid_rows = jnp.clip(vocab_size - offset, 0, local_rows).astype(jnp.int32)
  return hidden, embedding, labels, offset, valid_rows


def vocab_parallel_cross_entropy(
  hidden,
  embedding,
  labels,
  *,
  vocab_size: int,
  chunk_size: int = 4096,
  axis_name: str | None = None,
  token_axis_names: tuple[str, ...] = (),
):
  """Per-token fp32 cross-entropy [...] of logits hidden . embedding^T, chunked over the vocabulary.

  hidden [..., E]; labels [...] (ids < vocab_size); embedding [V_local, E], the whole padded
  vocabulary, or, with axis_name, this shard's rows (shard i holds rows i * V_local onwards).
  Rows >= vocab_size are padding and never predicted. Differentiable in hidden and embedding.
  Inside a shard_map, token_axis_names are the mesh axes that split the tokens (the embedding is
  replicated over them, so its gradient is summed over them).
  """
  batch_shape = labels.shape
  hidden, embedding, labels, offset, valid_rows = _local_problem(
    hidden, embedding, labels, vocab_size, axis_name, token_axis_names
  )
  local_lse, label_logit = chunked_logsumexp(
    hidden, embedding, labels - offset, valid_rows, pick_chunk(embedding.shape[0], chunk_size)
  )
  if axis_name is None:
    lse = local_lse
  else:
    # log sum_shards exp(lse_shard), stabilised by the largest shard; [tokens]-sized collectives.
    top = jax.lax.pmax(jax.lax.stop_gradient(local_lse), axis_name)
    lse = top + jnp.log(jax.lax.psum(jnp.exp(local_lse - top), axis_name))
    label_logit = jax.lax.psum(label_logit, axis_name)
  return (lse - label_logit).reshape(batch_shape)


# ------------------------------------------------------------------- gradient in the forward pass


def fused_cross_entropy_mean(
  hidden,
  embedding,
  labels,
  *,
  vocab_size: int,
  weights=None,
  shares=None,
  token_chunk: int = 4096,
  axis_name: str | None = None,
  token_axis_names: tuple[str, ...] = (),
):
  """Mean fp32 cross-entropy of logits hidden . embedding^T, its gradient computed in the forward.

  The same loss as `vocab_parallel_cross_entropy(...).mean()`, for speed rather than memory: each
  chunk of `token_chunk` tokens gets its [chunk, V_local] fp32 logits, softmax and logits
  gradient (softmax - one_hot) / tokens once, and from them d_hidden and d_embedding, so the
  backward pass only scales two stored gradients by the incoming cotangent. That is three
  matmuls over the vocabulary instead of the four of a recomputing backward, and no [tokens, V]
  residual and no transposed copy of one. Memory: one [chunk, V_local] fp32 tile plus a
  d_embedding of the embedding's size, held from the forward to the backward pass: a pipeline
  runs it only where each micro-batch's backward follows its forward at once (1F1B; config.py).

  Arguments as `vocab_parallel_cross_entropy`, and `weights` (labels' shape, 0 or 1; default all
  1): the mean is sum(weights x loss) / sum(weights), the form of a loss mask (0: padding that
  is not a target). Under a token-splitting shard_map (token_axis_names), sum(weights) counts
  every shard's tokens and each shard returns its own share of the sum: add the shards' values.
  Or `shares` (labels' shape, fp32) instead of weights: the result is sum(shares x loss), for a
  caller whose mean counts tokens this call does not see (a pipeline's data ranks).
  """
  if shares is not None and weights is not None:
    raise ValueError(
      'fused_cross_entropy_mean takes weights (it divides by their count) or shares (already '
      'divided), not both; pass one'
    )
  if shares is None:
    if weights is None:
      weights = jnp.ones(labels.shape, jnp.float32)
    weights = weights.reshape(-1).astype(jnp.float32)
    count = weights.sum()
    if token_axis_names:
      count = jax.lax.psum(count, tuple(token_axis_names))
    # A batch of padding only (count 0) has loss and gradient 0.
    shares = weights / jnp.maximum(count, 1.0)
  hidden, embedding, labels, offset, valid_rows = _local_problem(
    hidden, embedding, labels, vocab_size, axis_name, token_axis_names
  )
  chunk = pick_chunk(hidden.shape[0], token_chunk)
  shares = shares.reshape(-1).astype(jnp.float32)
  return _fused_mean(hidden, embedding, labels - offset, valid_rows, shares, chunk, axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused_mean(hidden, embedding, local_labels, valid_rows, scale, chunk: int, axis_name):
  return _fused_forward(hidden, embedding, local_labels, valid_rows, scale, chunk, axis_name)[0]


def _fused_forward(hidden, embedding, local_labels, valid_rows, scale, chunk: int, axis_name):
  num_tokens, width = hidden.shape
  local_rows = embedding.shape[0]
  rows = jnp.arange(local_rows)

  def tile(hidden_chunk, labels_chunk, scale_chunk):
    logits = jnp.einsum('ne,ve->nv', hidden_chunk, embedding, preferred_element_type=jnp.float32)
    logits = jnp.where(rows[None, :] < valid_rows, logits, _MASK_VALUE)
    top = logits.max(-1, keepdims=True)
    if axis_name is not None:
      top = jax.lax.pmax(top, axis_name)
    exp = jnp.exp(logits - top)
    total = exp.sum(-1, keepdims=True)
    # The label's logit: a gather of one entry per token. Labels of other vocabulary shards
    # point at row 0 and count nothing.
    in_shard = (labels_chunk >= 0) & (labels_chunk < local_rows)
    label_rows = jnp.where(in_shard, labels_chunk, 0)
    label_logit = jnp.take_along_axis(logits, label_rows[:, None], axis=1)[:, 0]
    label_logit = local_label_logit = jnp.where(in_shard, label_logit, 0.0)
    if axis_name is not None:
      total = jax.lax.psum(total, axis_name)
      label_logit = jax.lax.psum(label_logit, axis_name)
    loss_sum = (scale_chunk * (top[:, 0] + jnp.log(total[:, 0]) - label_logit)).sum()
    # (softmax - one_hot) x the token's share, the one-hot a select in the same elementwise pass
    # (a label outside this shard's rows matches none of them): one kernel reads the fp32 logits
    # and writes the compute-dtype gradient. (A scatter of the -1s made XLA write the fp32
    # gradient tile and read it again: 66 GB more HBM traffic in the 1.3B step on an H100,
    # benchmarks/hbm_traffic.py; on a CPU it was 3-12% slower too.)
    one_hot = rows[None, :] == labels_chunk[:, None]
    d_logits = exp * (scale_chunk[:, None] / total) - jnp.where(one_hot, scale_chunk[:, None], 0.0)
    d_logits = d_logits.astype(hidden.dtype)
    d_hidden = jnp.einsum('nv,ve->ne', d_logits, embedding, preferred_element_type=jnp.float32)
    d_embedding = jnp.einsum(
      'nv,ne->ve', d_logits, hidden_chunk, preferred_element_type=jnp.float32
    )
    return loss_sum, d_hidden.astype(hidden.dtype), d_embedding, local_label_logit

  hidden_chunks = hidden.reshape(num_tokens // chunk, chunk, width)
  label_chunks = local_labels.reshape(num_tokens // chunk, chunk)
  scale_chunks = scale.reshape(num_tokens // chunk, chunk)
  # The first chunk outside the scan seeds the carries with the inputs' varying-axes types.
  loss_sum, d_first, d_embedding, label_logit = tile(
    hidden_chunks[0], label_chunks[0], scale_chunks[0]
  )
  # The other chunks start once the first chunk's gradients and label logits (the last reads
  # of its fp32 tile) are done: XLA's GPU compiler unrolls a loop of one iteration (two chunks)
  # and ran both chunks side by side, two fp32 tiles at once (3.8 GiB more at the peak of
  # configs/bloom_1b3.py's step on an H100). In a longer loop one iteration ends before the
  # next begins.
  d_first, d_embedding, rest, _ = jax.lax.optimization_barrier(
    (d_first, d_embedding, hidden_chunks[1:], label_logit)
  )

  def visit(carry, xs):
    loss_sum, d_embedding = carry
    chunk_loss, d_hidden, chunk_d_embedding, _ = tile(*xs)
    return (loss_sum + chunk_loss, d_embedding + chunk_d_embedding), d_hidden

  (loss_sum, d_embedding), d_rest = jax.lax.scan(
    visit, (loss_sum, d_embedding), (rest, label_chunks[1:], scale_chunks[1:])
  )
  d_hidden = jnp.concatenate([d_first[None], d_rest]).reshape(num_tokens, width)
  return loss_sum, (d_hidden, d_embedding.astype(embedding.dtype))


def _fused_bwd(chunk: int, axis_name, residuals, grad):
  d_hidden, d_embedding = residuals
  return (
    (d_hidden * grad).astype(d_hidden.dtype),
    (d_embedding * grad).astype(d_embedding.dtype),
    None,
    None,
    None,
  )


_fused_mean.defvjp(_fused_forward, _fused_bwd)
