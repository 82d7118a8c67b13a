"""Orbax checkpoints that restore onto any mesh.

A checkpoint root (`WORKDIR/checkpoints`) holds one directory per saved iteration, each with items
  params     fp32 params in the canonical, mesh-independent layout ([L, ...] stacked layers)
  opt_state  the optax state (Adam moments and the Adam step count)
  progress   JSON: iteration, consumed samples/tokens, skipped/nan counters
  config     JSON: the resolved config of the run that saved it
  meta       JSON: RNG state (dropout seed; the key of iteration i is fold_in(PRNGKey(seed), i)),
             data position (data seed, consumed samples), the learning-rate schedule, and the
             iteration/skipped counts at which the Adam step count last started from 0, and
             the software that wrote it (Python, jax, flax, optax, orbax... versions, git commit),
             and the steps kept past the keep policy (the last checkpoint before each spike)
Orbax writes each step into `N.orbax-checkpoint-tmp` and renames it to `N` when every item is
complete, so an interrupted save is never picked up by a restore; leftovers are removed when the
next run opens the root. Steps dropped by the keep policy are first renamed into `.deleted/` (one
atomic rename) and removed from there, so a crash mid-deletion never leaves a half step either.
Restoring passes the *target* shardings (of whatever mesh the new run uses), so TensorStore reads
each device's slice directly: no conversion step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.checkpointing import provenance
from t5x_like.config import Config, ConfigError, with_values_before_keys
from t5x_like.parallel.train_state import Progress, StateLayout, TrainState

ITEMS = ('params', 'opt_state', 'progress', 'config', 'meta')
# Items every complete step has (weights-only checkpoints have no opt_state).
REQUIRED_ITEMS = ('params', 'progress', 'config')
DELETED_SUBDIR = '.deleted'
DAMAGED_SUBDIR = '.damaged'  # incomplete steps found at start-up, moved aside
ROLLED_BACK_SUBDIR = '.rolled_back'  # the steps after a rollback's (`roll_back`)
TMP_MARKER = '.orbax-checkpoint-tmp'  # in the name of a step directory still being written
# Model fields that decide parameter shapes; a checkpoint must agree on all of them.
# The model keys that decide the parameters' shapes, by the key a user sets (the FFN width by
# its effective size: ffn_hidden_size 0 is 4 * hidden_size).
SHAPE_FIELDS = {
  'architecture': 'architecture',
  'num_layers': 'num_layers',
  'hidden_size': 'hidden_size',
  'num_heads': 'num_heads',
  'ffn_hidden_size': 'ffn_size',
  'vocab_size': 'vocab_size',
}
# Only GPT-2 has learned positions, and an embedding LayerNorm only under stable_embedding.
GPT2_SHAPE_FIELDS = {
  'max_position_embeddings': 'max_position_embeddings',
  'stable_embedding': 'stable_embedding',
}
# Megatron's AnnealingLR checks these against the checkpoint's unless --override-lr-scheduler.
LR_SCHEDULE_FIELDS = (
  'lr',
  'min_lr',
  'warmup_samples',
  'decay_samples',
  'decay_style',
  'decay_tokens',
)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used, with the reason and the fix."""


class SaveError(RuntimeError):
  """A checkpoint that could not be written (a full disk, a permission error): the run stops
  (exit 1); the checkpoints saved before it are intact."""


class NonFiniteStateError(RuntimeError):
  """A save refused because the params hold non-finite values: such a state is never written."""


@jax.jit
def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def all_finite(tree) -> bool:
  """Whether every value of every array of `tree` is finite (one reduction on the devices)."""
  return bool(_all_finite(tree))


@dataclasses.dataclass
class _KeptSteps:
  """Orbax preservation policy: the steps in `steps` (a set the Checkpointer adds to while the
  run goes on: the checkpoints from before a spike)."""

  steps: set[int]

  def should_preserve(self, checkpoints, *, context):
    del context
    return [c.step in self.steps for c in checkpoints]


@dataclasses.dataclass
class _LatestOrdinary:
  """Orbax preservation policy: the latest `n` steps not in `temporary` (the timed saves, a set
  the Checkpointer adds to), and the newest step whatever it is. A timed save is kept until the
  next save lands, and never pushes an ordinary step out."""

  n: int
  temporary: set[int]

  def should_preserve(self, checkpoints, *, context):
    del context
    steps = [c.step for c in checkpoints]
    ordinary = sorted(s for s in steps if s not in self.temporary)
    keep = set(ordinary[-self.n :]) | set(sorted(steps)[-1:])
    return [c.step in keep for c in checkpoints]


