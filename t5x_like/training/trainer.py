"""The training loop: one jitted, explicitly sharded step with donated state, compiled ahead of
time, and the hooks that watch it (t5x_like/hooks.py; docs/training_loop.md).

Per iteration: the global batch (data/batches.py, a pure function of seed and consumed samples)
is split into micro-batches of `micro_batch_size x data` rows; gradients are accumulated over
them in fp32 in the ZeRO (data-split) layout, clipped at a global norm (the pre-clip norm is
logged), and AdamW updates the fp32 master params with the learning rate of schedule.py,
computed on the host from the consumed samples (or tokens). With a sequence-length curriculum
each iteration trains on the first `schedule.seq_len_at(cfg, iteration)` tokens of its samples;
the step is compiled once per (micro-batch count, length it runs at). An iteration whose loss or
gradient norm is not finite is skipped (params and Adam state, including its step count,
unchanged) and counted. After each iteration the registered hooks run: the records, the
throughput, spike and divergence watches, the replica check, the checkpoint cadence and the
evaluation, and any a user adds with `trainer.hooks.add_hook(fn, every=N)`.
"""

from __future__ import annotations

import jax

from t5x_like.config import Config
from t5x_like.mesh import distributed, partitioning
from t5x_like.parallel.train_state import Progress, TrainState, make_layout
from t5x_like.training import (
  accounting,
  alerts,
  batches,
  device_memory,
  metrics,
  resume,
  runtime,
  schedule,
  startup,
  watches,
)
from t5x_like.training import workdir as workdir_lib
from t5x_like.training.evaluation import TrainingEvaluator
from t5x_like.training.hooks import Hooks, StepInfo
from t5x_like.training.iteration import TrainIteration
from t5x_like.training.run_checkpoints import RunCheckpoints
from t5x_like.training.step import CompiledSteps, batch_sharding


