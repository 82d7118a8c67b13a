"""Where a run starts: `resolve(cfg, workdir)` reads the workdir's checkpoints (metadata only, no
array, no JAX backend) and returns a Resumption, or raises the CheckpointError/ConfigError that
refuses the run. It writes nothing: `initial_state(resumption, layout, log)` restores the state it
names, and `begin(resumption, ...)` acts on it once the run really starts (the workdir changes from
there on).

A workdir with a complete checkpoint resumes its latest step with the checkpoint's data order;
`checkpoint.*` restart controls decide the optimizer state, the learning-rate schedule and the
dropout seed; every difference from the checkpoint's run is a note for the log.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from t5x_like.checkpointing import checkpoints, provenance
from t5x_like.config import Config
from t5x_like.mesh import distributed
from t5x_like.optim import adamw as optim
from t5x_like.parallel.train_state import Progress, StateLayout, TrainState
from t5x_like.training import replay, schedule
from t5x_like.training import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Resumption:
  config: Config  # what the run trains with (the checkpoint's dropout seed with load_rng)
  ckpt_root: str
  steps: list[int]  # the complete checkpoints available, oldest first
  damaged: dict[int, str]  # step -> its problem: moved aside when the run starts
  progress: Progress  # the resumed position (Progress() from scratch)
  data_seed: int  # the data order's seed: the checkpoint's, never train.seed's on a resume
  load_optimizer: bool  # whether the restore reads the Adam state
  # Iteration and skipped count at which the Adam step count was 0 (`ckpt verify` checks it).
  adam_count_base: dict[str, int]
  # The iterations up to this one train at lr 0 (checkpoint.reset_warmup_iterations after an
  # optimizer reset, from this job's reset or the checkpoint's meta); 0: none.
  lr_zero_until: int
  meta: dict[str, Any]  # the checkpoint's metadata ({} from scratch)
  software: dict[str, Any]  # this job's versions
  config_changes: list[str]  # 'section.key: checkpoint VALUE -> now VALUE'
  software_changes: list[str]
  notes: list[str]  # for the log, in order, once the run starts

  @property
  def step(self) -> int | None:
    """The checkpoint step resumed, or None (scratch or checkpoint.init_from)."""
    return self.steps[-1] if self.steps else None

  @property
  def reset_optimizer(self) -> bool:
    """This job starts fresh Adam moments (checkpoint.load_optimizer=False, not yet applied)."""
    return self.step is not None and not self.load_optimizer


def resolve(cfg: Config, workdir: str, software: dict[str, Any] | None = None) -> Resumption:
  """Where `cfg` starts in `workdir` (software: this job's versions, provenance.software() unless
  given)."""
  root = os.path.join(workdir, 'checkpoints')
  software = provenance.software() if software is None else software
  replay.read_history(workdir)  # a damaged history is refused before the run appends to it
  steps, damaged = checkpoints.scan_steps(root)
  zero = {'iteration': 0, 'skipped_iterations': 0}
  if damaged and not steps:
    # A transient file-system fault can make every step look damaged: restarting from scratch
    # would throw the run away, so a person decides.
    listed = '; '.join(f'{os.path.join(root, str(s))}: {p}' for s, p in sorted(damaged.items()))
    raise checkpoints.CheckpointError(
      f'no checkpoint in {root} can be restored: every step is damaged ({listed}). Nothing '
      'was changed. If the file system was at fault, fix it and rerun; to start this run over '
      f'on purpose, move {root} aside (e.g. `mv {root} {root}.damaged`) or pass another '
      '--workdir'
    )
  if not steps:
    if cfg.checkpoint.init_from:
      checkpoints.check_compatible(
        checkpoints.read_config(cfg.checkpoint.init_from),
        cfg,
        f'checkpoint.init_from={cfg.checkpoint.init_from}',
      )
    return Resumption(
      cfg, root, steps, damaged, Progress(), cfg.train.seed, True, zero, 0, {}, software, [], [], []
    )
  what = f'the checkpoint in {root} (this workdir resumes it)'
  step = steps[-1]  # the latest complete step (damaged ones are moved aside)
  saved_cfg = checkpoints.read_config(root, step)
  checkpoints.check_compatible(saved_cfg, cfg, what)
  # checkpoint.load_optimizer=False resets Adam once: a checkpoint its own job saved (a
  # requeue, the next job of an array with the same flags) already has the fresh state, unless
  # this job switches the state's format (8-bit Adam, its blocks), which resets it again.
  reset_done = (
    not cfg.checkpoint.load_optimizer
    and not saved_cfg.checkpoint.load_optimizer
    and checkpoints.has_optimizer_state(root, step)
    and optim.state_format(saved_cfg) == optim.state_format(cfg)
  )
  meta = checkpoints.read_meta(root, step)
  progress = checkpoints.read_progress(root, step)
  checkpoints.check_lr_schedule(meta, cfg, what)
  schedule.check_resumed(saved_cfg, cfg, progress.iteration, progress.consumed_samples)
  notes: list[str] = []
  resumed_cfg, data_seed = resumed_config(cfg, meta, notes)
  # The blend order, like the data seed, is the checkpoint's: another would reorder the samples.
  if saved_cfg.data.blend_order != resumed_cfg.data.blend_order:
    notes.append(
      f'> data order: blend order {saved_cfg.data.blend_order!r} of the checkpoint '
      f'(data.blend_order={resumed_cfg.data.blend_order!r} applies to new runs)'
    )
    resumed_cfg = resumed_cfg.replace(data={'blend_order': saved_cfg.data.blend_order})
  load_optimizer = cfg.checkpoint.load_optimizer or reset_done
  if load_optimizer:
    optim.check_same_state_format(saved_cfg, cfg, what)
    adam_count_base = dict(meta['adam_count_base'])
    lr_zero_until = int(meta.get('lr_zero_until', 0))
  else:
    adam_count_base = {
      'iteration': progress.iteration,
      'skipped_iterations': progress.skipped_iterations,
    }
    lr_zero_until = progress.iteration + cfg.checkpoint.reset_warmup_iterations
  # Every difference from the checkpoint's run in the log, before training: edits between
  # jobs (the chronicles' `perl -pi` on launch scripts) and upgrades are visible, not silent.
  config_changes = provenance.config_changes(saved_cfg, resumed_cfg)
  software_changes = provenance.software_changes(meta.get('software'), software)
  notes += [f'> config changed since the checkpoint: {change}' for change in config_changes]
  notes += [f'> software changed since the checkpoint: {change}' for change in software_changes]
  return Resumption(
    resumed_cfg,
    root,
    steps,
    damaged,
    progress,
    data_seed,
    load_optimizer,
    adam_count_base,
    lr_zero_until,
    meta,
    software,
    config_changes,
    software_changes,
    notes,
  )


def initial_state(
  resumption: Resumption,
  layout: StateLayout,
  log: Callable[[str], None],
  notes: Sequence[str] = (),
) -> tuple[TrainState, Progress]:
  """The state the run starts from, restored onto `layout`: its checkpoint (with or without the
  Adam state), checkpoint.init_from's weights with a fresh optimizer, or a fresh init. Logs what
  it did, the resumption's notes and `notes`."""
  cfg = resumption.config
  if resumption.step is not None:
    state, progress = checkpoints.restore(
      resumption.ckpt_root,
      layout,
      cfg,
      step=resumption.step,
      load_optimizer=resumption.load_optimizer,
    )
    log(
      f'> resumed from {resumption.ckpt_root}/{progress.iteration}: '
      f'{progress.consumed_samples} samples consumed'
    )
    if resumption.reset_optimizer:
      log(
        '> checkpoint.load_optimizer=False: fresh Adam moments, Adam step count 0 (once: a '
        'restart from a checkpoint saved with this flag loads its Adam state)'
      )
    elif not cfg.checkpoint.load_optimizer:
      log(
        '> checkpoint.load_optimizer=False: already applied at iteration '
        f'{resumption.adam_count_base["iteration"]} by the job that saved this checkpoint; its '
        'Adam state is loaded, not reset again'
      )
    if resumption.lr_zero_until > progress.iteration:
      log(
        f'> lr 0 through iteration {resumption.lr_zero_until} while the fresh Adam moments '
        f'warm up (checkpoint.reset_warmup_iterations after the reset at iteration '
        f'{resumption.adam_count_base["iteration"]}); then the schedule goes on'
      )
    for note in list(resumption.notes) + list(notes):
      log(note)
    return state, progress
  if cfg.checkpoint.init_from:
    params = checkpoints.restore_params(cfg.checkpoint.init_from, layout, cfg)
    log(f'> weights from {cfg.checkpoint.init_from}; fresh optimizer state')
    return TrainState(params, layout.fresh_opt_state(params)), Progress()
  return layout.init(cfg.train.seed), Progress()


