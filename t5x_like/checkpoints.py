"""Orbax checkpoints that restore onto any mesh.

A checkpoint root (`WORKDIR/checkpoints`) holds one directory per saved iteration, each with items
  params     fp32 params in the canonical, mesh-independent layout ([L, ...] stacked layers)
  opt_state  the optax state (Adam moments and the Adam step count)
  progress   JSON: iteration, consumed samples/tokens, skipped/nan counters
  config     JSON: the resolved config of the run that saved it
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted
save is never picked up by a restore. Restoring passes the *target* shardings (of whatever mesh the
new run uses), so TensorStore reads each device's slice directly: no conversion step.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like.config import Config, ConfigError
from t5x_like.train_state import Progress, StateLayout, TrainState

ITEMS = ('params', 'opt_state', 'progress', 'config')
# Model fields that decide parameter shapes; a checkpoint must agree on all of them.
SHAPE_FIELDS = ('architecture', 'num_layers', 'hidden_size', 'num_heads', 'ffn_size',
                'vocab_size', 'max_position_embeddings')


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used, with the reason and the fix."""


def _manager(root: str, *, save_interval: int = 0, max_to_keep: int | None = None,
             read_only: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=not read_only,
      read_only=read_only,
      cleanup_tmp_directories=not read_only,
      enable_async_checkpointing=not read_only,
  )
  return ocp.CheckpointManager(os.path.abspath(root), options=options, item_names=ITEMS)


def resolve(path: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoint root, step) for a run's checkpoint root or one step's directory inside it."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(f'checkpoint path {path} does not exist; pass a run\'s '
                          'WORKDIR/checkpoints directory or one step directory inside it')
  if os.path.isdir(os.path.join(path, 'params')) and os.path.basename(path).isdigit():
    root, own_step = os.path.dirname(path), int(os.path.basename(path))
    if step is not None and step != own_step:
      raise CheckpointError(f'{path} is step {own_step}, but step {step} was asked for')
    return root, own_step
  steps = available_steps(path)
  if not steps:
    raise CheckpointError(f'{path} holds no complete checkpoint (no step directory with params); '
                          'point at a checkpoint root written by t5x_like or by `ckpt import-hf`')
  if step is None:
    return path, steps[-1]
  if step not in steps:
    raise CheckpointError(f'step {step} is not in {path}; available steps: {steps}')
  return path, step


def available_steps(root: str) -> list[int]:
  """Completed steps only: Orbax's temporary directories of unfinished saves are not digits."""
  if not os.path.isdir(root):
    return []
  return sorted(int(d) for d in os.listdir(root)
                if d.isdigit() and os.path.isdir(os.path.join(root, d, 'params')))


def read_config(path: str, step: int | None = None) -> Config:
  root, step = resolve(path, step)
  config_file = os.path.join(root, str(step), 'config', 'metadata')
  if not os.path.exists(config_file):
    raise CheckpointError(f'{os.path.join(root, str(step))} has no config item; it was not '
                          'written by t5x_like')
  with open(config_file) as f:
    return Config.from_dict(json.load(f))


def check_compatible(saved: Config, wanted: Config, what: str) -> None:
  """One clear error, before any compilation, when parameter shapes would not match."""
  diffs = []
  for field in SHAPE_FIELDS:
    a, b = getattr(saved.model, field), getattr(wanted.model, field)
    if a != b:
      diffs.append(f'model.{field}: checkpoint {a!r} vs config {b!r}')
  if diffs:
    raise ConfigError(f'{what} has a different model shape: ' + '; '.join(diffs) +
                      '. Use a checkpoint of this model, or set these keys to the checkpoint\'s.')


class Checkpointer:
  """Saves a run's state every `save_interval` iterations and restores the latest one."""

  def __init__(self, root: str, save_interval: int, max_to_keep: int):
    self.root = os.path.abspath(root)
    self.save_interval = save_interval
    self._mgr = _manager(self.root, max_to_keep=max_to_keep)

  def latest_step(self) -> int | None:
    steps = available_steps(self.root)
    return steps[-1] if steps else None

  def should_save(self, iteration: int) -> bool:
    return self.save_interval > 0 and iteration % self.save_interval == 0

  def save(self, state: TrainState, progress: Progress, config: Config) -> None:
    step = progress.iteration
    if step in available_steps(self.root):
      return
    self._mgr.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        opt_state=ocp.args.StandardSave(state.opt_state),
        progress=ocp.args.JsonSave(dataclasses.asdict(progress)),
        config=ocp.args.JsonSave(config.to_dict()),
    ))

  def wait(self) -> None:
    self._mgr.wait_until_finished()

  def close(self) -> None:
    self._mgr.wait_until_finished()
    self._mgr.close()