def _manager(
  root: str,
  *,
  max_to_keep: int | None = None,
  keep_period: int = 0,
  kept_steps: set[int] | None = None,
  temporary_steps: set[int] | None = None,
  read_only: bool = False,
) -> ocp.CheckpointManager:
  policy = None
  if not read_only and max_to_keep:
    temporary = set() if temporary_steps is None else temporary_steps  # the caller adds to it
    policies: list[Any] = [_LatestOrdinary(max_to_keep, temporary)]
    if keep_period:
      policies.append(ocp.checkpoint_managers.EveryNSteps(interval_steps=keep_period))
    if kept_steps is not None:
      policies.append(_KeptSteps(kept_steps))
    policy = ocp.checkpoint_managers.AnyPreservationPolicy(policies)
  options = ocp.CheckpointManagerOptions(
    preservation_policy=policy,
    save_interval_steps=0 if read_only else 1,
    create=not read_only,
    read_only=read_only,
    cleanup_tmp_directories=not read_only,
    enable_async_checkpointing=not read_only,
    todelete_subdir=None if read_only else DELETED_SUBDIR,
  )
  # Orbax warns that a read-only manager is read-only; a restore is no reason for a warning.
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.setLevel(logging.ERROR if read_only else level)
  try:
    return ocp.CheckpointManager(os.path.abspath(root), options=options, item_names=ITEMS)
  finally:
    absl_logger.setLevel(level)


def resolve(path: str, step: int | None = None) -> tuple[str, int]:
  """(checkpoint root, step) for a run's checkpoint root or one step's directory inside it."""
  path = os.path.abspath(path)
  if not os.path.isdir(path):
    raise CheckpointError(
      f'checkpoint path {path} '
      + ('is a file, not a checkpoint directory' if os.path.exists(path) else 'does not exist')
      + "; pass a run's WORKDIR/checkpoints directory or one step directory inside it"
    )
  if os.path.basename(path).isdigit() and _is_step_dir(path):
    root, own_step = os.path.dirname(path), int(os.path.basename(path))
    problem = step_problem(path)
    if problem is not None:
      raise CheckpointError(f'{path} is an incomplete checkpoint ({problem}); use another step')
    if step is not None and step != own_step:
      raise CheckpointError(f'{path} is step {own_step}, but step {step} was asked for')
    return root, own_step
  steps, damaged = scan_steps(path)
  if step is None:
    # The latest step directory, when it is damaged, is named rather than silently passed over.
    if damaged and (not steps or max(damaged) > steps[-1]):
      latest = max(damaged)
      raise CheckpointError(
        f'{os.path.join(path, str(latest))} is damaged: {damaged[latest]}. '
        f'Complete steps: {steps}; pass --step to use one of them (a '
        'training run moves the damaged step aside and resumes from the '
        'latest complete one)'
      )
  if not steps:
    raise CheckpointError(
      f'{path} holds no complete checkpoint (no step directory with '
      f'{", ".join(REQUIRED_ITEMS)}); point at a checkpoint root written by '
      't5x_like (WORKDIR/checkpoints) or by `ckpt import-hf`, or at one '
      'step in it'
    )
  if step is None:
    return path, steps[-1]
  if step not in steps:
    raise CheckpointError(f'step {step} is not in {path}; available steps: {steps}')
  return path, step


def _is_step_dir(path: str) -> bool:
  return any(os.path.isdir(os.path.join(path, item)) for item in ITEMS)


def _missing_items(path: str) -> list[str]:
  return [item for item in REQUIRED_ITEMS if not os.path.isdir(os.path.join(path, item))]


# Orbax's per-step record of the items it saved, and each item's own metadata file.
STEP_METADATA = '_CHECKPOINT_METADATA'
ITEM_METADATA = {
  'params': '_METADATA',
  'opt_state': '_METADATA',
  'progress': 'metadata',
  'config': 'metadata',
  'meta': 'metadata',
}