def resumed_config(cfg: Config, meta: dict[str, Any], notes: list[str]) -> tuple[Config, int]:
  """(the config a resumed run trains with, its data seed): the checkpoint's data order and
  (with load_rng) its dropout seed; `notes` gets a line wherever the config's values are not
  used."""
  data_seed = meta['data']['seed']
  if data_seed != cfg.train.seed:
    notes.append(
      f'> data order: seed {data_seed} of the checkpoint (the data position is always '
      'resumed; train.seed does not change it)'
    )
  saved_schedule = checkpoints.saved_lr_schedule(meta)
  if cfg.checkpoint.override_lr_scheduler and checkpoints.lr_schedule(cfg) != saved_schedule:
    notes.append(
      f"> checkpoint.override_lr_scheduler: the config's schedule "
      f"{checkpoints.lr_schedule(cfg)} replaces the checkpoint's {saved_schedule}"
    )
  saved_seed = meta['rng']['seed']
  if not cfg.checkpoint.load_rng:
    note = (
      "the same stream as the checkpoint's: set another train.seed for new masks"
      if saved_seed == cfg.train.seed
      else f"not the checkpoint's seed {saved_seed}"
    )
    notes.append(
      f'> checkpoint.load_rng=False: dropout seed {cfg.train.seed} from the config ({note})'
    )
    return cfg, data_seed
  if saved_seed != cfg.train.seed:
    notes.append(
      f'> dropout seed {saved_seed} from the checkpoint (config: {cfg.train.seed}; '
      'checkpoint.load_rng=False would use it)'
    )
    return cfg.replace(train={'seed': saved_seed}), data_seed
  return cfg, data_seed


