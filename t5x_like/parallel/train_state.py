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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.config import Config
from t5x_like.mesh import partitioning
from t5x_like.model import transformer as model_lib
from t5x_like.optim import adamw as optim
from t5x_like.parallel import pipeline


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

  def advance(self, global_batch_size: int, seq_len: int) -> None:
    """One more iteration: its global batch of samples, each `seq_len` tokens long."""
    self.iteration += 1
    self.consumed_samples += global_batch_size
    self.consumed_tokens += global_batch_size * seq_len


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """Shapes, logical names and shardings of a run's state on one mesh.

  `abstract` is the in-memory (storage) layout the jitted step takes and returns; `canonical` is
  the mesh-independent layout of checkpoints ([L, ...] layer stacks, true shapes). They differ
  when pipeline stages need padding slots or a circular order (see pipeline.py), and where ZeRO-1
  pads a dim that `data` does not divide (partitioning.zero_split). `logical` is `abstract`
  without the ZeRO padding: the shapes the step computes on, with the same shardings (uneven
  where padded, which XLA accepts inside a jitted function but not at its boundary).
  """

  mesh: Mesh
  model: model_lib.Transformer
  optimizer: optax.GradientTransformation
  placement: pipeline.LayerPlacement
  param_names: Any  # logical axis names per param
  abstract: TrainState  # ShapeDtypeStructs carrying their (ZeRO) shardings
  canonical: TrainState  # the same in checkpoint layout
  compute_param_shardings: Any  # rule shardings without the ZeRO `data` split
  logical: TrainState  # `abstract` without the ZeRO padding
  zero_stage: int = 1  # mesh.zero_stage; under 3 the model (`model.gathers`) gathers per use

  @property
  def step_compute_shardings(self) -> Any:
    """Where the train and evaluation steps hold the compute-dtype copy of the params: gathered
    whole once per step (rule shardings) under ZeRO-1, split as the fp32 params under ZeRO-3."""
    return self.shardings.params if self.zero_stage == 3 else self.compute_param_shardings

  @property
  def is_padded(self) -> bool:
    return any(
      a.shape != b.shape
      for a, b in zip(jax.tree.leaves(self.abstract), jax.tree.leaves(self.logical))
    )

  @property
  def shardings(self) -> TrainState:
    return jax.tree.map(lambda a: a.sharding, self.abstract)

  def init(self, seed: int) -> TrainState:
    """Initialises params and optimizer state directly into their shardings."""

    def init_fn(rng):
      params = pipeline.to_storage(self.placement, nn.unbox(_init_boxed(self.model, rng)))
      params = self.pad(params, 'params')
      return TrainState(params, self.optimizer.init(params))

    return jax.jit(init_fn, out_shardings=self.shardings)(jax.random.PRNGKey(seed))

  def fresh_opt_state(self, params) -> Any:
    return jax.jit(self.optimizer.init, out_shardings=self.shardings.opt_state)(params)

  def unpad(self, tree, which: str | None):
    """Inside a jitted function: a storage-layout `params` or `opt_state` tree (a whole
    TrainState for `which=None`) without the ZeRO padding, split as the state is (unevenly)."""
    return jax.tree.map(_resize, tree, self._part(self.logical, which))

  def pad(self, tree, which: str | None):
    """Inside a jitted function: the inverse of `unpad` (the padding is zeros, which AdamW keeps
    at zero: zero gradients give zero moments and updates, and decay scales zero)."""
    return jax.tree.map(_resize, tree, self._part(self.abstract, which))

  @staticmethod
  def _part(state: TrainState, which: str | None):
    return state if which is None else getattr(state, which)

  def compute_params(self, params):
    """Storage-layout params (padded) as the model takes them: unpadded, in the compute (rule)
    shardings, without the ZeRO split; for inference."""
    return jax.jit(lambda p: self.unpad(p, 'params'), out_shardings=self.compute_param_shardings)(
      params
    )

  def to_canonical(self, tree, which: str):
    """A storage-layout `params` or `opt_state` tree in checkpoint layout (identity for
    P = R = 1 without ZeRO padding)."""
    if self.placement.is_identity and not self.is_padded:
      return tree
    target = jax.tree.map(lambda a: a.sharding, getattr(self.canonical, which))
    return jax.jit(
      lambda t: pipeline.to_canonical(self.placement, self.unpad(t, which)), out_shardings=target
    )(tree)

  def from_canonical(self, tree, which: str):
    if self.placement.is_identity and not self.is_padded:
      return tree
    target = getattr(self.shardings, which)
    return jax.jit(
      lambda t: self.pad(pipeline.to_storage(self.placement, t), which), out_shardings=target
    )(tree)

  def replicated_over_data(self) -> list[str]:
    """Paths of the params whose fp32 master copy and Adam moments are whole on every `data`
    rank (ZeRO-1 leaves them: each dim is `layers`, split by the rules, or smaller than `data`)."""
    return partitioning.replicated_over_data(self.mesh, self.shardings.params)


def _resize(x, want: jax.ShapeDtypeStruct):
  """`x` cut or zero-padded at the end of each dim to `want`'s shape, constrained to its
  sharding; `x` itself when the shapes agree."""
  if tuple(x.shape) == tuple(want.shape):
    return x
  x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, want.shape))]
  x = jnp.pad(x, [(0, max(b - a, 0)) for a, b in zip(x.shape, want.shape)])
  return jax.lax.with_sharding_constraint(x, want.sharding)