def _read_json_file(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def step_problem(step_dir: str) -> str | None:
  """Why a step directory is not a complete checkpoint, or None when it is: every item Orbax
  recorded for the step (and every required one) is present and its metadata readable. Reads
  metadata only, no tensor."""
  missing = _missing_items(step_dir)
  if missing:
    return f'missing {", ".join(missing)}'
  try:
    saved_items = _read_json_file(os.path.join(step_dir, STEP_METADATA))['item_handlers']
  except (OSError, ValueError, KeyError, TypeError) as e:
    return f'its {STEP_METADATA} cannot be read ({type(e).__name__}: {e})'
  for item in sorted(set(saved_items) | set(REQUIRED_ITEMS)):
    metadata = os.path.join(step_dir, item, ITEM_METADATA.get(item, 'metadata'))
    if not os.path.isdir(os.path.join(step_dir, item)):
      return f'missing {item}'
    try:
      _read_json_file(metadata)
    except (OSError, ValueError) as e:
      return f'the metadata of its {item} item cannot be read ({type(e).__name__}: {e})'
  return None


def step_dirs(root: str) -> list[int]:
  """Every step directory's step, complete or not (Orbax's temporary directories of unfinished
  saves are not digits)."""
  if not os.path.isdir(root):
    return []
  return sorted(
    int(d) for d in os.listdir(root) if d.isdigit() and os.path.isdir(os.path.join(root, d))
  )


def scan_steps(root: str) -> tuple[list[int], dict[int, str]]:
  """(complete steps, {damaged step: what is wrong}): every step directory checked once."""
  problems = {s: step_problem(os.path.join(root, str(s))) for s in step_dirs(root)}
  return (
    [s for s, p in problems.items() if p is None],
    {s: p for s, p in problems.items() if p is not None},
  )


def available_steps(root: str) -> list[int]:
  """Complete steps only (`step_problem`)."""
  return scan_steps(root)[0]


def damaged_steps(root: str) -> dict[int, str]:
  """{step: what is wrong} for the step directories that are not complete checkpoints."""
  return scan_steps(root)[1]


def move_damaged_aside(root: str, step: int) -> str:
  """Moves an incomplete step out of the way of restores, saves and the keep policy, to
  ROOT/.damaged/STEP-TIME (never deleted: what is left of it may still matter to someone)."""
  target_dir = os.path.join(root, DAMAGED_SUBDIR)
  os.makedirs(target_dir, exist_ok=True)
  target = _unused_path(os.path.join(target_dir, f'{step}-{time.strftime("%Y%m%d-%H%M%S")}'))
  os.replace(os.path.join(root, str(step)), target)
  return target


def _unused_path(path: str) -> str:
  """`path`, or `path.1`, `path.2`, ...: the first that does not exist."""
  suffix = 0
  while os.path.exists(path + (f'.{suffix}' if suffix else '')):
    suffix += 1
  return path + (f'.{suffix}' if suffix else '')


def roll_back(root: str, step: int) -> tuple[list[int], str]:
  """Makes `step` (a complete one) the latest checkpoint of `root`, so that the next run resumes
  from it: every later step directory moves to ROOT/.rolled_back/TIME/ (never deleted: moving
  them back undoes it), the newest first, so the steps left are always the earliest ones.
  Returns (the steps moved, where they went)."""
  root = os.path.abspath(root)
  steps = available_steps(root)
  if step not in steps:
    raise CheckpointError(
      f'step {step} is not a complete checkpoint of {root}; its complete steps: {steps}'
    )
  later = [s for s in step_dirs(root) if s > step]
  if not later:
    raise CheckpointError(
      f'step {step} is already the latest of {root} (steps {steps}); nothing to roll back'
    )
  target = _unused_path(os.path.join(root, ROLLED_BACK_SUBDIR, time.strftime('%Y%m%d-%H%M%S')))
  os.makedirs(target)
  for s in sorted(later, reverse=True):
    os.replace(os.path.join(root, str(s)), os.path.join(target, str(s)))
  return later, target


def _read_json_item(path: str, step: int | None, item: str) -> tuple[str, dict | None]:
  """(step directory, the JSON of one item or None when the step has no such item)."""
  root, step = resolve(path, step)
  step_dir = os.path.join(root, str(step))
  item_file = os.path.join(step_dir, item, 'metadata')
  if not os.path.exists(item_file):
    return step_dir, None
  try:
    with open(item_file) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise CheckpointError(
      f'{step_dir} is damaged: its {item} item cannot be read ({e}); use another step'
    ) from None
  if raw is None:  # None is what this function returns for an absent item
    raise _damaged(step_dir, item, 'is null')
  return step_dir, raw


def _damaged(step_dir: str, item: str, problem: str) -> CheckpointError:
  return CheckpointError(
    f'{step_dir} is damaged: its {item} item {problem}; use another step '
    '(or restore the file from a copy)'
  )


def read_config(path: str, step: int | None = None) -> Config:
  step_dir, raw = _read_json_item(path, step, 'config')
  if raw is None:
    raise CheckpointError(f'{step_dir} has no config item; it was not written by t5x_like')
  if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
    raise _damaged(
      step_dir,
      'config',
      f'is a {type(raw).__name__}, not a mapping of config sections to their keys',
    )
  try:
    return Config.from_dict(with_values_before_keys(raw))
  except ConfigError as e:
    raise _damaged(step_dir, 'config', f'is not a t5x_like config ({e})') from None


# Progress keys a checkpoint must have; the others (newer counters) were 0 when it was written.
_REQUIRED_PROGRESS = ('iteration', 'consumed_samples')


def read_progress(path: str, step: int | None = None) -> Progress:
  step_dir, raw = _read_json_item(path, step, 'progress')
  if raw is None:
    raise CheckpointError(f'{step_dir} has no progress item; it was not written by t5x_like')
  if not isinstance(raw, dict):
    raise _damaged(step_dir, 'progress', f'is a {type(raw).__name__}, not a mapping of counters')
  known = [f.name for f in dataclasses.fields(Progress)]
  missing = [k for k in _REQUIRED_PROGRESS if k not in raw]
  unknown = sorted(set(raw) - set(known))
  wrong = [
    f'{k}={v!r}'
    for k, v in raw.items()
    if k in known and (not isinstance(v, int) or isinstance(v, bool) or v < 0)
  ]
  if missing or unknown or wrong:
    problem = '; '.join(
      filter(
        None,
        [
          f'lacks {", ".join(missing)}' if missing else None,
          f'has unknown keys {", ".join(unknown)}' if unknown else None,
          f'has counters that are not ints >= 0: {", ".join(wrong)}' if wrong else None,
        ],
      )
    )
    raise _damaged(step_dir, 'progress', problem)
  return Progress(**raw)


# The meta item's required entries, each a mapping with these int entries.
_META_INTS = {
  'rng': ('seed', 'iteration'),
  'data': ('seed', 'consumed_samples'),
  'adam_count_base': ('iteration', 'skipped_iterations'),
}


def _meta_problem(raw: Any) -> str | None:
  """What makes `raw` not a meta item (make_meta's shape), or None."""
  if not isinstance(raw, dict):
    return f'is a {type(raw).__name__}, not a mapping'
  for key, ints in _META_INTS.items():
    entry = raw.get(key)
    if not isinstance(entry, dict):
      return f'has no {key!r} mapping (got {entry!r})'
    for name in ints:
      value = entry.get(name)
      if not isinstance(value, int) or isinstance(value, bool):
        return f'has no int {key}.{name} (got {value!r})'
  if not isinstance(raw.get('lr_schedule'), dict):
    return f"has no 'lr_schedule' mapping (got {raw.get('lr_schedule')!r})"
  unknown = sorted(set(raw['lr_schedule']) - set(LR_SCHEDULE_FIELDS))
  if unknown:
    return f'has unknown lr_schedule keys {", ".join(unknown)}'
  for key in ('kept_steps', 'temporary_steps'):
    steps = raw.get(key, [])
    if not isinstance(steps, list) or not all(isinstance(s, int) for s in steps):
      return f'has {key} that are not a list of steps (got {steps!r})'
  lr_zero_until = raw.get('lr_zero_until', 0)
  if not isinstance(lr_zero_until, int) or isinstance(lr_zero_until, bool):
    return f'has an lr_zero_until that is not an iteration (got {lr_zero_until!r})'
  for key in ('software', 'throughput'):
    if raw.get(key) is not None and not isinstance(raw[key], dict):
      return f'has a {key} entry that is not a mapping (got {raw[key]!r})'
  return None


def lr_schedule(cfg: Config) -> dict[str, Any]:
  return {k: getattr(cfg.optimizer, k) for k in LR_SCHEDULE_FIELDS}


def saved_lr_schedule(meta: dict[str, Any]) -> dict[str, Any]:
  """The schedule a checkpoint was trained with; a field newer than the checkpoint had its
  default value then."""
  return {**lr_schedule(Config()), **meta['lr_schedule']}


def make_meta(
  cfg: Config,
  progress: Progress,
  data_seed: int,
  adam_count_base: dict[str, int],
  software: dict[str, Any] | None = None,
  kept_steps: Iterable[int] = (),
  temporary_steps: Iterable[int] = (),
  lr_zero_until: int = 0,
) -> dict[str, Any]:
  """The `meta` item: what a restart needs besides the arrays, progress and config, and the
  software that wrote it (`provenance.software()`, taken now unless given). `kept_steps`: the
  checkpoints kept past the keep policy (the last one before each loss spike);
  `temporary_steps`: the timed saves, each kept only until the next save; `lr_zero_until`: the
  last iteration of an optimizer reset's lr-0 warm-up (0: none)."""
  return {
    'software': provenance.software() if software is None else software,
    'kept_steps': sorted(kept_steps),
    'temporary_steps': sorted(temporary_steps),
    'format': 1,
    'rng': {'seed': cfg.train.seed, 'iteration': progress.iteration},
    'data': {'seed': data_seed, 'consumed_samples': progress.consumed_samples},
    'lr_schedule': lr_schedule(cfg),
    'adam_count_base': dict(adam_count_base),
    'lr_zero_until': int(lr_zero_until),
  }


def read_meta(path: str, step: int | None = None) -> dict[str, Any]:
  """The `meta` item; for checkpoints without one (weights-only), what it would say."""
  step_dir, raw = _read_json_item(path, step, 'meta')
  if raw is not None:
    problem = _meta_problem(raw)
    if problem:
      raise _damaged(step_dir, 'meta', problem)
    return raw
  cfg, progress = read_config(path, step), read_progress(path, step)
  return make_meta(
    cfg, progress, cfg.train.seed, {'iteration': 0, 'skipped_iterations': 0}, software={}
  )  # unknown: not this process's


def expected_adam_count(progress: Progress, meta: dict[str, Any]) -> int:
  """Adam steps taken since the count last started from 0: skipped iterations do not count."""
  base = meta['adam_count_base']
  return (progress.iteration - base['iteration']) - (
    progress.skipped_iterations - base['skipped_iterations']
  )


def check_lr_schedule(saved_meta: dict[str, Any], cfg: Config, what: str) -> None:
  """Megatron's AnnealingLR check: a schedule that differs from the checkpoint's is an error."""
  saved = saved_lr_schedule(saved_meta)
  diffs = [
    f'optimizer.{k}: checkpoint {saved[k]!r} vs config {getattr(cfg.optimizer, k)!r}'
    for k in LR_SCHEDULE_FIELDS
    if saved[k] != getattr(cfg.optimizer, k)
  ]
  if diffs and not cfg.checkpoint.override_lr_scheduler:
    raise ConfigError(
      f'the learning-rate schedule differs from {what}: '
      + '; '.join(diffs)
      + ". Set checkpoint.override_lr_scheduler=True to train with the config's "
      "schedule (Megatron's --override-lr-scheduler), or restore these values."
    )


def check_compatible(saved: Config, wanted: Config, what: str) -> None:
  """One clear error, before any compilation, when parameter shapes would not match."""
  diffs = []
  fields = dict(SHAPE_FIELDS)
  if saved.model.architecture == wanted.model.architecture == 'gpt2':
    fields.update(GPT2_SHAPE_FIELDS)
  for key, attribute in fields.items():
    a, b = getattr(saved.model, attribute), getattr(wanted.model, attribute)
    if a != b:
      diffs.append(f'model.{key}: checkpoint {a!r} vs config {b!r}')
  if diffs:
    raise ConfigError(
      f'{what} has a different model shape: '
      + '; '.join(diffs)
      + ". Use a checkpoint of this model, or set these keys to the checkpoint's."
    )


class _OrbaxWriterErrors(logging.Filter):
  """Counts, instead of printing, the errors that Orbax's background save threads log: a failed
  save (a full disk) otherwise prints hundreds of traceback lines, each the same failure, which
  Checkpointer reports once as a SaveError."""

  def __init__(self):
    super().__init__()
    self.count = 0
    self._logger = logging.getLogger('absl')
    self._logger.addFilter(self)
    silence_orbax_aftermath()

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.ERROR and f'{os.sep}orbax{os.sep}' in record.pathname:
      self.count += 1
      return False
    return True

  def detach(self) -> None:
    self._logger.removeFilter(self)


class _OrbaxAftermath:
  """Hides the echoes of a save or restore that already failed, for the rest of the process.

  When one write or read of a step fails, Orbax closes its event loop and leaves the others
  running: each that completes later (one per array shard: hundreds on a full disk) finds the
  loop closed, each read that fails after the first is a coroutine nobody awaits, and each write
  task that failed after the first is a Task whose exception nobody retrieves. Python prints the
  first two through sys.unraisablehook (and an uncaught error through sys.excepthook) and asyncio
  logs the third when the task is collected, in Orbax's threads, also after the SaveError or
  CheckpointError that says what went wrong was printed. They are counted here instead, and every
  other report is printed as before."""

  def __init__(self):
    self.count = 0
    self._unraisablehook = sys.unraisablehook
    self._excepthook = sys.excepthook
    sys.unraisablehook = self._on_unraisable
    sys.excepthook = self._on_uncaught
    logging.getLogger('asyncio').addFilter(self._on_asyncio_report)

  @staticmethod
  def is_echo(value: BaseException | None, source: Any = None) -> bool:
    if isinstance(value, RuntimeError) and str(value) == 'Event loop is closed':
      return True
    code = getattr(source, 'cr_code', None)  # an un-awaited coroutine of Orbax's
    return code is not None and f'{os.sep}orbax{os.sep}' in code.co_filename

  def _on_unraisable(self, unraisable) -> None:
    if self.is_echo(unraisable.exc_value, unraisable.object):
      self.count += 1
      return
    self._unraisablehook(unraisable)

  def _on_uncaught(self, kind, value, traceback) -> None:
    if self.is_echo(value):
      self.count += 1
      return
    self._excepthook(kind, value, traceback)

  def _on_asyncio_report(self, record: logging.LogRecord) -> bool:
    """False (not logged) for asyncio's report of an Orbax task, or of a future TensorStore
    failed, whose error nobody retrieved: the message names the task's coroutine and the file it
    is defined in, or the error is TensorStore's (its OCDBT database, its status codes)."""
    if record.levelno < logging.ERROR:
      return True
    message = record.getMessage()
    error = record.exc_info[1] if record.exc_info else None
    if f'{os.sep}orbax{os.sep}' in message or self.is_tensorstore_error(error):
      self.count += 1
      return False
    return True

  @staticmethod
  def is_tensorstore_error(error: BaseException | None) -> bool:
    """An error TensorStore raised reading or writing a checkpoint's OCDBT database, or one
    raised from it (Orbax's 'Encountered error while reading array index' wraps the read's)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
      seen.add(id(error))
      if 'OCDBT database' in str(error) or 'tensorstore' in type(error).__module__.lower():
        return True
      error = error.__cause__ or error.__context__
    return False


_AFTERMATH: list[_OrbaxAftermath] = []  # installed once per process, by the first save or restore


def silence_orbax_aftermath() -> _OrbaxAftermath:
  """Installs the process's _OrbaxAftermath (once) and returns it."""
  if not _AFTERMATH:
    _AFTERMATH.append(_OrbaxAftermath())
  return _AFTERMATH[0]


class Checkpointer:
  """Asynchronous saves every `save_interval` iterations under the keep policy (latest
  `max_to_keep` plus every multiple of `keep_period`, and the newest step); `close()` waits for
  the last one. A temporary save (a timed one, `save(temporary=True)`) counts as none of the
  latest `max_to_keep`: it is deleted once a later step is saved."""

  def __init__(
    self,
    root: str,
    save_interval: int,
    max_to_keep: int,
    layout: StateLayout | None = None,
    keep_period: int = 0,
    kept_steps: Iterable[int] = (),
    temporary_steps: Iterable[int] = (),
  ):
    self.root = os.path.abspath(root)
    self.save_interval = save_interval
    self.layout = layout  # converts a pipeline's storage order to the canonical [L, ...] order
    self._purger: threading.Thread | None = None
    self._in_flight: int | None = None  # the step whose files are still being written
    # A failed save makes each of Orbax's writer threads log its traceback; the SaveError says
    # it once instead.
    self._writer_errors = _OrbaxWriterErrors()
    self._save_failed = False
    if jax.process_index() == 0:
      self._discard_interrupted_saves()
    self.kept_steps = set(kept_steps)  # kept whatever the keep policy says (`keep_last_before`)
    self.temporary_steps = set(temporary_steps)  # kept until a later step is saved
    self._mgr = _manager(
      self.root,
      max_to_keep=max_to_keep,
      keep_period=keep_period,
      kept_steps=self.kept_steps,
      temporary_steps=self.temporary_steps,
    )
    self._saved = set(available_steps(self.root))
    self._purge_deleted()

  def saved_steps(self) -> list[int]:
    """The steps saved or being saved (a save in flight included), oldest first."""
    return sorted(self._saved)

  def keep_last_before(self, iteration: int) -> int | None:
    """Keeps the latest step saved before `iteration` past the keep policy (it survives later
    saves; the meta of every later checkpoint carries the list, so restarts keep it too).
    Returns that step, or None when no step before `iteration` was saved."""
    before = [s for s in self._saved if s < iteration]
    if not before:
      return None
    self.kept_steps.add(max(before))
    return max(before)

  def should_save(self, iteration: int) -> bool:
    return self.save_interval > 0 and iteration % self.save_interval == 0

  def settle_temporary_steps(self) -> set[int]:
    """Waits for the save in flight (and the deletions it triggers), then forgets the timed
    saves no longer on disk: the keep policy and the next meta list only those still there, so
    the list stays a few steps long over a run of months. Returns them."""
    self.wait()
    self.temporary_steps.intersection_update(step_dirs(self.root))  # the policy holds this set
    return set(self.temporary_steps)

  def save(
    self,
    state: TrainState,
    progress: Progress,
    config: Config,
    meta: dict[str, Any],
    temporary: bool = False,
  ) -> bool:
    """Starts saving `state` as step `progress.iteration`; False if that step is already saved.
    A `temporary` step is deleted once a later one is saved (`meta` lists it so for restarts).

    Returns once the arrays are copied off the devices (the step may donate them next); the
    files are written in the background and the step becomes visible when all of them are.
    """
    step = progress.iteration
    if step in self._saved:
      return False
    if not all_finite(state.params):
      raise NonFiniteStateError(
        f'checkpoint {step} not saved: the params hold non-finite values (inf or NaN); a '
        f'checkpoint never holds them. The latest checkpoint, '
        f'{max(self._saved) if self._saved else "none"}, is unchanged'
      )
    self.wait()  # the previous save, and the deletions it triggered
    self._purge_deleted()
    if temporary:
      self.temporary_steps.add(step)
    params, opt_state = state.params, state.opt_state
    if self.layout is not None:
      params = self.layout.to_canonical(params, 'params')
      opt_state = self.layout.to_canonical(opt_state, 'opt_state')
    try:
      self._mgr.save(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          opt_state=ocp.args.StandardSave(opt_state),
          progress=ocp.args.JsonSave(dataclasses.asdict(progress)),
          config=ocp.args.JsonSave(config.to_dict()),
          meta=ocp.args.JsonSave(meta),
        ),
      )
    except Exception as e:  # pylint: disable=broad-except
      # Whatever the save started in the background must end before the process does.
      self._wait_quietly()
      self._close_quietly()
      raise self._save_error(step, e) from None
    self._saved.add(step)
    self._in_flight = step
    return True

  def _save_error(self, step: int | None, error: BaseException) -> SaveError:
    self._save_failed = True
    complete = [s for s in available_steps(self.root) if s != step]
    others = self._writer_errors.count
    # TensorStore names the operating system's error (no space left, file too large, permission
    # denied) deep inside a long line; it is what the user needs first.
    os_error = re.search(r'Failed to \w+ \d+ bytes to file \d+: ([^\[]+)', str(error))
    reason = error_reason(error)
    if os_error:
      reason = f'{os_error.group(1).strip()} ({reason})'
    return SaveError(
      f'checkpoint {step} could not be written to {self.root}: {reason}. Free '
      "disk space or fix the directory's permissions, then rerun the same command: it resumes "
      f'from the latest complete checkpoint ({complete[-1] if complete else "none yet"}; '
      f'complete: {complete}), and the partial save is moved aside at start-up'
      + (
        f" ({others} error report(s) of Orbax's writer threads about this save were not printed)"
        if others
        else ''
      )
    )

  def _close_quietly(self) -> None:
    try:
      self._mgr.close()
    except Exception:  # pylint: disable=broad-except
      pass

  def _wait_quietly(self) -> None:
    try:
      self._mgr.wait_until_finished()
    except Exception:  # pylint: disable=broad-except
      pass  # the error being raised already says the save failed

  def _discard_interrupted_saves(self) -> None:
    """Moves the temporary directories of saves a crash interrupted into `.deleted/`.

    (Orbax would remove them too, but only at the next save and synchronously; a rename is
    instant and the purge runs in the background.)
    """
    if not os.path.isdir(self.root):
      return
    leftovers = [d for d in os.listdir(self.root) if TMP_MARKER in d]
    for name in leftovers:
      deleted = os.path.join(self.root, DELETED_SUBDIR)
      os.makedirs(deleted, exist_ok=True)
      os.replace(os.path.join(self.root, name), os.path.join(deleted, f'{name}.{os.getpid()}'))

  def _purge_deleted(self) -> None:
    """Removes, in the background, the steps the keep policy renamed into `.deleted/`."""
    if jax.process_index() != 0 or (self._purger is not None and self._purger.is_alive()):
      return
    deleted = os.path.join(self.root, DELETED_SUBDIR)
    targets = (
      [os.path.join(deleted, d) for d in os.listdir(deleted)] if os.path.isdir(deleted) else []
    )
    if targets:

      def purge() -> None:
        for target in targets:
          shutil.rmtree(target, ignore_errors=True)

      self._purger = threading.Thread(target=purge, daemon=True)
      self._purger.start()

  def wait(self) -> None:
    """Waits for the save in flight; a SaveError if it failed."""
    try:
      self._mgr.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      step, self._in_flight = self._in_flight, None
      self._saved.discard(step)
      raise self._save_error(step, e) from None
    self._in_flight = None

  def close(self) -> None:
    """Waits for the save in flight and closes the manager (its writer threads end); then a
    SaveError if the save failed."""
    error = None
    try:
      self.wait()
    except SaveError as e:
      error = e
    try:
      self._mgr.close()
    except Exception as e:  # pylint: disable=broad-except
      if error is None:
        error = self._save_error(self._in_flight, e)
    if not self._save_failed:
      # After a failed save Orbax's writer threads can still report it once the manager is
      # closed (a full disk: its signalling thread's traceback, after the SaveError): their
      # reports stay counted, not printed, for the rest of the process.
      self._writer_errors.detach()
    if error is not None:
      raise error
    if self._purger is not None:
      self._purger.join()
    self._purge_deleted()
    if self._purger is not None:
      self._purger.join()


