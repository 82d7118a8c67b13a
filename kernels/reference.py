"""Plain-JAX attention: the `xla` implementation and the reference every fused kernel must match."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def attention_reference(
  q,
  k,
  v,
  *,
  alibi_slopes=None,
  causal: bool = True,
  sm_scale=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  segment_ids=None,
):
  """softmax(q k^T * sm_scale + alibi, causal, segments) v, with fp32 scores and softmax.

  q, k, v: [batch, seq, heads, head_dim]; alibi_slopes: [heads], bias slope[h] * (key - query);
  sm_scale None means 1/sqrt(head_dim); segment_ids [batch, seq] (packed documents): a query sees
  only keys of its own segment. Returns [batch, seq, heads, head_dim] in v's dtype.
  """
  seq_q, seq_k = q.shape[1], k.shape[1]
  scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[-1])
  q_pos = jnp.arange(seq_q, dtype=jnp.float32)[:, None]
  k_pos = jnp.arange(seq_k, dtype=jnp.float32)[None, :]
  # ALiBi and the causal mask as one additive [heads or 1, q, k] bias, and the softmax normalised
  # after the second matmul: XLA's CPU backend then runs scores, bias, max, exp, sum and the
  # context matmul as one fused kernel (a select between the matmuls would split it; 5x slower).
  bias = jnp.zeros((1, seq_q, seq_k), jnp.float32)
  if alibi_slopes is not None:
    bias = jnp.asarray(alibi_slopes, jnp.float32)[:, None, None] * (k_pos - q_pos)[None]
  if causal:
    bias = jnp.where((k_pos <= q_pos)[None], bias, jnp.finfo(jnp.float32).min)
  q, k, v_heads = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # [batch, heads, seq, head_dim]
  scores = jnp.einsum('bnqd,bnkd->bnqk', q, k, preferred_element_type=jnp.float32) * scale
  scores = scores + bias[None]
  if segment_ids is not None:
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    scores = jnp.where(same, scores, jnp.finfo(jnp.float32).min)
  weights = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
  total = weights.sum(-1, keepdims=True)
  if dropout_rate > 0.0 and dropout_rng is not None:
    # Dropout of the normalised probabilities: the sum above is taken before it.
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = (
    jnp.einsum(
      'bnqk,bnkd->bnqd', weights.astype(v.dtype), v_heads, preferred_element_type=jnp.float32
    )
    / total
  )
  return jnp.swapaxes(out, 1, 2).astype(v.dtype)
