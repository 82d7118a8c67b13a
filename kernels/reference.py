"""Plain-JAX attention: the `xla` implementation and the reference every fused kernel must match."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, *, alibi_slopes=None, causal: bool = True, sm_scale=None,
                        dropout_rate: float = 0.0, dropout_rng=None, segment_ids=None):
  """softmax(q k^T * sm_scale + alibi, causal, segments) v, with fp32 scores and softmax.

  q, k, v: [batch, seq, heads, head_dim]; alibi_slopes: [heads], bias slope[h] * (key - query);
  sm_scale None means 1/sqrt(head_dim); segment_ids [batch, seq] (packed documents): a query sees
  only keys of its own segment. Returns [batch, seq, heads, head_dim] in v's dtype.
  """
  seq_q, seq_k = q.shape[1], k.shape[1]
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
  scores = jnp.einsum('bqnd,bknd->bnqk', q, k, preferred_element_type=jnp.float32) * scale
  q_pos = jnp.arange(seq_q, dtype=jnp.float32)[:, None]
  k_pos = jnp.arange(seq_k, dtype=jnp.float32)[None, :]
  if alibi_slopes is not None:
    slopes = jnp.asarray(alibi_slopes, jnp.float32)
    scores = scores + slopes[None, :, None, None] * (k_pos - q_pos)[None, None]
  if causal:
    scores = jnp.where((k_pos <= q_pos)[None, None], scores, jnp.finfo(jnp.float32).min)
  if segment_ids is not None:
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    scores = jnp.where(same, scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
    probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
  return jnp.einsum('bnqk,bknd->bqnd', probs.astype(v.dtype), v)
