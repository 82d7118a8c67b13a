"""AdamW, Megatron-style: sample-based learning rate, decay mask, pre-clip norm.

The learning rate is a pure function of consumed samples (and tokens, with token-based decay), not
of the optimizer step, so it is the same after any restart, batch-size ramp or skipped iteration.
The Adam step count lives inside the optax state (`ScaleByAdamState.count`) and is saved with it:
the bias-correction spike on every resume that the 104B run suffered cannot happen.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from t5x_like.config import OptimizerConfig


def learning_rate(cfg: OptimizerConfig, consumed_samples: int, consumed_tokens: int = 0,
                  warmup_end_tokens: int = 0) -> float:
  """Linear warm-up from 0 over warmup_samples, then decay to min_lr at decay_samples, then flat.

  Megatron's AnnealingLR in samples: during warm-up lr = lr * consumed / warmup; after it the decay
  ratio is (consumed - warmup) / (decay - warmup), and lr = min_lr + (lr - min_lr) * coeff with
  coeff = 0.5 * (cos(pi * ratio) + 1) for cosine, 1 - ratio for linear, 1 for constant. With
  decay_tokens (--lr-decay-tokens) the ratio counts tokens instead: (consumed_tokens -
  warmup_end_tokens) / (decay_tokens - warmup_end_tokens), warmup_end_tokens being
  `Config.warmup_end_tokens()`.

  Computed on the host in float64 and passed to the step: token counts pass 2^31 (tr11 consumed
  450B tokens), which an int32 or float32 argument would not hold exactly.
  """
  warmup = cfg.warmup_samples
  if consumed_samples < warmup:
    return cfg.lr * consumed_samples / warmup
  if cfg.decay_style == 'constant':
    return cfg.lr
  if cfg.decay_tokens > 0:
    ratio = (consumed_tokens - warmup_end_tokens) / (cfg.decay_tokens - warmup_end_tokens)
  elif cfg.decay_samples > 0:
    ratio = (consumed_samples - warmup) / (cfg.decay_samples - warmup)
  else:
    return cfg.lr
  ratio = min(1.0, max(0.0, ratio))
  if cfg.decay_style == 'cosine':
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
  else:
    coeff = 1.0 - ratio
  return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff


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
