"""AdamW, Megatron-style: decay mask, pre-clip norm; the learning rate it is given is
`schedule.learning_rate`'s, a pure function of consumed samples (and tokens), not of the step.

The Adam step count lives inside the optax state (`ScaleByAdamState.count`) and is saved with it:
the bias-correction spike on every resume that the 104B run suffered cannot happen.
`optimizer.name='adamw_8bit'` keeps the moments as 8-bit codes (quantized_adam.py); everything
else here (decay mask, clipping, the step count) is the same for both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from t5x_like.config import ConfigError, OptimizerConfig
from t5x_like.optim import quantized_adam


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


def make_optimizer(
  cfg: OptimizerConfig, params, fp32_state: tuple[str, ...] = ()
) -> optax.GradientTransformation:
  """Adam moments + decoupled weight decay; the caller multiplies by -lr (sample-based).

  Clipping is applied by the caller too, so the pre-clip norm is computed once and logged.
  `optimizer.name='adamw_8bit'` stores the moments as 8-bit codes (quantized_adam.py), except
  for the params named in `fp32_state` (and small ones); the decay is the same either way.
  """
  if cfg.name == 'adamw_8bit':
    adam = quantized_adam.scale_by_adam_8bit(
      cfg.beta1, cfg.beta2, cfg.eps, block_axes(cfg, params, fp32_state)
    )
  else:
    adam = optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps)
  return optax.chain(adam, optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask(params)))


def block_axes(cfg: OptimizerConfig, params, fp32_state: tuple[str, ...] = ()):
  """Per param: where adamw_8bit quantises its moments (quantized_adam.BlockAxis), or None for
  fp32 moments (always None under 'adamw')."""
  if cfg.name != 'adamw_8bit':
    return jax.tree.map(lambda _: None, params)
  return quantized_adam.block_axes(params, cfg.quant_block_size, cfg.quant_min_size, fp32_state)


def check_moments_split(cfg: OptimizerConfig, abstract_opt, param_shardings) -> None:
  """A ConfigError when an 8-bit moment cannot be split like its parameter (its blocks would
  straddle the shards of a mesh axis): it would be held whole along that axis, which costs more
  memory than fp32 moments split."""
  if cfg.name != 'adamw_8bit':
    return
  problems = quantized_adam.unsplit_moments(abstract_opt[0], param_shardings)
  if problems:
    raise ConfigError(
      f"optimizer.name='adamw_8bit': the moments of {', '.join(problems)} cannot be split over "
      f'that mesh axis: its shards would cut the blocks of optimizer.quant_block_size='
      f'{cfg.quant_block_size} values. Use a quant_block_size that gives those dims a number of '
      "blocks the axis divides, a mesh that divides it, or optimizer.name='adamw'"
    )


def split_blocks(cfg: OptimizerConfig, params, fp32_state: tuple[str, ...] = ()):
  """Per param: (dim, block size) of its 8-bit moments' blocks, or None: the whole units that
  ZeRO's `data` split must keep (partitioning.zero_spec)."""
  is_axis = lambda x: x is None or isinstance(x, quantized_adam.BlockAxis)
  return jax.tree.map(
    lambda b: None if b is None else (b.axis, b.block_size),
    block_axes(cfg, params, fp32_state),
    is_leaf=is_axis,
  )


def fp32_state_params(model_cfg) -> tuple[str, ...]:
  """Params whose moments stay fp32 under adamw_8bit: the embedding with StableEmbedding."""
  return ('word_embeddings',) if model_cfg.stable_embedding else ()


def state_shardings(
  optimizer: optax.GradientTransformation, abstract_opt, param_shardings, replicated: NamedSharding
):
  """The shardings of an (abstract) optimizer state: moments like their params (8-bit codes
  with whole blocks per shard), scalars such as the step count replicated."""
  if isinstance(abstract_opt[0], quantized_adam.ScaleByAdam8bitState):
    adam = quantized_adam.state_shardings(abstract_opt[0], param_shardings, replicated)
    return (adam,) + jax.tree.map(lambda _: replicated, tuple(abstract_opt[1:]))
  return optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    abstract_opt,
    param_shardings,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, NamedSharding),
  )


def state_format(cfg) -> dict:
  """What decides the layout of a run's saved optimizer state (a full Config)."""
  o = cfg.optimizer
  if o.name != 'adamw_8bit':
    return {'optimizer.name': o.name}
  return {
    'optimizer.name': o.name,
    'optimizer.quant_block_size': o.quant_block_size,
    'optimizer.quant_min_size': o.quant_min_size,
    'model.stable_embedding': cfg.model.stable_embedding,
  }


def check_same_state_format(saved, cfg, what: str) -> None:
  """Start-up check of a resume that loads the optimizer state: `saved` (the checkpoint's
  Config) must have stored it in `cfg`'s format, or the restore could not read it."""
  old, new = state_format(saved), state_format(cfg)
  if old != new:
    keys = (
      ['optimizer.name']
      if old['optimizer.name'] != new['optimizer.name']
      else [k for k in new if old[k] != new[k]]
    )
    diffs = '; '.join(f'{k}: checkpoint {old[k]!r} vs config {new[k]!r}' for k in keys)
    raise ConfigError(
      f'the optimizer state of {what} is stored in another format: {diffs}. '
      'Set checkpoint.load_optimizer=False to switch (params restored, fresh '
      'optimizer state), or restore these values.'
    )


def bytes_per_param(cfg: OptimizerConfig, params, fp32_state: tuple[str, ...] = ()) -> float:
  """Optimizer-state bytes per parameter: 8 for fp32 moments, about 2 for 8-bit ones."""
  return quantized_adam.bytes_per_param(params, block_axes(cfg, params, fp32_state))


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
