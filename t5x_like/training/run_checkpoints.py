"""A run's checkpoints as one object: the Orbax checkpointer (opened when the run starts), the
metadata of each save, when to save (checkpoint.save_interval and save_interval_mins), and what
a save decides: a state with non-finite params is never written and stops the run as diverged.

It registers its own hooks (t5x_like/hooks.py; docs/training_loop.md): a save every
save_interval iterations and once save_interval_mins of wall clock passed since the last one
(0: none in between), never in the middle of non-finite iterations (a divergence keeps the last
finite state), and one at the end or before leaving early, after which the save in flight is
waited for. At a spike it keeps the checkpoint from before it; at a divergence it saves the last
finite state; incidents.IncidentReports tells the user.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np

from t5x_like.checkpointing import checkpoints
from t5x_like.parallel.train_state import Progress, StateLayout, TrainState
from t5x_like.training import alerts as alerts_lib
from t5x_like.training import resume, runtime, schedule
from t5x_like.training import watches as watches_lib
from t5x_like.training.hooks import Hooks, StepInfo
from t5x_like.training.incidents import IncidentReports


class SaveTimer:
  """Whether `minutes` (> 0; 0: never) of wall clock passed since the last `restart()`, the same
  answer on all `num_processes` processes: their clocks differ, so they agree at each iteration
  (an all-gather; a save is a collective, and a process that saved alone would wait in it
  forever). `clock` gives seconds."""

  def __init__(
    self, minutes: float, num_processes: int, clock: Callable[[], float] = time.monotonic
  ):
    self.interval_s = minutes * 60.0
    self.num_processes = num_processes
    self.clock = clock
    self.since = clock()

  def restart(self) -> None:
    self.since = self.clock()

  def elapsed_s(self) -> float:
    return self.clock() - self.since

  def due(self) -> bool:
    """Called at every iteration boundary by every process (when minutes > 0)."""
    if self.interval_s <= 0:
      return False
    due = self.elapsed_s() >= self.interval_s
    if self.num_processes == 1:
      return due
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(due))))


class RunCheckpoints:
  """The checkpoints of the run `resumption` (a resume.Resumption) describes. `writer` is the
  run's metrics.MetricsWriter (its process writes the checkpoints' side files when it is
  enabled), `watches` its watches.RunWatches (a save carries the throughput baselines; a
  divergence saves the last finite state) and `watchdog` its runtime.Watchdog. `checkpointer` is
  None until `open()`, and again after `close()`."""

  def __init__(
    self,
    resumption: resume.Resumption,
    layout: StateLayout,
    writer,
    alerts: alerts_lib.Alerts,
    workdir: str,
    watches: watches_lib.RunWatches,
    watchdog: runtime.Watchdog,
  ):
    self.resumption, self.cfg, self.layout = resumption, resumption.config, layout
    self.writer, self.workdir, self.is_writer = writer, workdir, writer.enabled
    self.watches, self.divergence, self.watchdog = watches, watches.divergence, watchdog
    self.resumed_iteration = resumption.progress.iteration  # where this job started
    self.incidents = IncidentReports(
      writer.info, alerts, workdir, resumption.ckpt_root, self.divergence
    )
    self.checkpointer: checkpoints.Checkpointer | None = None  # opened by open()
    # Restarted when training starts and at every save.
    self.save_timer = SaveTimer(self.cfg.checkpoint.save_interval_mins, jax.process_count())
    self.last_iteration = schedule.total_iterations(self.cfg.train)

  def open(self, progress: Progress) -> None:
    """The run starts at `progress`: resume.begin, which opens the checkpointer."""
    self.checkpointer = resume.begin(
      self.resumption, progress, self.layout, self.writer, self.workdir, self.is_writer
    )

  def close(self) -> None:
    """Waits for the save in flight (checkpoints.close_unless_failing); closes it once."""
    checkpointer, self.checkpointer = self.checkpointer, None
    checkpoints.close_unless_failing(checkpointer)

  def register(self, hooks: Hooks) -> None:
    """The saves every checkpoint.save_interval iterations and save_interval_mins minutes; the
    last save, at the end and on a stop."""
    hooks.at_start(self.start_hook)
    hooks.add_hook(self.iteration_hook)
    for add in (hooks.at_end, hooks.on_stop):
      add(self.final_hook)

  # ---------------------------------------------------------------------------------- saves

  @property
  def opened(self) -> checkpoints.Checkpointer:
    """The checkpoint manager, which exists from open() on (the hooks run after it)."""
    assert self.checkpointer is not None, 'RunCheckpoints.open() was not called'
    return self.checkpointer

  def should_save(self, iteration: int) -> bool:
    return self.opened.should_save(iteration)

  def meta(self, progress: Progress, temporary: bool = False) -> dict:
    """The `meta` item of the checkpoint of `progress` (checkpoints.make_meta), with the
    throughput baselines the next job starts from; `temporary`: a timed save. Waits for the
    save in flight, whose deletions decide which timed saves are still on disk."""
    resumption = self.resumption
    temporary_steps = self.opened.settle_temporary_steps()
    temporary_steps |= {progress.iteration} if temporary else set()
    meta = checkpoints.make_meta(
      self.cfg,
      progress,
      resumption.data_seed,
      resumption.adam_count_base,
      resumption.software,
      self.opened.kept_steps,
      temporary_steps,
      resumption.lr_zero_until,
    )
    meta['throughput'] = self.watches.checkpoint_meta()
    return meta

  def save(self, state: TrainState, progress: Progress, temporary: bool = False) -> bool:
    """Starts saving `state` as step `progress.iteration` (Checkpointer.save: False if that step
    is already saved; checkpoints.NonFiniteStateError for non-finite params). A `temporary` one
    (a timed save) is deleted once a later step is saved."""
    meta = self.meta(progress, temporary)
    saved = self.opened.save(state, progress, self.cfg, meta, temporary)
    self.save_timer.restart()
    return saved

  def save_or_stop(self, state: TrainState, progress: Progress, temporary: bool = False) -> bool:
    """Saves; a state with non-finite params is never written: the run then stops as diverged.
    Returns whether the run goes on."""
    try:
      self.save(state, progress, temporary)
      return True
    except checkpoints.NonFiniteStateError as e:
      self.diverged(f'> {e}')
      return False

  # ---------------------------------------------------------------------------------- hooks

  def start_hook(self, info: StepInfo) -> None:
    """Training starts: save_interval_mins counts from here (not from the compilation)."""
    self.save_timer.restart()

  def iteration_hook(self, info: StepInfo) -> None:
    """After every iteration (every=1): a save when either interval says so; a timed one is
    temporary, and none at the last iteration, whose save the end hook makes."""
    by_count = self.should_save(info.iteration)
    by_time = self.save_timer.due()  # every process takes part in its agreement
    timed = by_time and not by_count and info.iteration < self.last_iteration
    if (by_count or timed) and not self.divergence.consecutive:
      if timed:
        self.writer.info(
          f'> checkpoint at iteration {info.iteration}: '
          f'{self.save_timer.elapsed_s() / 60:.1f} minutes since the last save '
          f'(checkpoint.save_interval_mins={self.cfg.checkpoint.save_interval_mins:g}); '
          'kept until the next save'
        )
      if not self.save_or_stop(info.state, info.progress, temporary=timed):
        info.request_stop(runtime.StopReason.DIVERGED)

  def final_hook(self, info: StepInfo) -> None:
    """At the end and on a stop: the last save, unless nothing trained or the run diverged;
    then the checkpointer is closed (a failed save raises checkpoints.SaveError here)."""
    trained = info.iteration > info.start_iteration
    if trained and info.stop_reason is not runtime.StopReason.DIVERGED:
      self.watchdog.beat(f'saving the checkpoint of iteration {info.iteration}')
      if not self.save_or_stop(info.state, info.progress):
        info.stop_reason = runtime.StopReason.DIVERGED
    self.close()

  # ------------------------------------------------------------------------------ incidents

  def spike(self, message: str, iteration: int) -> None:
    """A spike (watches.spike_hook): the checkpoint from before it is kept past the keep
    policy, and reported."""
    self.incidents.spike(message, iteration, self.opened.keep_last_before(iteration))

  def on_diverged(self, message: str, state: TrainState) -> None:
    """runtime.max_consecutive_nan reached (watches.divergence_hook): the skipped iterations
    left the state as the last finite one left it, which is saved (if this job trained it),
    then the remedies."""
    last = self.divergence.last_finite
    if last.iteration > self.resumed_iteration:
      self.save_or_stop(state, last)
    self.diverged(message)

  def diverged(self, message: str) -> None:
    self.incidents.diverged(message, self.opened.saved_steps())