def close_unless_failing(checkpointer: Checkpointer | None) -> None:
  """Waits for `checkpointer`'s save in flight: a SaveError if it failed, unless another error is
  already on its way out (it is the one to report)."""
  if checkpointer is None:
    return
  failing = sys.exc_info()[1] is not None
  try:
    checkpointer.close()
  except SaveError:
    if not failing:
      raise


def error_reason(first: BaseException) -> str:
  """The most specific line of an Orbax/TensorStore error chain (they nest the useful one)."""
  chain, seen = [], set()
  error: BaseException | None = first
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    chain.append(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
    error = error.__cause__ or error.__context__
  statuses = ('NOT_FOUND', 'OUT_OF_RANGE', 'DATA_LOSS', 'INVALID_ARGUMENT', 'FAILED_PRECONDITION')
  specific = [line for line in chain if line.startswith(statuses)]
  reason = specific[-1] if specific else chain[0]
  reason = reason.split(' See full TensorStore details')[0]
  return reason if len(reason) <= 400 else reason[:400] + '...'


def _orbax_restore(root: str, step: int, items: dict[str, Any]) -> dict[str, Any]:
  """All requested items or a CheckpointError: never a partially restored state."""
  step_dir = os.path.join(root, str(step))
  mgr = _manager(root, read_only=True)
  silence_orbax_aftermath()
  try:
    return mgr.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # TensorStore raises bare Exceptions for missing or truncated files.
    others = [s for s in available_steps(root) if s != step]
    raise CheckpointError(
      f'{step_dir} is damaged or incomplete and cannot be restored: '
      f'{error_reason(e)}. Restore another step (available: {others}) or '
      'move this one away'
    ) from None
  finally:
    mgr.close()


def has_optimizer_state(path: str, step: int | None = None) -> bool:
  """Whether the checkpoint holds Adam state (`ckpt import-hf` writes weights only)."""
  root, step = resolve(path, step)
  return os.path.isdir(os.path.join(root, str(step), 'opt_state'))


def restore(
  path: str,
  layout: StateLayout,
  config: Config,
  step: int | None = None,
  load_optimizer: bool = True,
) -> tuple[TrainState, Progress]:
  """Restores params (and optimizer state) straight into `layout`'s shardings.

  With `load_optimizer=False` the Adam moments and step count start fresh (--no-load-optim).
  """
  root, step = resolve(path, step)
  saved = read_config(root, step)
  check_compatible(saved, config, f'checkpoint {os.path.join(root, str(step))}')
  if load_optimizer and not has_optimizer_state(root, step):
    raise CheckpointError(
      f'{os.path.join(root, str(step))} has no optimizer state (e.g. made by '
      '`ckpt import-hf`); start from it with checkpoint.init_from, or resume '
      'with checkpoint.load_optimizer=False'
    )
  canonical = layout.canonical
  items = {
    'params': _restore_arg(canonical.params, saved, config),
    'progress': ocp.args.JsonRestore(),
  }
  if load_optimizer:
    items['opt_state'] = _restore_arg(canonical.opt_state, saved, config)
  restored = _orbax_restore(root, step, items)
  params = layout.from_canonical(_fit_vocab(restored['params'], canonical.params), 'params')
  opt_state = (
    layout.from_canonical(_fit_vocab(restored['opt_state'], canonical.opt_state), 'opt_state')
    if load_optimizer
    else layout.fresh_opt_state(params)
  )
  progress = Progress(**restored['progress'])
  return TrainState(params, opt_state), progress


def restore_params(path: str, layout: StateLayout, config: Config, step: int | None = None):
  """Weights only (for checkpoint.init_from, evaluation and export)."""
  root, step = resolve(path, step)
  saved = read_config(root, step)
  check_compatible(saved, config, f'checkpoint {os.path.join(root, str(step))}')
  canonical = layout.canonical.params
  restored = _orbax_restore(root, step, {'params': _restore_arg(canonical, saved, config)})
  return layout.from_canonical(_fit_vocab(restored['params'], canonical), 'params')


def save_params(root: str, params, config: Config, step: int = 0) -> None:
  """A weights-only checkpoint (no optimizer state), e.g. from `ckpt import-hf`."""
  if available_steps(root):
    raise CheckpointError(f'{root} already holds checkpoints; choose an empty output directory')
  progress = Progress(iteration=step)
  mgr = _manager(root)
  mgr.save(
    step,
    args=ocp.args.Composite(
      params=ocp.args.StandardSave(params),
      progress=ocp.args.JsonSave(dataclasses.asdict(progress)),
      config=ocp.args.JsonSave(config.to_dict()),
      meta=ocp.args.JsonSave(
        make_meta(config, progress, config.train.seed, {'iteration': step, 'skipped_iterations': 0})
      ),
    ),
  )
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
    # adamw_8bit's codes and scales of the embedding have the same leading vocabulary dim.
    return jax.ShapeDtypeStruct(
      (saved_rows,) + tuple(a.shape[1:]), a.dtype, sharding=NamedSharding(mesh, spec)
    )

  return ocp.args.StandardRestore(jax.tree_util.tree_map_with_path(at_saved_rows, abstract_tree))


def _fit_vocab(tree, abstract_tree):
  def fit(x, a):
    if x.shape == a.shape:
      return x
    rows = a.shape[0]
    resized = (
      x[:rows]
      if x.shape[0] >= rows
      else jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
    )
    return jax.jit(lambda y: y, out_shardings=a.sharding)(resized)

  return jax.tree.map(fit, tree, abstract_tree)
