"""AdamW, Megatron-style: decay mask, pre-clip norm; the learning rate it is given is
`schedule.learning_rate`'s, a pure function of consumed samples (and tokens), not of the step.

The Adam step count lives inside the optax state (`ScaleByAdamState.count`) and is saved with it:
the bias-correction spike on every resume that the 104B run suffered cannot happen.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from t5x_like.config import OptimizerConfig


def decay_mask(params) -> dict:
  """True where weight decay applies: matrices only, never biases or any LayerNorm.

  Decided by name and rank, so the embedding LayerNorm (the chronicles' restart spike) and every
  other norm are excluded even though they live in different places of the tree.
  """

  def decays(path, leaf) -> bool:
    names = [getattr(k, 'key', getattr(k, 'name', '')) for k in path]
    if any('ln' in str(n) for n in names):
      return False
    if str(names[-1]).endswith('bias'):
      return False
    stacked = 'layers' in names
    return leaf.ndim - (1 if stacked else 0) >= 2

  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: OptimizerConfig, params) -> optax.GradientTransformation:
  """Adam moments + decoupled weight decay; the caller multiplies by -lr (sample-based).

  Clipping is applied by the caller too, so the pre-clip norm is computed once and logged.
  """
  return optax.chain(
      optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps),
      optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(params)),
  )


def clip_by_global_norm(grads, max_norm: float):
  """Returns (clipped grads, pre-clip global norm). max_norm 0 disables clipping."""
  norm = optax.tree.norm(grads)
  if max_norm <= 0:
    return grads, norm
  scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
  return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads), norm


def adam_count(opt_state) -> jax.Array:
  """The Adam step count stored in the optimizer state."""
  return opt_state[0].count
