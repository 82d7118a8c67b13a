"""Next-token losses of the Transformer, by `model.cross_entropy_impl`.

* 'dense': the model's fp32 logits [B, S, V_pad] (split over the vocabulary under the mesh), then
  `cross_entropy`.
* 'chunked': the model's final hidden states and the tied embedding go to the vocabulary-parallel
  chunked cross-entropy (`t5x_like.kernels.vocab_parallel_cross_entropy`): under the mesh a
  `shard_map` gives each device its tokens (`data`) and vocabulary rows (`tensor`), and no device
  ever holds more than [its tokens, cross_entropy_chunk] fp32 logits.
* 'fused': the same shard_map around `fused_cross_entropy_mean`, which computes the loss's
  gradient in the forward pass, cross_entropy_chunk tokens at a time (the fastest on CPU; no
  [tokens, vocab] residual, but a d_embedding held until the backward pass).
"""

from __future__ import annotations

import functools
from typing import cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from t5x_like.config import ModelConfig
from t5x_like.kernels.cross_entropy import fused_cross_entropy_mean, vocab_parallel_cross_entropy
from t5x_like.mesh import partitioning
from t5x_like.model import transformer as model_lib

# The token id of padding: positions past what a sample trains on (the curriculum's padded
# lengths, `curriculum.pad_to_multiple`). Padding is no target, and as an input (read as token 0)
# it only reaches later positions, which causal attention keeps from every earlier one: padding
# after a sample's real tokens changes neither their losses nor the gradients.
PAD_ID = -1


