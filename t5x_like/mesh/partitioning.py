"""Logical axis names -> mesh axes, kept as data, and the shardings derived from them.

The model names every parameter dimension and every main activation with a logical axis. This
module is the only place that says which mesh axis (`data`, `pipeline`, `tensor`) each logical
axis maps to.
Megatron tensor parallelism falls out of the rules: QKV and h->4h kernels are split on their output
dims (`heads`, `mlp`), attention-out and 4h->h on their input dims (the same names), the embedding
and the logits on `vocab`.

ZeRO-1: fp32 master params and Adam moments are additionally split over `data` on one dimension that
the rules leave unsharded (never `layers`, so the layer scan never gathers the whole stack). The
forward pass casts the params to the compute dtype and constrains them to the rule sharding (no
`data`), which all-gathers the bf16 copy, as DeepSpeed does. When `data` divides no dimension
(DP 12 or 24 against a hidden size of 14,336), the state holds that dimension padded with zeros to
a multiple of `data` (`zero_split`), as DeepSpeed pads its flat buffer; checkpoints keep the
unpadded shapes (train_state.StateLayout converts).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.config import MeshConfig
from t5x_like.errors import ConfigError

MESH_AXES = ('data', 'pipeline', 'tensor')
# Hybrid sharding (mesh.zero_group < mesh.data): `data` is one group of ranks that splits a copy
# of the state, `replica` counts the copies; the batch is split over both.
HYBRID_MESH_AXES = ('replica',) + MESH_AXES

# Logical axis -> mesh axis (None: replicated). Parameter axes first, then activation axes.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  # parameters
  ('layers', 'pipeline'),  # Stage-major layer slots: each stage holds its own (pipeline.py).
  ('vocab', ('tensor', 'pipeline')),  # Spread over every stage, not whole on the first/last.
  ('embed', None),
  ('positions', None),
  ('heads', 'tensor'),
  ('qkv', None),
  ('kv', None),
  ('mlp', 'tensor'),
  # activations
  ('batch', ('replica', 'data')),  # `replica` only exists under hybrid sharding
  ('stages', 'pipeline'),
  ('length', None),
  # The sequence dim of the residual stream under model.sequence_parallel (Megatron-LM's
  # sequence parallelism): split over the same ranks as the heads and the FFN.
  ('length_sp', 'tensor'),
  ('act_embed', None),
  ('act_heads', 'tensor'),
  ('act_mlp', 'tensor'),
  ('act_vocab', ('tensor', 'pipeline')),
)
_RULES = dict(LOGICAL_AXIS_RULES)


def logical_to_mesh(names: Sequence[str | None], mesh: Mesh | AbstractMesh | None = None) -> P:
  """PartitionSpec for a tuple of logical axis names (on `mesh`: without the axes it lacks)."""
  mesh_axes = []
  for name in names:
    if name is not None and name not in _RULES:
      raise KeyError(f'logical axis {name!r} has no rule in partitioning.LOGICAL_AXIS_RULES')
    axes = _RULES.get(name) if name else None
    if mesh is not None and axes is not None:
      kept = tuple(
        a for a in (axes if isinstance(axes, tuple) else (axes,)) if splits_here(mesh, a)
      )
      axes = None if not kept else kept[0] if len(kept) == 1 else kept
    mesh_axes.append(axes)
  return P(*mesh_axes)


def splits_here(mesh: Mesh | AbstractMesh, axis: str) -> bool:
  """Whether `axis` can split an array on `mesh`: it is one of the mesh's axes and not a manual
  one (inside a shard_map over it, as the per-copy micro-batch loop of hybrid sharding,
  `manual_mesh`, each device holds its own values along it)."""
  return axis in mesh.shape and dict(zip(mesh.axis_names, mesh.axis_types))[axis] != AxisType.Manual


def manual_mesh(mesh: Mesh, axes: Sequence[str]) -> Mesh:
  """`mesh` as seen inside a shard_map over `axes`: hybrid sharding's copies (`replica`, the
  per-copy micro-batch loop of training/step.py) or a pipeline's data ranks (`batch_axes`, its
  per-rank schedule): the same devices with `axes` manual, so that the model's constraints and
  shard_maps (which take their axes from `logical_to_mesh` and `spec_for`, dropping them) split
  over the other axes only."""
  types = tuple(
    AxisType.Manual if name in axes else kind
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
  )
  return Mesh(mesh.devices, mesh.axis_names, axis_types=types)


def batch_axes(mesh: Mesh | AbstractMesh) -> str | tuple[str, ...]:
  """The mesh axes that split a batch's rows: `data`, and `replica` under hybrid sharding."""
  return 'data' if 'replica' not in mesh.shape else ('replica', 'data')


