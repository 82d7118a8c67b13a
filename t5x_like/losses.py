"""Next-token losses of the Transformer, by `model.cross_entropy_impl`.

* 'dense': the model's fp32 logits [B, S, V_pad] (split over the vocabulary under the mesh), then
  `model.cross_entropy`.
* 'chunked': the model's final hidden states and the tied embedding go to the vocabulary-parallel
  chunked cross-entropy (`t5x_like.kernels.vocab_parallel_cross_entropy`): under the mesh a
  `shard_map` gives each device its tokens (`data`) and vocabulary rows (`tensor`), and no device
  ever holds more than [its tokens, cross_entropy_chunk] fp32 logits.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from t5x_like import model as model_lib
from t5x_like import partitioning
from t5x_like.config import ModelConfig
from t5x_like.kernels.cross_entropy import vocab_parallel_cross_entropy


def token_losses(model: model_lib.Transformer, params, tokens, *, deterministic: bool = True,
                 rngs=None):
  """Per-token fp32 losses [B, S] of predicting tokens[:, 1:] from tokens[:, :-1]."""
  cfg = model.cfg
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  if cfg.cross_entropy_impl == 'dense':
    logits = model.apply({'params': params}, inputs, deterministic=deterministic, rngs=rngs)
    return model_lib.cross_entropy(logits, labels)
  hidden = model.apply({'params': params}, inputs, deterministic=deterministic, rngs=rngs,
                       return_hidden=True)
  embedding = params['word_embeddings'].astype(hidden.dtype)
  return chunked_token_losses(hidden, embedding, labels, cfg, model.mesh)


def chunked_token_losses(hidden, embedding, labels, cfg: ModelConfig, mesh: Mesh | None):
  """The chunked cross-entropy of hidden [B, S, h] against embedding [V_pad, h], per shard."""

  def local(hidden, embedding, labels, vocab_axes=None, token_axes=()):
    return vocab_parallel_cross_entropy(hidden, embedding, labels, vocab_size=cfg.vocab_size,
                                        chunk_size=cfg.cross_entropy_chunk, axis_name=vocab_axes,
                                        token_axis_names=token_axes)

  if mesh is None:
    return local(hidden, embedding, labels)
  # The same (fitted) specs the partitioner gives these arrays, so the shard_map moves nothing.
  hidden_spec = partitioning.spec_for(('batch', 'length', 'act_embed'), hidden.shape, mesh)
  embedding_spec = partitioning.spec_for(('vocab', 'embed'), embedding.shape, mesh)
  labels_spec = partitioning.spec_for(('batch', 'length'), labels.shape, mesh)
  vocab_axes, token_axes = embedding_spec[0], hidden_spec[0]
  token_axes = () if token_axes is None else (
      token_axes if isinstance(token_axes, tuple) else (token_axes,))
  return jax.shard_map(
      lambda h, e, l: local(h, e, l, vocab_axes, token_axes), mesh=mesh,
      in_specs=(hidden_spec, embedding_spec, labels_spec), out_specs=labels_spec,
  )(hidden, embedding, labels)