def begin(
  resumption: Resumption,
  progress: Progress,
  layout: StateLayout,
  writer,
  workdir: str,
  is_writer: bool,
) -> checkpoints.Checkpointer:
  """The run really starts: damaged checkpoints are moved aside, the checkpoint manager opens,
  the records past the resumed iteration are dropped (`writer`: the run's metrics.MetricsWriter,
  open), and the config and this job are recorded. Returns the open checkpoint manager."""
  cfg = resumption.config
  if is_writer:
    for step, problem in sorted(resumption.damaged.items()):
      moved = checkpoints.move_damaged_aside(resumption.ckpt_root, step)
      writer.info(
        f'> checkpoint {step} is damaged ({problem}): moved aside to {moved}; it is '
        'not restored and not counted by the keep policy'
      )
    if resumption.damaged:  # (with no complete step left, resolve() refused the run)
      writer.info(
        f'> the run resumes from checkpoint {progress.iteration} (complete '
        f'checkpoints: {resumption.steps})'
      )
  if distributed.joined().is_multi_process:
    # No process opens the checkpoint manager while process 0 still moves damaged steps.
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices('t5x_like: damaged checkpoints moved aside')
  checkpointer = checkpoints.Checkpointer(
    resumption.ckpt_root,
    cfg.checkpoint.save_interval,
    cfg.checkpoint.max_to_keep,
    layout,
    keep_period=cfg.checkpoint.keep_period,
    kept_steps=resumption.meta.get('kept_steps', []),
    temporary_steps=resumption.meta.get('temporary_steps', []),
  )
  # Records after the resumed iteration were written by a job that died before saving again;
  # with no checkpoint at all, the run starts its records afresh.
  writer.truncate_after(progress.iteration, progress.consumed_samples, progress.consumed_tokens)
  writer.config_text(cfg.to_json(), progress.iteration + 1)
  if is_writer:
    workdir_lib.atomic_write_text(os.path.join(workdir, 'config.json'), cfg.to_json() + '\n')
    # The config and data seed of each job, from its first iteration on: the batch of any
    # iteration can be rebuilt after the config changed between jobs (data/replay.py).
    replay.record_job(workdir, progress.iteration + 1, cfg, resumption.data_seed)
  return checkpointer