def _axis_size(mesh: Mesh | AbstractMesh, axes) -> int:
  if axes is None:
    return 1
  axes = axes if isinstance(axes, tuple) else (axes,)
  return int(np.prod([mesh.shape[a] for a in axes]))


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh | AbstractMesh) -> P:
  """Drops trailing mesh axes from a dim until they divide it (e.g. a 250,880-row vocabulary
  over tensor 4 x pipeline 12 stays split over `tensor` only)."""
  fitted = []
  for axes, size in zip(tuple(spec) + (None,) * (len(shape) - len(spec)), shape):
    axes = axes if isinstance(axes, tuple) or axes is None else (axes,)
    # Size-1 axes split nothing; `replica` is absent from a mesh without hybrid sharding, and
    # manual inside the per-copy micro-batch loop (`manual_mesh`).
    axes = tuple(a for a in axes or () if splits_here(mesh, a) and mesh.shape[a] > 1)
    while axes and size % _axis_size(mesh, axes):
      axes = axes[:-1]
    fitted.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
  return P(*fitted)


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> P:
  """The rule spec of a tensor of this shape, fitted to what the mesh divides."""
  return fit_spec(logical_to_mesh(names), shape, mesh)


def split_units(shape: Sequence[int], block: tuple[int, int] | None) -> list[int]:
  """Each dim's length in the units a `data` split must keep whole: on `block`'s dim (dim,
  size) the 8-bit optimizer's quantisation blocks (optim.block_axes), single values elsewhere."""
  units = [int(n) for n in shape]
  if block is not None:
    units[block[0]] = units[block[0]] // block[1]
  return units


def zero_spec(
  names: Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  block: tuple[int, int] | None = None,
) -> P:
  """Rule spec plus a `data` split (ZeRO-1) on one dim that `data` divides, without padding.

  Prefers the largest dim the rules leave unsplit; otherwise splits an already tensor-split dim
  further (`('tensor', 'data')`). Never the stacked `layers` dim, and on the dim of the 8-bit
  optimizer's blocks (`block`) only if `data` divides their number, so that the params, their
  gradients and their quantised moments share one split. A tensor that `data` divides nowhere
  stays replicated over `data` (checkpoints' canonical layout; the train state pads instead,
  `zero_split`).
  """
  spec = list(spec_for(names, shape, mesh))
  data = mesh.shape['data']
  if data == 1:
    return P(*spec)
  units = split_units(shape, block)
  dims = [i for i, n in enumerate(names) if n != 'layers']
  free = [i for i in dims if spec[i] is None and units[i] % data == 0]
  if free:
    spec[max(free, key=lambda i: shape[i])] = 'data'
    return P(*spec)
  split = [
    i for i in dims if spec[i] is not None and units[i] % (_axis_size(mesh, spec[i]) * data) == 0
  ]
  if split:
    best = max(split, key=lambda i: shape[i])
    axes = spec[best] if isinstance(spec[best], tuple) else (spec[best],)
    spec[best] = axes + ('data',)
  return P(*spec)


@dataclasses.dataclass(frozen=True)
class ZeroSplit:
  """Where the train state holds one tensor: `spec` over the mesh, for an array of
  `padded_shape` (the tensor's shape with zeros appended to the `data`-split dim, or the same
  shape when nothing needs padding)."""

  spec: P
  padded_shape: tuple[int, ...]