def restore(path: str, layout: StateLayout, config: Config, step: int | None = None,
            load_optimizer: bool = True) -> tuple[TrainState, Progress]:
  """Restores params (and optimizer state) straight into `layout`'s shardings."""
  root, step = resolve(path, step)
  saved = read_config(root, step)
  check_compatible(saved, config, f'checkpoint {os.path.join(root, str(step))}')
  has_opt = os.path.isdir(os.path.join(root, str(step), 'opt_state'))
  if load_optimizer and not has_opt:
    raise CheckpointError(f'{os.path.join(root, str(step))} has no optimizer state (e.g. made by '
                          '`ckpt import-hf`); start from it with checkpoint.init_from instead')
  items = {'params': _restore_arg(layout.abstract.params, saved, config),
           'progress': ocp.args.JsonRestore()}
  if load_optimizer:
    items['opt_state'] = _restore_arg(layout.abstract.opt_state, saved, config)
  mgr = _manager(root, read_only=True)
  try:
    restored = mgr.restore(step, args=ocp.args.Composite(**items))
  except (ValueError, FileNotFoundError, KeyError) as e:
    raise CheckpointError(f'cannot restore {os.path.join(root, str(step))}: {e}') from None
  finally:
    mgr.close()
  params = _fit_vocab(restored['params'], layout.abstract.params)
  opt_state = (_fit_vocab(restored['opt_state'], layout.abstract.opt_state) if load_optimizer
               else layout.fresh_opt_state(params))
  progress = Progress(**restored['progress'])
  return TrainState(params, opt_state), progress


def restore_params(path: str, layout: StateLayout, config: Config, step: int | None = None):
  """Weights only (for checkpoint.init_from, evaluation and export)."""
  root, step = resolve(path, step)
  saved = read_config(root, step)
  check_compatible(saved, config, f'checkpoint {os.path.join(root, str(step))}')
  mgr = _manager(root, read_only=True)
  try:
    restored = mgr.restore(step, args=ocp.args.Composite(
        params=_restore_arg(layout.abstract.params, saved, config)))
  except (ValueError, FileNotFoundError, KeyError) as e:
    raise CheckpointError(f'cannot restore {os.path.join(root, str(step))}: {e}') from None
  finally:
    mgr.close()
  return _fit_vocab(restored['params'], layout.abstract.params)


def save_params(root: str, params, config: Config, step: int = 0) -> None:
  """A weights-only checkpoint (no optimizer state), e.g. from `ckpt import-hf`."""
  if available_steps(root):
    raise CheckpointError(f'{root} already holds checkpoints; choose an empty output directory')
  mgr = _manager(root)
  mgr.save(step, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      progress=ocp.args.JsonSave(dataclasses.asdict(Progress())),
      config=ocp.args.JsonSave(config.to_dict()),
  ))
  mgr.wait_until_finished()
  mgr.close()


# ------------------------------------------------------------------ padded-vocabulary resharding
# The default vocabulary padding is a multiple of 128 x mesh.tensor, so a checkpoint saved with one
# tensor size can have a different number of padded rows than the target. The padded rows are
# masked out of the logits; restoring keeps the real rows and zero-fills or drops the padding.


def _is_embedding(path) -> bool:
  """The word embeddings and their Adam moments (the only arrays with a vocabulary dim)."""
  return any(getattr(k, 'key', None) == 'word_embeddings' for k in path)


def _restore_arg(abstract_tree, saved: Config, config: Config):
  saved_rows, rows = saved.padded_vocab_size, config.padded_vocab_size
  if saved_rows == rows:
    return ocp.args.StandardRestore(abstract_tree)

  def at_saved_rows(path, a):
    if not _is_embedding(path):
      return a
    mesh = a.sharding.mesh
    spec = P('tensor') if saved_rows % mesh.shape['tensor'] == 0 else P()
    return jax.ShapeDtypeStruct((saved_rows, a.shape[1]), a.dtype,
                                sharding=NamedSharding(mesh, spec))

  return ocp.args.StandardRestore(jax.tree_util.tree_map_with_path(at_saved_rows, abstract_tree))


def _fit_vocab(tree, abstract_tree):
  def fit(x, a):
    if x.shape == a.shape:
      return x
    rows = a.shape[0]
    resized = (x[:rows] if x.shape[0] >= rows else
               jnp.pad(x, ((0, rows - x.shape[0]), (0, 0))))
    return jax.jit(lambda y: y, out_shardings=a.sharding)(resized)

  return jax.tree.map(fit, tree, abstract_tree)