class Trainer:
  """Owns a run: mesh, state layout, data, checkpoints, metrics, hooks; `run()` trains to the end.

  Constructing it checks everything that can refuse the run (config, workdir lock, the
  checkpoint to resume and its metadata, the data, the writability of every output directory)
  and writes nothing; `run()` restores the state and checks the data, and only then `start()`s
  the run: the workdir changes from that moment on. A refused run leaves it as it was.
  """

  def __init__(self, cfg: Config, workdir: str):
    startup.check_config(cfg)
    self.workdir = workdir_lib.resolve(workdir)
    joined = distributed.joined()
    self.is_writer, self.started = joined.process_id == 0, False
    self.lock = workdir_lib.lock_run(self.workdir, self.is_writer, joined.is_multi_process)
    try:
      self.resumption = resume.resolve(cfg, self.workdir)
      cfg = self.cfg = self.resumption.config
      workdir_lib.check_run_outputs(
        self.workdir, cfg.runtime.tensorboard_dir, cfg.runtime.compilation_cache_dir
      )
      # The data next: a bad path, file or split is one error before JAX starts a backend.
      self.data = startup.open_data(cfg, self.resumption.data_seed)
      self.source = self.data.train
      # The mesh comes first among JAX objects: it creates virtual CPU devices before anything
      # starts the backend.
      self.mesh = partitioning.mesh_of(cfg.mesh)
      self.layout = make_layout(cfg, self.mesh)
      self.batch_sharding = batch_sharding(self.layout)
      self.alerts = alerts.Alerts(cfg.runtime.alert_command, self.workdir, jax.process_index())
      self.writer = metrics.MetricsWriter(
        self.workdir, enabled=self.is_writer, tensorboard_dir=cfg.runtime.tensorboard_dir
      )
      self.profiler = startup.run_profiler(cfg, self.workdir, self.writer, self.is_writer)
      self.watchdog = startup.run_watchdog(cfg, self.writer, self.alerts, self.is_writer)
      memory_limit = device_memory.accelerator_memory()  # None on CPU
      self.steps = CompiledSteps(
        cfg, self.layout, self.writer.info, self.watchdog.suspended, memory_limit
      )
      self.skipped = batches.SkippedIterations(cfg, self.writer.info)
      r = self.resumption
      self.watches = watches.RunWatches(cfg, r.software, r.meta.get('throughput'), r.progress)
      # The MFU reference; on CPU a matmul probe, compiled once the run and its cache started.
      self.peak = accounting.PeakReference(cfg.model.dtype)
      self.iterations = TrainIteration(
        cfg, self.layout, self.steps, self.batch_sharding, self.peak, r.lr_zero_until
      )
      self.checkpoints = RunCheckpoints(
        r, self.layout, self.writer, self.alerts, self.workdir, self.watches, self.watchdog
      )
      self.evaluator = TrainingEvaluator(
        cfg, self.layout, self.batch_sharding, self.data, self.writer, self.watchdog
      )
      self.replica_check = watches.ReplicaCheck(
        self.writer.info, self.alerts.send, self.is_writer, self.mesh.devices.size
      )
      self.compilation_cache: str | None = None  # set by start()
      self.stop_reason: runtime.StopReason | None = None
      self.final_state: TrainState | None = None
      self.hooks = self.builtin_hooks()
    except BaseException:
      self.lock.release(started=False)
      raise

  def builtin_hooks(self) -> Hooks:
    """The run's monitors, in the order they see an iteration (docs/training_loop.md)."""
    cfg, hooks = self.cfg, Hooks()
    hooks.add_hook(metrics.record_hook(self.writer, schedule.total_iterations(cfg.train)))
    hooks.add_hook(device_memory.report_hook(self.writer.info, self.steps.memory_limit))
    self.watches.register(hooks, self.writer.info, self.alerts.send, self.checkpoints)
    self.profiler.register(hooks)  # runtime.profile_every_mins's traces
    if cfg.runtime.replica_check_interval:
      hooks.add_hook(self.replica_check, every=cfg.runtime.replica_check_interval)
    self.checkpoints.register(hooks)  # the cadence's saves; the last save, then the close
    self.evaluator.register(hooks)  # every eval.interval iterations, and at the end
    for add in (hooks.at_end, hooks.on_stop):
      add(metrics.end_line_hook(self.writer.info))
      add(alerts.end_hook(self.alerts))
    return hooks

  def start(self, progress: Progress) -> None:
    """The run really starts: from here on the workdir changes (resume.begin)."""
    self.started = True
    self.lock.mark_started()
    self.writer.open()
    self.checkpoints.open(progress)  # resume.begin
    self.compilation_cache = startup.use_compilation_cache(
      self.workdir, self.cfg.runtime.compilation_cache_dir, self.writer.info
    )

  def release(self) -> None:
    """Ends the run's hold on its workdir (its lock); no-op when already released."""
    self.lock.release(started=self.started)

  # ---------------------------------------------------------------------------------- state

  def initial_state(self) -> tuple[TrainState, Progress]:
    notes = [self.watches.note] if self.watches.note else []
    return resume.initial_state(self.resumption, self.layout, self.writer.info, notes)

  def global_batch(
    self, consumed_samples: int, global_batch_size: int, source=None, what='training', **lengths
  ) -> jax.Array:
    """batches.global_batch of `source` (default: the training stream) in the run's sharding."""
    source = self.source if source is None else source
    return batches.global_batch(
      self.cfg, self.batch_sharding, source, consumed_samples, global_batch_size, what, **lengths
    )

  # ------------------------------------------------------------------------------------ loop

  def run(self, stop: runtime.StopConditions | None = None) -> Progress:
    """Trains to the end or until a stop condition; `stop_reason` says which (None: the end).

    A kill switch present at start-up stops the run before any work. `stop` (entered by the
    caller, `train.main`, at process start) handles the signals; without one, run() installs
    its own. Before the training loop a signal ends the run at once (runtime.Interrupted: there
    is nothing to save), in the loop at the next iteration boundary, after a save.
    """
    rt = self.cfg.runtime
    self.stop_reason = None
    if runtime.kill_switch_present(rt.kill_switch_path):
      self.release()
      self.stop_reason = runtime.StopReason.KILL_SWITCH
      self.writer.info(runtime.kill_switch_note(rt.kill_switch_path))
      return self.resumption.progress
    own_stop = stop is None
    stop_context = runtime.stop_conditions(rt, stop, jax.process_count())
    try:
      with stop_context as stop, self.watchdog, self.writer:
        try:
          return self._train(stop)
        finally:
          self.checkpoints.close()
    except runtime.Interrupted as e:
      self.stop_reason = runtime.StopReason.SIGNAL
      if self.started:
        self.writer.info(f'> stopped: {e}')
        self.alerts.send('stopped', f'> stopped: {e}', self.resumption.progress.iteration)
      if own_stop:
        return self.resumption.progress
      raise
    except Exception as e:
      if self.started:
        self.alerts.send('crashed', f'{type(e).__name__}: {e}')
      raise
    finally:
      self.profiler.close()  # a trace an early stop or an error left open
      self.alerts.wait()
      self.release()

  def _train(self, stop: runtime.StopConditions) -> Progress:
    cfg = self.cfg
    for line in startup.start_report(cfg, self.layout, self.resumption.software):
      self.writer.info(line)  # process 0's log only, as every line
    # Everything that can refuse the run comes before start(): the restore and the data check.
    state, progress = self.initial_state()
    for line in batches.check_run_data(
      cfg, self.data, self.batch_sharding, progress.consumed_samples
    ):
      self.writer.info(line)
    self.start(progress)
    for line in [self.peak.describe(), *startup.schedule_lines(cfg, self.layout)]:
      self.writer.info(line)
    start_iteration, total = progress.iteration, schedule.total_iterations(cfg.train)
    if progress.iteration < total:
      self.iterations.compile_ahead(progress, self.evaluator)
    stop.start_training()
    self.hooks.run_start(StepInfo(progress, state, start_iteration=start_iteration))
    info = StepInfo(progress, state, start_iteration=start_iteration)
    while progress.iteration < total:
      # The job's first step also sets up the communicators of its collectives: more time.
      grace = runtime.FIRST_ITERATION_GRACE if progress.iteration == start_iteration else 1.0
      self.watchdog.beat(f'in iteration {progress.iteration + 1}', grace=grace)
      info.stop_reason = stop.poll()
      if info.stop_reason is not None:
        self.writer.info(
          f'> stopping at iteration {progress.iteration}: {stop.describe(info.stop_reason)}'
        )
        break
      if cfg.data.skips(progress.iteration + 1):
        self.skipped.skip(progress, total)
        info = StepInfo(progress, state, start_iteration=start_iteration)
      else:
        self.profiler.before_iteration(progress.iteration + 1)
        state, record, finite = self.train_iteration(state, progress)
        self.profiler.after_iteration(progress.iteration)
        info = StepInfo(progress, state, record, finite, start_iteration)
      self.hooks.run_iteration(info)
      if info.stop_reason is not None:
        break
    (self.hooks.run_stop if info.stop_reason else self.hooks.run_end)(info)
    self.stop_reason, self.final_state = info.stop_reason, state
    return progress

  def train_iteration(self, state: TrainState, progress: Progress) -> tuple[TrainState, dict, bool]:
    """iteration.TrainIteration on the next global batch: new state, record, whether finite."""
    self.skipped.trained()
    return self.iterations(state, progress, self.source)