def zero_split(
  names: Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  block: tuple[int, int] | None = None,
) -> ZeroSplit:
  """The ZeRO-1 layout of a tensor in the train state: `zero_spec` where `data` divides a dim;
  otherwise the largest dim the rules leave unsplit (never `layers`), padded with zeros up to a
  multiple of `data` and split over it (never the dim of `block`: its blocks are whole). Only a
  tensor whose every free dim is smaller than `data` (padding would more than double it) stays
  replicated over `data`."""
  shape = tuple(int(n) for n in shape)
  spec = zero_spec(names, shape, mesh, block)
  data = mesh.shape['data']
  if data == 1 or 'data' in _mesh_axes(spec):
    return ZeroSplit(spec, shape)
  entries = list(spec) + [None] * (len(shape) - len(spec))
  # A tensor-split dim is never padded: padding would move its tensor shards' boundaries, and
  # the compute copy (no padding) would then be gathered across tensor ranks too.
  free = [
    i
    for i, n in enumerate(names)
    if n != 'layers'
    and entries[i] is None
    and shape[i] >= data
    and (block is None or i != block[0])
  ]
  if not free:
    return ZeroSplit(P(*entries), shape)
  dim = max(free, key=lambda i: shape[i])
  entries[dim] = 'data'
  padded = list(shape)
  padded[dim] = -(-shape[dim] // data) * data
  return ZeroSplit(P(*entries), tuple(padded))


def checkpoint_sharding(
  names: Sequence[str | None],
  shape: Sequence[int],
  mesh: Mesh,
  block: tuple[int, int] | None = None,
) -> NamedSharding:
  """Where a tensor of the checkpoint (true, unpadded shape) lives while saved or restored:
  `zero_spec` where `data` divides a dim; otherwise split over the largest factor of `data` that
  a dim (never `layers`) still divides, on a mesh whose `data` axis is cut into that factor and
  `data_rest` (replicated), so that a DP-24 save holds hidden-size tensors split 8 ways, not whole.
  """
  spec = list(zero_spec(names, shape, mesh, block))
  data = mesh.shape['data']
  if data == 1 or 'data' in _mesh_axes(P(*spec)):
    return NamedSharding(mesh, P(*spec))
  units = split_units(shape, block)
  per_shard = lambda i: units[i] // _axis_size(mesh, spec[i])
  dims = [i for i, n in enumerate(names) if n != 'layers']
  best = max(dims, key=lambda i: (math.gcd(data, per_shard(i)), shape[i]), default=None)
  factor = math.gcd(data, per_shard(best)) if best is not None else 1
  if best is None or factor == 1:
    return NamedSharding(mesh, P(*spec))
  at = mesh.axis_names.index('data')
  shape = mesh.devices.shape
  devices = mesh.devices.reshape(shape[:at] + (factor, data // factor) + shape[at + 1 :])
  names = tuple(mesh.axis_names)
  factored = Mesh(devices, names[:at] + ('data', 'data_rest') + names[at + 1 :])
  axes = (
    () if spec[best] is None else (spec[best] if isinstance(spec[best], tuple) else (spec[best],))
  )
  spec[best] = 'data' if not axes else axes + ('data',)
  return NamedSharding(factored, P(*spec))


def tree_checkpoint_shardings(mesh: Mesh, logical_names, shapes, blocks):
  """`checkpoint_sharding` of every tensor of pytrees of logical-name tuples, shapes and blocks
  ((dim, size) or None, see `zero_spec`)."""
  return jax.tree.map(
    lambda names, shape, block: checkpoint_sharding(names, shape, mesh, block),
    logical_names,
    shapes,
    blocks,
    is_leaf=is_names,
  )


def _mesh_axes(spec: P) -> list[str]:
  return [
    a for axes in spec if axes is not None for a in (axes if isinstance(axes, tuple) else (axes,))
  ]


def is_names(x) -> bool:
  """A tuple of logical axis names (a leaf of a params' logical-names tree)."""
  return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def tree_zero_splits(mesh: Mesh, logical_names, shapes, blocks):
  """`zero_split` of every tensor of pytrees of logical-name tuples, matching shapes and blocks
  ((dim, size) or None, see `zero_spec`)."""
  return jax.tree.map(
    lambda names, shape, block: zero_split(names, shape, mesh, block),
    logical_names,
    shapes,
    blocks,
    is_leaf=is_names,
  )


def replicated_over_data(mesh: Mesh, shardings) -> list[str]:
  """Paths of a pytree of NamedShardings whose tensors are whole on every `data` rank (none when
  `data` is 1: there is one copy)."""
  if mesh.shape['data'] == 1:
    return []
  return [
    jax.tree_util.keystr(path)
    for path, sharding in jax.tree_util.tree_flatten_with_path(shardings)[0]
    if 'data' not in _mesh_axes(sharding.spec)
  ]


# The most virtual CPU devices a process creates: more take minutes to start and never make a
# real run (a mesh that big needs accelerators).
MAX_VIRTUAL_CPU_DEVICES = 4096


def check_mesh_size(num_devices: int) -> None:
  """Config-time check (no JAX backend is started): a mesh on a CPU-only machine runs on as many
  virtual devices, and more than MAX_VIRTUAL_CPU_DEVICES of them are never a real run."""
  if num_devices > MAX_VIRTUAL_CPU_DEVICES and cpu_only():
    raise ConfigError(
      f'the mesh (mesh.data x mesh.pipeline x mesh.tensor) needs {num_devices} devices, and '
      f'this machine has no accelerator: it would run on as many virtual CPU devices, and at '
      f'most {MAX_VIRTUAL_CPU_DEVICES} are allowed on CPU (creating more takes minutes and '
      'tests nothing more); use a smaller mesh, or run on GPUs'
    )


def ensure_devices(num_devices: int) -> None:
  """Makes sure `num_devices` devices exist, creating virtual CPU devices before JAX starts.

  On a CPU-only machine the mesh runs on virtual devices (as XLA_FLAGS=
  --xla_force_host_platform_device_count would give); this must happen before the backend starts.
  On GPU a mesh larger than the GPUs present is an error.
  """
  # In a multi-process run (distributed.py) each process already has its share of the devices.
  if num_devices > MAX_VIRTUAL_CPU_DEVICES and cpu_only():
    raise ConfigError(
      f'{num_devices} devices were asked for on a machine without '
      f'accelerators, and at most {MAX_VIRTUAL_CPU_DEVICES} virtual CPU devices '
      'are allowed (creating more takes minutes and tests nothing more); ask '
      'for fewer, or run on GPUs'
    )
  if (
    not backends_started()
    and not jax.distributed.is_initialized()
    and num_devices <= MAX_VIRTUAL_CPU_DEVICES
  ):
    # Also where an accelerator plugin is installed: on a machine without its accelerator
    # (jax[cuda] on a login node, the test extras) JAX falls back to the CPU, which then needs
    # the mesh's devices; where the accelerator is there, the CPU's unused devices cost nothing.
    # jax adds its flags to Config at runtime; its stubs do not declare them.
    current = jax.config.jax_num_cpu_devices  # type: ignore[attr-defined]
    if current is None or current < num_devices:
      jax.config.update('jax_num_cpu_devices', max(num_devices, 1))
  available = jax.device_count()
  if available < num_devices:
    platform = jax.devices()[0].platform
    if platform != 'cpu':
      hint = f'use a mesh of at most {available} devices or launch on more nodes'
    elif cpu_only():
      hint = 'start the process with more virtual CPU devices'
    else:
      hint = (
        'JAX found no usable accelerator and started on the CPU before the mesh could add '
        'its virtual devices; set JAX_PLATFORMS=cpu to train on the CPU'
      )
    raise ConfigError(
      f'the mesh needs {num_devices} devices but only {available} '
      f'{platform.upper()} device(s) are present; {hint}'
    )


def backends_started() -> bool:
  """Whether a JAX backend has started (after which the virtual CPU device count is fixed)."""
  from jax._src import xla_bridge

  return xla_bridge.backends_are_initialized()


def cpu_only() -> bool:
  # jax adds its flags to Config at runtime; its stubs do not declare them.
  platforms = (
    os.environ.get('JAX_PLATFORMS') or jax.config.jax_platforms or ''  # type: ignore[attr-defined]
  ).lower()
  if platforms:
    return platforms.split(',')[0] == 'cpu'
  # No explicit platform: CPU only when no accelerator plugin is installed.
  import importlib.util

  return not any(
    importlib.util.find_spec(m)
    for m in ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm_plugin', 'libtpu')
  )


# ZeRO-3's gathered weights are named so that no remat policy keeps them for the backward pass:
# it gathers them again, and the peak holds about one layer's.
GATHERED_WEIGHTS = 'gathered_weights'


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather_for_use(x, gathered: NamedSharding, split: NamedSharding):
  """ZeRO-3: `x`, a compute-dtype weight split over `data`, in its rule sharding `gathered` (an
  all-gather over `data`); its gradient back in `split` (a reduce-scatter), so that neither the
  gathered weight nor its full gradient outlives its use."""
  del split
  return jax.lax.with_sharding_constraint(x, gathered)


def _gather_forward(x, gathered, split):
  return gather_for_use(x, gathered, split), None


def _gather_backward(gathered, split, _, cotangent):
  del gathered
  return (jax.lax.with_sharding_constraint(cotangent, split),)


gather_for_use.defvjp(_gather_forward, _gather_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gradient_in(x, sharding: NamedSharding):
  """`x` itself; its gradient constrained to `sharding`."""
  del sharding
  return x


def _gradient_in_forward(x, sharding):
  return x, None


def _gradient_in_backward(sharding, _, cotangent):
  return (jax.lax.with_sharding_constraint(cotangent, sharding),)


gradient_in.defvjp(_gradient_in_forward, _gradient_in_backward)


def lookup_table(table, mesh: Mesh):
  """The [vocab, embed] token table about to be looked up (its gradient a scatter-add): inside
  the per-copy micro-batch loop of hybrid sharding (`manual_mesh`), where the rules split the
  table (over `tensor`), with its gradient summed over the batch in the table's own layout before
  the ZeRO split; `table` itself elsewhere. Under a manual `replica` XLA's partitioner aborts
  (spmd_partitioner_util.cc, ExpandDeviceGroupsWithIota) on that scatter-add when its result is
  wanted split over `data` and `tensor` (the ZeRO layout) straight away."""
  spec = spec_for(('vocab', 'embed'), table.shape, mesh)
  if AxisType.Manual not in mesh.axis_types or all(axes is None for axes in spec):
    return table
  return gradient_in(table, NamedSharding(mesh, spec))


class WeightGathers:
  """ZeRO-3's per-use gathers of a model's params: for every param its rule sharding (without
  the `data` split) and its ZeRO sharding, those of the stacked `layers` for one layer (without
  the leading layer dim, which the layer scan indexes). Built by train_state.make_layout from
  the state's shardings; the model calls it on the params it is about to use."""

  def __init__(self, mesh: Mesh, gathered_specs, split_specs):
    per_layer = lambda spec: P(*tuple(spec)[1:])
    to_sharding = lambda tree, layer: jax.tree.map(
      lambda spec: NamedSharding(mesh, per_layer(spec) if layer else spec),
      tree,
      is_leaf=lambda x: isinstance(x, P),
    )
    split_out = lambda tree: (
      to_sharding({k: v for k, v in tree.items() if k != 'layers'}, False),
      to_sharding(tree['layers'], True),
    )
    self.mesh, self.specs = mesh, (gathered_specs, split_specs)
    (self.top_gathered, self.layer_gathered) = split_out(gathered_specs)
    (self.top_split, self.layer_split) = split_out(split_specs)

  def on(self, mesh: Mesh) -> WeightGathers:
    """The same gathers on `mesh` (the same devices and axes, e.g. `manual_mesh`'s)."""
    return WeightGathers(mesh, *self.specs)

  def top(self, tree: dict) -> dict:
    """Params outside the layer stack (a dict of some of the model's top-level entries),
    gathered for use."""
    return {
      key: self._gather(value, self.top_gathered[key], self.top_split[key])
      for key, value in tree.items()
    }

  def layer(self, tree):
    """One layer's params (a slice of the `layers` stack), gathered for use."""
    return self._gather(tree, self.layer_gathered, self.layer_split)

  @staticmethod
  def _gather(tree, gathered, split):
    return jax.tree.map(
      lambda x, g, s: checkpoint_name(gather_for_use(x, g, s), GATHERED_WEIGHTS),
      tree,
      gathered,
      split,
    )


def never_save(names: Sequence[str], policy=None):
  """A remat policy: `policy`'s choice (None: save everything) except the values named `names`
  (jax.ad_checkpoint.checkpoint_name), which the backward pass computes again. (Not jax's
  `save_anything_except_these_names`, which in jax 0.10.2 saves everything, named or not.)"""
  excluded = frozenset(names)

  def saveable(prim, *args, **params) -> bool:
    if prim.name == 'name' and params.get('name') in excluded:  # checkpoint_name's primitive
      return False
    return True if policy is None else bool(policy(prim, *args, **params))

  return saveable


def make_mesh(data: int, pipeline: int, tensor: int, devices=None, zero_group: int = 0) -> Mesh:
  """A `data x pipeline x tensor` mesh of `devices` (this process's by default: virtual CPU ones
  made as needed); `tensor` is innermost so it stays within a node. With
  0 < zero_group < data (hybrid sharding), `data` is cut into `replica` (data // zero_group
  copies of the state) x `data` (the zero_group consecutive ranks that split one copy)."""
  if devices is None:
    ensure_devices(data * pipeline * tensor)
    devices = jax.devices()
  devices = np.asarray(devices[: data * pipeline * tensor]).reshape(data, pipeline, tensor)
  if 0 < zero_group < data:
    devices = devices.reshape(data // zero_group, zero_group, pipeline, tensor)
    return Mesh(devices, HYBRID_MESH_AXES)
  return Mesh(devices, MESH_AXES)


def mesh_of(cfg: MeshConfig) -> Mesh:
  """The mesh of a config's `mesh` section (hybrid under mesh.zero_group)."""
  return make_mesh(cfg.data, cfg.pipeline, cfg.tensor, zero_group=cfg.zero_group)


def named(mesh: Mesh, spec: P) -> NamedSharding:
  return NamedSharding(mesh, spec)


def tree_shardings(mesh: Mesh, logical_names, shapes, zero: bool):
  """NamedShardings for a pytree of logical-name tuples and a matching pytree of shapes."""

  def one(names, shape):
    spec = zero_spec(names, shape, mesh) if zero else spec_for(names, shape, mesh)
    return NamedSharding(mesh, spec)

  return jax.tree.map(one, logical_names, shapes, is_leaf=is_names)


@dataclasses.dataclass(frozen=True)
class ReplicaMismatch:
  """A replicated array whose copies differ, and the processes that hold the differing copies:
  those whose copy is not the one most processes hold (ties: process 0's side), and those whose
  own devices disagree."""

  path: str
  processes: tuple[int, ...]


# Per distinct shard of a replicated array, each process contributes one fixed-size row to the
# all-gather: [holds a copy, its local copies differ, 128-bit digest as 4 uint32]. uint32 because
# JAX's default integer width is 32 bits: uint64 would be truncated without jax_enable_x64.
_DIGEST_WORDS = 4
_ROW = 2 + _DIGEST_WORDS


def _digest(data: np.ndarray) -> np.ndarray:
  """The copy's bytes hashed: equal bytes, equal digest (stricter than ==, which equates -0 and 0
  and never equates NaNs)."""
  contiguous = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
  raw = hashlib.blake2b(contiguous.data, digest_size=4 * _DIGEST_WORDS).digest()
  return np.frombuffer(raw, np.uint32)


def _replicated_slots(tree):
  """[(path, array, {shard index repr: its position})] of the arrays with copies somewhere in
  the job. Derived from the global shardings, so every process lists the same slots in the same
  order (its all-gather must match the others' or they hang)."""
  slots = []
  for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]:
    index_map = array.sharding.devices_indices_map(array.shape)
    ordered = dict.fromkeys(repr(index_map[d]) for d in sorted(index_map, key=lambda d: d.id))
    if len(ordered) < len(index_map):  # a slice held by one device has nothing to differ from
      slots.append((jax.tree_util.keystr(path), array, {key: i for i, key in enumerate(ordered)}))
  return slots


def replica_report(tree) -> list[ReplicaMismatch]:
  """The replicated arrays of `tree` whose copies differ, on this process's devices or across
  processes (a replicated LayerNorm that drifted apart across tensor ranks, as in the
  chronicles). Each process digests the copies it holds per distinct shard; one all-gather of
  the digests gives every process the same table and so the same verdict. A collective: every
  process of the job must call it with the same tree structure and shardings."""
  slots = _replicated_slots(tree)
  rows = np.zeros((sum(len(indices) for _, _, indices in slots), _ROW), np.uint32)
  row = 0
  for _, array, indices in slots:
    digests: dict[str, np.ndarray] = {}
    for shard in array.addressable_shards:
      key, digest = repr(shard.index), _digest(np.asarray(shard.data))
      at = row + indices[key]
      if key in digests:
        if not np.array_equal(digests[key], digest):
          rows[at, 1] = 1
      else:
        digests[key] = digest
        rows[at, 0] = 1
        rows[at, 2:] = digest
    row += len(indices)
  if jax.process_count() > 1 and len(rows):
    from jax.experimental import multihost_utils

    everyone = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, *rows.shape)
  else:
    everyone = rows[None]
  bad, row = [], 0
  for path, _, indices in slots:
    processes: set[int] = set()
    for table in everyone[:, row : row + len(indices)].transpose(1, 0, 2):  # one shard index
      holders = [p for p in range(len(table)) if table[p, 0]]
      processes.update(p for p in holders if table[p, 1])
      copies = [tuple(table[p, 2:]) for p in holders]
      # The most common copy is taken as the right one; max() keeps the first on a tie.
      common = max(copies, key=copies.count)
      processes.update(p for p, d in zip(holders, copies) if d != common)
    row += len(indices)
    if processes:
      bad.append(ReplicaMismatch(path, tuple(sorted(processes))))
  return bad


def replica_mismatches(tree) -> list[str]:
  """Paths of the replicated arrays of `tree` whose copies differ (`replica_report`)."""
  return [mismatch.path for mismatch in replica_report(tree)]