def split_tokens(tokens):
  """tokens [..., S + 1] -> (inputs, labels, weights), each [..., S]: next-token prediction, with
  PAD_ID read as token 0 and weighted 0 (fp32 weights, 1 for every real target)."""
  inputs, targets = tokens[..., :-1], tokens[..., 1:]
  weights = (targets != PAD_ID).astype(jnp.float32)
  return jnp.maximum(inputs, 0), jnp.maximum(targets, 0), weights


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-token next-token cross-entropy in fp32, never gathering the vocabulary on one device.

  The max, the log-sum-exp and the label logit are reductions over the (tensor-split) vocab dim,
  which the partitioner turns into local reductions plus all-reduces of [B, S] values.
  """
  logits = logits.astype(jnp.float32)
  top = jax.lax.stop_gradient(logits.max(-1, keepdims=True))
  lse = jnp.log(jnp.exp(logits - top).sum(-1)) + top[..., 0]
  vocab_ids = jnp.arange(logits.shape[-1], dtype=labels.dtype)
  label_logit = jnp.where(vocab_ids == labels[..., None], logits, 0.0).sum(-1)
  return lse - label_logit


def real_microbatches(batch):
  """[M] bools: which micro-batches of batch [M, rows, S + 1] hold a target that is not padding
  (train.rampup_microbatch_multiple adds micro-batches of padding only, after the real ones)."""
  return jnp.any(batch[:, :, 1:] != PAD_ID, axis=(1, 2))


def weighted_mean(token_losses, weights):
  """sum(weights x losses) / sum(weights): the mean over real targets (0 if there are none)."""
  return (token_losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def mean_loss(
  model: model_lib.Transformer, params, tokens, *, deterministic: bool = True, rngs=None
):
  """The mean fp32 loss of predicting tokens[:, 1:] from tokens[:, :-1] (what training
  minimises), over the targets that are not PAD_ID."""
  inputs, labels, weights = split_tokens(tokens)
  if model.cfg.cross_entropy_impl != 'fused':
    return weighted_mean(_token_losses(model, params, inputs, labels, deterministic, rngs), weights)
  hidden, embedding = _final_hidden(model, params, inputs, deterministic, rngs)
  shares = weights / jnp.maximum(weights.sum(), 1.0)
  return fused_loss_sum(hidden, embedding, labels, shares, model.cfg, model.mesh)


def head_loss(head_params, x, labels, weights, count, cfg: ModelConfig, ctx: model_lib.Context):
  """sum(weights x the per-token losses) / count (at least 1) of the last layer's output x
  [B, S, h] through the final LayerNorm and the tied embedding, by `cfg.cross_entropy_impl`:
  the functional twin of `mean_loss`'s output side, on a param tree that holds `final_ln` and
  `word_embeddings` (the pipeline's last stage; the no-pipeline loop that adds its gradients
  in place). count: the real targets the mean is over (a micro-batch's, all its ranks')."""
  count = jnp.maximum(count, 1.0)
  impl = cfg.cross_entropy_impl
  if impl == 'dense':
    logits = model_lib.output_logits(head_params, x, cfg, ctx)
    return (cross_entropy(logits, labels) * weights).sum() / count
  hidden = model_lib.final_norm(head_params, x, cfg, ctx)
  embedding = head_params['word_embeddings'].astype(hidden.dtype)
  if impl == 'fused':
    return fused_loss_sum(hidden, embedding, labels, weights / count, cfg, ctx.mesh)
  return (chunked_token_losses(hidden, embedding, labels, cfg, ctx.mesh) * weights).sum() / count


def fused_loss_sum(hidden, embedding, labels, shares, cfg: ModelConfig, mesh: Mesh | None):
  """sum(shares x the per-token losses) of hidden [B, S, h] against embedding [V_pad, h] by
  the fused cross-entropy (its gradient computed in the forward pass), per shard; shares [B, S]
  fp32, e.g. weights / their count: the mean over real targets."""
  loss_fn = functools.partial(
    fused_cross_entropy_mean, vocab_size=cfg.vocab_size, token_chunk=cfg.cross_entropy_chunk
  )
  # Each token shard returns its part of the sum.
  return _per_shard(loss_fn, hidden, embedding, labels, mesh, shares=shares).sum()


def token_losses(
  model: model_lib.Transformer, params, tokens, *, deterministic: bool = True, rngs=None
):
  """Per-token fp32 losses [B, S] of predicting tokens[:, 1:] from tokens[:, :-1].

  'fused' has no per-token losses (it returns their mean); it gets the 'chunked' ones, which are
  the same numbers."""
  inputs, labels, _ = split_tokens(tokens)
  return _token_losses(model, params, inputs, labels, deterministic, rngs)


def _token_losses(model: model_lib.Transformer, params, inputs, labels, deterministic: bool, rngs):
  cfg = model.cfg
  if cfg.cross_entropy_impl == 'dense':
    logits = model.apply({'params': params}, inputs, deterministic=deterministic, rngs=rngs)
    return cross_entropy(cast(jax.Array, logits), labels)
  hidden, embedding = _final_hidden(model, params, inputs, deterministic, rngs)
  return chunked_token_losses(hidden, embedding, labels, cfg, model.mesh)


def _final_hidden(model: model_lib.Transformer, params, inputs, deterministic: bool, rngs):
  """The final-LN hidden states [B, S, h] and the tied embedding in their compute dtype, for the
  losses that apply the embedding themselves."""
  hidden = cast(
    jax.Array,
    model.apply(
      {'params': params}, inputs, deterministic=deterministic, rngs=rngs, return_hidden=True
    ),
  )
  return hidden, model_lib.gathered_embedding(model, params).astype(hidden.dtype)


def chunked_token_losses(hidden, embedding, labels, cfg: ModelConfig, mesh: Mesh | None):
  """The chunked cross-entropy of hidden [B, S, h] against embedding [V_pad, h], per shard."""
  loss_fn = functools.partial(
    vocab_parallel_cross_entropy, vocab_size=cfg.vocab_size, chunk_size=cfg.cross_entropy_chunk
  )
  return _per_shard(loss_fn, hidden, embedding, labels, mesh)


def _per_shard(loss_fn, hidden, embedding, labels, mesh: Mesh | None, shares=None):
  """loss_fn on each device's tokens and vocabulary rows: one loss per token (the labels' shape),
  or, given per-token `shares` (a loss that reduces its tokens), one value per token shard,
  returned as [token shards]."""
  one_per_shard = shares is not None

  def local(hidden, embedding, labels, *shares, vocab_axes=None, token_axes=()):
    kwargs = {'shares': shares[0]} if shares else {}
    loss = loss_fn(
      hidden, embedding, labels, axis_name=vocab_axes, token_axis_names=token_axes, **kwargs
    )
    return loss[None] if one_per_shard else loss

  token_arrays = (labels, shares) if one_per_shard else (labels,)
  if mesh is None:
    return local(hidden, embedding, *token_arrays)
  # The same (fitted) specs the partitioner gives these arrays, so the shard_map moves nothing.
  hidden_spec = partitioning.spec_for(('batch', 'length', 'act_embed'), hidden.shape, mesh)
  embedding_spec = partitioning.spec_for(('vocab', 'embed'), embedding.shape, mesh)
  labels_spec = partitioning.spec_for(('batch', 'length'), labels.shape, mesh)
  vocab_axes, token_axes = embedding_spec[0], hidden_spec[0]
  token_axes = (
    () if token_axes is None else (token_axes if isinstance(token_axes, tuple) else (token_axes,))
  )
  out_specs = PartitionSpec(hidden_spec[0]) if one_per_shard else labels_spec
  return jax.shard_map(
    lambda h, e, *t: local(h, e, *t, vocab_axes=vocab_axes, token_axes=token_axes),
    mesh=mesh,
    in_specs=(hidden_spec, embedding_spec) + (labels_spec,) * len(token_arrays),
    out_specs=out_specs,
  )(hidden, embedding, *token_arrays)
