"""What a run carries from step to step, and where each piece lives on the mesh.

`TrainState` is the device part (fp32 params and the optax state with its Adam step count).
`Progress` is the host part (iteration and sample counters); it is small, exact, and saved as JSON.
Dropout randomness is `fold_in(PRNGKey(seed), iteration)`, a pure function of what is saved, so a
resumed run draws the same masks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from t5x_like import model as model_lib
from t5x_like import optim, partitioning, pipeline
from t5x_like.config import Config


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any


@dataclasses.dataclass
class Progress:
  iteration: int = 0
  consumed_samples: int = 0
  consumed_tokens: int = 0
  skipped_iterations: int = 0
  nan_iterations: int = 0


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Shapes, logical names and shardings of a run's state on one mesh.

  `abstract` is the in-memory (storage) layout the jitted step works on; `canonical` is the
  mesh-independent layout of checkpoints ([L, ...] layer stacks). They differ only when pipeline
  stages need padding slots or a circular order (see pipeline.py).
  """
  mesh: Mesh
  model: model_lib.Transformer
  optimizer: optax.GradientTransformation
  plan: pipeline.StagePlan
  param_names: Any  # logical axis names per param
  abstract: TrainState  # ShapeDtypeStructs carrying their (ZeRO) shardings
  canonical: TrainState  # the same in checkpoint layout
  compute_param_shardings: Any  # rule shardings without the ZeRO `data` split

  @property
  def shardings(self) -> TrainState:
    return jax.tree.map(lambda a: a.sharding, self.abstract)

  def init(self, seed: int) -> TrainState:
    """Initialises params and optimizer state directly into their shardings."""

    def init_fn(rng):
      params = pipeline.to_storage(self.plan, nn.unbox(_init_boxed(self.model, rng)))
      return TrainState(params, self.optimizer.init(params))

    return jax.jit(init_fn, out_shardings=self.shardings)(jax.random.PRNGKey(seed))

  def fresh_opt_state(self, params) -> Any:
    return jax.jit(self.optimizer.init, out_shardings=self.shardings.opt_state)(params)

  def to_canonical(self, tree, which: str):
    """A storage-layout `params` or `opt_state` tree in checkpoint layout (identity for
    P = R = 1)."""
    if self.plan.is_identity:
      return tree
    target = jax.tree.map(lambda a: a.sharding, getattr(self.canonical, which))
    return jax.jit(lambda t: pipeline.to_canonical(self.plan, t), out_shardings=target)(tree)

  def from_canonical(self, tree, which: str):
    if self.plan.is_identity:
      return tree
    target = getattr(self.shardings, which)
    return jax.jit(lambda t: pipeline.to_storage(self.plan, t), out_shardings=target)(tree)


def _init_boxed(model: model_lib.Transformer, rng) -> Any:
  # Initialisation needs no activation constraints: the output shardings place the params.
  return model.clone(mesh=None).init(rng, jnp.zeros((1, 8), jnp.int32))['params']


def _abstract_state(mesh, optimizer, names, shapes) -> TrainState:
  """ShapeDtypeStructs with ZeRO shardings for params of these shapes and their Adam state."""
  shape_tuples = jax.tree.map(lambda s: s.shape, shapes)
  zero = partitioning.tree_shardings(mesh, names, shape_tuples, zero=True)
  abstract_opt = jax.eval_shape(optimizer.init, shapes)
  replicated = NamedSharding(mesh, P())
  # Adam moments take their parameter's ZeRO sharding; scalars (the step count) are replicated.
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, abstract_opt, zero,
      transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, NamedSharding))
  with_sharding = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
  return TrainState(
      params=jax.tree.map(with_sharding, shapes, zero),
      opt_state=jax.tree.map(with_sharding, abstract_opt, opt_shardings),
  )


def make_layout(cfg: Config, mesh: Mesh) -> StateLayout:
  model = model_lib.Transformer(cfg.model, cfg.padded_vocab_size, mesh)
  plan = pipeline.plan_for(cfg)
  boxed = jax.eval_shape(lambda: _init_boxed(model, jax.random.PRNGKey(0)))
  names = model_lib.param_logical_names(boxed)
  canonical_shapes = nn.unbox(boxed)
  shapes = jax.tree_util.tree_map_with_path(
      lambda path, s: jax.ShapeDtypeStruct(pipeline.storage_shape(plan, path, s.shape), s.dtype),
      canonical_shapes)
  optimizer = optim.make_optimizer(cfg.optimizer, shapes)
  abstract = _abstract_state(mesh, optimizer, names, shapes)
  canonical = _abstract_state(mesh, optimizer, names, canonical_shapes)
  compute = partitioning.tree_shardings(mesh, names, jax.tree.map(lambda s: s.shape, shapes),
                                        zero=False)
  return StateLayout(mesh, model, optimizer, plan, names, abstract, canonical, compute)