def describe_zero(layout: StateLayout) -> str:
  """The start-up log's line on ZeRO: the stage, how the state is split over `data` (its groups
  under hybrid sharding), what is padded, and every tensor left whole on each `data` rank."""
  data, copies = layout.mesh.shape['data'], layout.mesh.shape.get('replica', 1)
  stage = f'ZeRO-{layout.zero_stage}'
  if data == 1:
    if copies > 1:
      return f'> {stage}: mesh.zero_group is 1, each of the {copies} data ranks holds all the state'
    return f'> {stage}: mesh.data is 1, nothing to split'
  padded = [
    jax.tree_util.keystr(path)
    for (path, a), b in zip(
      jax.tree_util.tree_flatten_with_path(layout.abstract.params)[0],
      jax.tree.leaves(layout.logical.params),
    )
    if a.shape != b.shape
  ]
  whole = layout.replicated_over_data()
  what = (
    'fp32 params, Adam moments and the compute copy (each layer gathered where it is used)'
    if layout.zero_stage == 3
    else 'fp32 params and Adam moments'
  )
  where = f'data={data}' if copies == 1 else f'data groups of {data} ({copies} copies)'
  return (
    f'> {stage}: {what} split over {where}; '
    f'{len(padded)} tensor(s) padded to a multiple of {data}'
    f'{" (" + ", ".join(padded) + ")" if padded else ""}; replicated over data: '
    f'{", ".join(whole) if whole else "none"}'
  )


def _init_boxed(model: model_lib.Transformer, rng) -> Any:
  # Initialisation needs no activation constraints: the output shardings place the params. Nor a
  # fused attention kernel (none has params): 'xla' runs on whatever devices this process has,
  # while the step may be compiled for others (`plan --gpu`: Mosaic kernels for a GPU on a CPU).
  cfg = dataclasses.replace(model.cfg, attention_impl='xla')
  return model.clone(mesh=None, cfg=cfg).init(rng, jnp.zeros((1, 8), jnp.int32))['params']


def _abstract_state(mesh, optimizer, shapes, param_shardings) -> TrainState:
  """ShapeDtypeStructs for params of these shapes and shardings, and their Adam state."""
  abstract_opt = jax.eval_shape(optimizer.init, shapes)
  replicated = NamedSharding(mesh, P())
  # Adam moments take their parameter's ZeRO sharding; scalars (the step count) are replicated.
  opt_shardings = optim.state_shardings(optimizer, abstract_opt, param_shardings, replicated)
  with_sharding = lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
  return TrainState(
    params=jax.tree.map(with_sharding, shapes, param_shardings),
    opt_state=jax.tree.map(with_sharding, abstract_opt, opt_shardings),
  )


def make_layout(cfg: Config, mesh: Mesh) -> StateLayout:
  model = model_lib.Transformer(cfg.model, cfg.padded_vocab_size, mesh)
  placement = pipeline.placement_for(cfg)
  boxed = jax.eval_shape(lambda: _init_boxed(model, jax.random.PRNGKey(0)))
  names = model_lib.param_logical_names(boxed)
  canonical_shapes = nn.unbox(boxed)
  shapes = jax.tree_util.tree_map_with_path(
    lambda path, s: jax.ShapeDtypeStruct(pipeline.storage_shape(placement, path, s.shape), s.dtype),
    canonical_shapes,
  )
  fp32_state = optim.fp32_state_params(cfg.model)
  optimizer = optim.make_optimizer(cfg.optimizer, shapes, fp32_state)
  shape_of = lambda tree: jax.tree.map(lambda s: s.shape, tree)
  # 8-bit moments' blocks are whole in every shard: ZeRO splits around them.
  blocks = optim.split_blocks(cfg.optimizer, shapes, fp32_state)
  splits = partitioning.tree_zero_splits(mesh, names, shape_of(shapes), blocks)
  is_split = lambda x: isinstance(x, partitioning.ZeroSplit)
  zero = jax.tree.map(lambda z: NamedSharding(mesh, z.spec), splits, is_leaf=is_split)
  padded_shapes = jax.tree.map(
    lambda s, z: jax.ShapeDtypeStruct(z.padded_shape, s.dtype), shapes, splits, is_leaf=is_split
  )
  abstract = _abstract_state(mesh, optimizer, padded_shapes, zero)
  optim.check_moments_split(cfg.optimizer, abstract.opt_state, zero)
  logical = _abstract_state(mesh, optimizer, shapes, zero)
  # Checkpoints hold the true shapes, split over as much of `data` as divides them (a brief
  # copy, while saving or restoring).
  canonical = _abstract_state(
    mesh,
    optimizer,
    canonical_shapes,
    partitioning.tree_checkpoint_shardings(mesh, names, shape_of(canonical_shapes), blocks),
  )
  compute = partitioning.tree_shardings(mesh, names, shape_of(shapes), zero=False)
  if cfg.mesh.zero_stage == 3:
    spec_of = lambda tree: jax.tree.map(lambda s: s.spec, tree)
    gathers = partitioning.WeightGathers(mesh, spec_of(compute), spec_of(zero))
    model = model.clone(gathers=gathers)
  return StateLayout(
    mesh,
    model,
    optimizer,
    placement,
    names,
    abstract,
    canonical,
    compute,
    logical,
    cfg.mesh.zero_stage,
  )
