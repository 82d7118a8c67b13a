"""The training loop: one jitted, explicitly sharded step with donated state, compiled ahead of
time.

Per iteration: the global batch (a pure function of seed and consumed samples) is split into
`num_microbatches` micro-batches of `micro_batch_size x data` rows; gradients are accumulated over
them in fp32 in the ZeRO (data-split) layout, clipped at a global norm (the pre-clip norm is
logged), and AdamW updates the fp32 master params with a learning rate computed on the host from
the consumed samples (or tokens). With a sequence-length curriculum (`curriculum.*`) each
iteration trains on the first `Config.seq_len_at(iteration)` tokens of its samples; the step is
compiled once per (micro-batch count, length it runs at: `curriculum.pad_to_multiple` rounds the
lengths up, the rest of the batch padding outside the loss; train.rampup_microbatch_multiple
likewise rounds up the batch ramp-up's micro-batch counts). An iteration whose loss or gradient
norm is not finite is skipped (params and Adam state, including its step count, unchanged) and
counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from t5x_like import checkpoints, metrics, optim, partitioning, pipeline
from t5x_like import alerts, losses
from t5x_like.step import batch_sharding, lower_train_step, make_eval_step
from t5x_like import distributed, provenance, runtime
from t5x_like import workdir as workdir_lib
from t5x_like.config import Config, ConfigError
from t5x_like.data import replay, sources
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.train_state import Progress, TrainState, describe_zero, make_layout


class Trainer:
  """Owns a run: mesh, state layout, data, checkpoints, metrics; `run()` trains to the end.

  Constructing it checks everything that can refuse the run (config, workdir lock, the
  checkpoint to resume and its metadata, the data, the writability of every output directory)
  and writes nothing; `run()` restores the state and checks the data, and only then `start()`s
  the run: the workdir changes from that moment on. A refused run leaves it as it was.
  """

  def __init__(self, cfg: Config, workdir: str):
    self.cfg = cfg.validate()
    self.workdir = workdir_lib.resolve(workdir)
    self.ckpt_root = os.path.join(self.workdir, 'checkpoints')
    self.is_writer = distributed.joined().process_id == 0
    self.lock = workdir_lib.Lock(self.workdir)
    self.started = False
    self._lock_workdir()
    try:
      self._plan(cfg)
    except BaseException:
      self.lock.release(started=False)
      raise

  def _lock_workdir(self) -> None:
    """Process 0 locks the workdir; every process learns whether it could (one verdict, so none
    goes on alone into a collective)."""
    error = None
    if self.is_writer:
      try:
        self.lock.acquire()
      except ConfigError as e:
        error = e
    if distributed.joined().is_multi_process:
      from jax.experimental import multihost_utils
      locked = multihost_utils.process_allgather(np.int32(error is None))
      if error is None and not np.all(locked):
        error = ConfigError(f'process 0 could not lock workdir {self.workdir}; its message says '
                            'why')
    if error is not None:
      self.lock.release(started=False)
      raise error

  def _plan(self, cfg: Config) -> None:
    self.resume_step, self.damaged = checkpoints.scan_steps(self.ckpt_root)
    self.restart_notes: list[str] = []  # logged once the run starts
    self.reset_done = False  # see checkpoint.load_optimizer below
    self.data_seed = cfg.train.seed
    self.software = provenance.software()
    self.resume_meta: dict[str, Any] = {}
    if self.resume_step:
      what = f'the checkpoint in {self.ckpt_root} (this workdir resumes it)'
      step = self.resume_step[-1]  # the latest complete step (damaged ones are moved aside)
      saved_cfg = checkpoints.read_config(self.ckpt_root, step)
      checkpoints.check_compatible(saved_cfg, cfg, what)
      # checkpoint.load_optimizer=False resets Adam once: a checkpoint its own job saved (a
      # requeue, the next job of an array with the same flags) already has the fresh state.
      self.reset_done = (not cfg.checkpoint.load_optimizer and
                         not saved_cfg.checkpoint.load_optimizer and
                         checkpoints.has_optimizer_state(self.ckpt_root, step))
      self.resume_meta = checkpoints.read_meta(self.ckpt_root, step)
      self.resume_progress = checkpoints.read_progress(self.ckpt_root, step)
      checkpoints.check_lr_schedule(self.resume_meta, cfg, what)
      cfg = self.cfg = self._resumed_config(cfg, self.resume_meta)
      # Every difference from the checkpoint's run in the log, before training: edits between
      # jobs (the chronicles' `perl -pi` on launch scripts) and upgrades are visible, not silent.
      self.restart_notes += [f'> config changed since the checkpoint: {change}'
                             for change in provenance.config_changes(saved_cfg, cfg)]
      self.restart_notes += [f'> software changed since the checkpoint: {change}' for change in
                             provenance.software_changes(self.resume_meta.get('software'),
                                                         self.software)]
    else:
      self.resume_progress = Progress()
      if cfg.checkpoint.init_from:
        checkpoints.check_compatible(checkpoints.read_config(cfg.checkpoint.init_from), cfg,
                                     f'checkpoint.init_from={cfg.checkpoint.init_from}')
    self._check_output_dirs(cfg)
    # The data next: a bad path, file or split is one error before JAX starts a backend.
    self.data = self._open_data(cfg)
    self.source = self.data.train
    # The mesh comes first among JAX objects: it creates virtual CPU devices before anything
    # starts the backend.
    self.mesh = partitioning.make_mesh(cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor)
    self.compilation_cache: str | None = None  # set by start()
    self.alerts = alerts.Alerts(cfg.runtime.alert_command, self.workdir, jax.process_index())
    self.writer = metrics.MetricsWriter(self.workdir, enabled=self.is_writer,
                                        tensorboard_dir=cfg.runtime.tensorboard_dir)
    self.layout = make_layout(cfg, self.mesh)
    self.batch_sharding = batch_sharding(self.layout)
    # optimizer.decay_tokens counts from here (a pure function of the config).
    self.warmup_end_tokens = cfg.warmup_end_tokens() if cfg.optimizer.decay_tokens else 0
    # One compiled step per (micro-batch count, sequence length): ramp-up and curriculum.
    self._compiled = {}
    self._compiled_eval = {}
    self._skipping = False  # inside a run of data.skip_train_iteration_range iterations
    # A GPU's step time is steady to 1-2%, so 5% is a real slowdown (tr11's slow GPU). A CPU's
    # moves by 10-20% with whatever else the machine runs: only a larger change is reported.
    self.throughput = metrics.ThroughputWatch(
        threshold=0.25 if jax.devices()[0].platform == 'cpu' else 0.05)
    if self.resume_step:
      self._seed_throughput(self.resume_meta.get('throughput'))
    self.watchdog = runtime.Watchdog(0.0)  # run() installs the configured one
    self.spikes = metrics.SpikeWatch(cfg.runtime.spike_window, cfg.runtime.spike_loss_threshold,
                                     cfg.runtime.spike_grad_factor)
    self.divergence = metrics.DivergenceWatch(cfg.runtime.max_consecutive_nan,
                                              dataclasses.replace(self.resume_progress))
    self.checkpointer: checkpoints.Checkpointer | None = None  # created by start()
    self.adam_count_base = {'iteration': 0, 'skipped_iterations': 0}  # set by initial_state()
    self.peak_tflops = 1.0  # measured by _train()
    self.stop_reason: runtime.StopReason | None = None
    self.final_state: TrainState | None = None

  def _check_output_dirs(self, cfg: Config) -> None:
    """Every directory the run writes to can be written, before anything is."""
    outputs = [(self.workdir, 'the workdir', 'pass a --workdir that you can write to'),
               (os.path.join(self.workdir, 'logs'), 'the log directory',
                'remove what is in its way in the workdir')]
    if cfg.runtime.tensorboard_dir:
      outputs.append((os.path.join(self.workdir, cfg.runtime.tensorboard_dir),
                      'runtime.tensorboard_dir', "point it at a writable directory or set it to "
                      "'' for no TensorBoard files"))
    if cfg.runtime.compilation_cache_dir:
      outputs.append((os.path.join(self.workdir, cfg.runtime.compilation_cache_dir),
                      'runtime.compilation_cache_dir', "point it at a writable directory or set "
                      "it to '' for no cache"))
    outputs.append((self.ckpt_root, 'the checkpoint directory',
                    'remove what is in its way in the workdir'))
    for path, what, fix in outputs:
      workdir_lib.check_writable(path, what, fix)

  def start(self, progress: Progress) -> None:
    """The run really starts: from here on the workdir changes. Damaged checkpoints are moved
    aside, the checkpoint manager opens, records past the resumed iteration are dropped, and the
    config and this job are recorded."""
    cfg = self.cfg
    self.started = True
    self.writer.open()
    if self.is_writer:
      for step, problem in sorted(self.damaged.items()):
        moved = checkpoints.move_damaged_aside(self.ckpt_root, step)
        self.writer.info(f'> checkpoint {step} is damaged ({problem}): moved aside to {moved}; '
                         f'it is not restored and not counted by the keep policy')
      if self.damaged:
        self.writer.info(f'> the run resumes from '
                         f'{f"checkpoint {progress.iteration}" if self.resume_step else "scratch"}'
                         f' (complete checkpoints: {self.resume_step or "none"})')
    if distributed.joined().is_multi_process:
      # No process opens the checkpoint manager while process 0 still moves damaged steps.
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices('t5x_like: damaged checkpoints moved aside')
    self.checkpointer = checkpoints.Checkpointer(
        self.ckpt_root, cfg.checkpoint.save_interval, cfg.checkpoint.max_to_keep, self.layout,
        keep_period=cfg.checkpoint.keep_period,
        kept_steps=self.resume_meta.get('kept_steps', []) if self.resume_step else ())
    self.compilation_cache = use_compilation_cache(self.workdir, cfg.runtime.compilation_cache_dir)
    # Records after the resumed iteration were written by a job that died before saving again;
    # with no checkpoint at all, the run starts its records afresh.
    self.writer.truncate_after(progress.iteration, progress.consumed_samples,
                               progress.consumed_tokens)
    if self.is_writer:
      workdir_lib.atomic_write_text(os.path.join(self.workdir, 'config.json'),
                                    cfg.to_json() + '\n')
      # The config and data seed of each job, from its first iteration on: the batch of any
      # iteration can be rebuilt after the config changed between jobs (data/replay.py).
      replay.record_job(self.workdir, progress.iteration + 1, cfg, self.data_seed)

  def release(self) -> None:
    """Ends the run's hold on its workdir (its lock); no-op when already released."""
    self.lock.release(started=self.started)

  # ---------------------------------------------------------------------------------- set-up

  @functools.cached_property
  def throughput_setup(self) -> dict[str, Any]:
    """What the step time depends on besides the data: devices, mesh, model, micro-batch, the
    ramp-up's padding, software (fixed for a job). Step-time baselines carry over from an earlier
    job only when this is equal."""
    cfg, device = self.cfg, jax.devices()[0]
    setup = {'platform': device.platform, 'device_kind': device.device_kind,
             'devices': jax.device_count(), 'processes': jax.process_count(),
             'mesh': dataclasses.asdict(cfg.mesh), 'pipeline': dataclasses.asdict(cfg.pipeline),
             'model': dataclasses.asdict(cfg.model), 'micro_batch_size': cfg.train.micro_batch_size,
             # A ramp-up step padded to more micro-batches takes longer under a pipeline.
             'rampup_microbatch_multiple': cfg.train.rampup_microbatch_multiple,
             'software': self.software}
    return json.loads(json.dumps(setup))  # as the checkpoint's meta holds it (lists, not tuples)

  def _seed_throughput(self, saved: dict[str, Any] | None) -> None:
    if not saved or not saved['baselines']:
      return
    if saved['setup'] != self.throughput_setup:
      self.restart_notes.append('> throughput: the checkpoint\'s job ran on another setup '
                                '(devices, mesh, model or software); this job measures its own '
                                'step-time baseline')
      return
    self.throughput.seed(saved['baselines'])
    first = saved['baselines'][0]
    self.restart_notes.append(
        f"> throughput: step times are compared with the earlier job's baseline from the start "
        f"({first['step_s']:.3g} s at global batch size {first['global_batch_size']}"
        f"{', ...' if len(saved['baselines']) > 1 else ''}): a device slow from this job's start "
        'is reported too')

  def _resumed_config(self, cfg: Config, meta: dict[str, Any]) -> Config:
    """The config a resumed run trains with: the checkpoint's data order and (with load_rng) its
    dropout seed; notes for the log say where the config's values were not used."""
    self.data_seed = meta['data']['seed']
    if self.data_seed != cfg.train.seed:
      self.restart_notes.append(f'> data order: seed {self.data_seed} of the checkpoint (the data '
                                'position is always resumed; train.seed does not change it)')
    saved_schedule = checkpoints.saved_lr_schedule(meta)
    if cfg.checkpoint.override_lr_scheduler and checkpoints.lr_schedule(cfg) != saved_schedule:
      self.restart_notes.append(f'> checkpoint.override_lr_scheduler: the config\'s schedule '
                                f'{checkpoints.lr_schedule(cfg)} replaces the checkpoint\'s '
                                f'{saved_schedule}')
    saved_seed = meta['rng']['seed']
    if not cfg.checkpoint.load_rng:
      note = ('the same stream as the checkpoint\'s: set another train.seed for new masks'
              if saved_seed == cfg.train.seed else f'not the checkpoint\'s seed {saved_seed}')
      self.restart_notes.append(f'> checkpoint.load_rng=False: dropout seed {cfg.train.seed} from '
                                f'the config ({note})')
      return cfg
    if saved_seed != cfg.train.seed:
      self.restart_notes.append(f'> dropout seed {saved_seed} from the checkpoint (config: '
                                f'{cfg.train.seed}; checkpoint.load_rng=False would use it)')
      return cfg.replace(train={'seed': saved_seed})
    return cfg

  def _open_data(self, cfg: Config) -> sources.DataSources:
    tokenizer = None
    if not cfg.data.train_path:  # the embedded corpus and its tokenizer
      tokenizer = Tokenizer.load_default()
      if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f'the tokenizer has {tokenizer.vocab_size} tokens but '
                          f'model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size >= '
                          f'{tokenizer.vocab_size}')
    try:
      return sources.build(cfg.data, cfg.train.seq_len, self.data_seed, tokenizer)
    except DataError as e:
      raise ConfigError(str(e)) from None

  def save_checkpoint(self, state: TrainState, progress: Progress) -> bool:
    meta = checkpoints.make_meta(self.cfg, progress, self.data_seed, self.adam_count_base,
                                 self.software, self.checkpointer.kept_steps)
    meta['throughput'] = {'setup': self.throughput_setup,
                          'baselines': self.throughput.baselines()}
    return self.checkpointer.save(state, progress, self.cfg, meta)

  def initial_state(self) -> tuple[TrainState, Progress]:
    cfg = self.cfg
    # Iteration and skipped count at which the Adam step count was 0 (`ckpt verify` checks it).
    self.adam_count_base = {'iteration': 0, 'skipped_iterations': 0}
    if self.resume_step:
      load_optimizer = cfg.checkpoint.load_optimizer or self.reset_done
      state, progress = checkpoints.restore(self.ckpt_root, self.layout, cfg,
                                            step=self.resume_step[-1],
                                            load_optimizer=load_optimizer)
      self.writer.info(f'> resumed from {self.ckpt_root}/{progress.iteration}: '
                       f'{progress.consumed_samples} samples consumed')
      self.adam_count_base = dict(self.resume_meta['adam_count_base'])
      if not load_optimizer:
        self.adam_count_base = {'iteration': progress.iteration,
                                'skipped_iterations': progress.skipped_iterations}
        self.writer.info('> checkpoint.load_optimizer=False: fresh Adam moments, Adam step count 0 '
                         '(once: a restart from a checkpoint saved with this flag loads its Adam '
                         'state)')
      elif self.reset_done:
        self.writer.info('> checkpoint.load_optimizer=False: already applied at iteration '
                         f"{self.adam_count_base['iteration']} by the job that saved this "
                         'checkpoint; its Adam state is loaded, not reset again')
      for note in self.restart_notes:
        self.writer.info(note)
      return state, progress
    if cfg.checkpoint.init_from:
      params = checkpoints.restore_params(cfg.checkpoint.init_from, self.layout, cfg)
      self.writer.info(f'> weights from {cfg.checkpoint.init_from}; fresh optimizer state')
      return TrainState(params, self.layout.fresh_opt_state(params)), Progress()
    return self.layout.init(cfg.train.seed), Progress()

  def batch_shape(self, global_batch_size: int, seq_len: int | None = None,
                  microbatches: int | None = None) -> tuple[int, int, int]:
    """[micro-batches, rows, S + 1]: the micro-batches the global batch fills unless
    `microbatches` (`Config.step_microbatches`) says how many the step runs with."""
    rows = self.cfg.train.micro_batch_size * self.cfg.mesh.data
    seq_len = self.cfg.train.seq_len if seq_len is None else seq_len
    if microbatches is None:
      microbatches = self.cfg.microbatches_for(global_batch_size)
    return (microbatches, rows, seq_len + 1)

  def global_batch(self, consumed_samples: int, global_batch_size: int,
                   source=None, what: str = 'training', seq_len: int | None = None,
                   padded_seq_len: int | None = None,
                   microbatches: int | None = None) -> jax.Array:
    """Samples consumed_samples.. of `source` (default: the training stream) as a sharded
    [micro-batches, rows, S + 1] array; each device reads only the rows it holds. An id outside
    the model's vocabulary is a DataError naming the samples. `seq_len` below train.seq_len (the
    curriculum) keeps the first seq_len + 1 tokens of each sample, as Megatron-DeepSpeed
    truncates its batch: the rest of the sample is consumed unseen. `padded_seq_len` (above
    seq_len; curriculum.pad_to_multiple) makes S that, the tokens after the first seq_len + 1
    losses.PAD_ID. `microbatches` (above the batch's own count; train.rampup_microbatch_multiple)
    adds micro-batches of losses.PAD_ID after the batch's."""
    source = self.source if source is None else source
    shape = self.batch_shape(global_batch_size,
                             seq_len if padded_seq_len is None else padded_seq_len, microbatches)
    trained = shape[2] if seq_len is None else seq_len + 1
    filled, rows_per_micro = self.cfg.microbatches_for(global_batch_size), shape[1]
    vocab_size = self.cfg.model.vocab_size

    def rows_for(index) -> np.ndarray:
      micro_slice, row_slice = index[0], index[1]
      micro = range(*micro_slice.indices(shape[0]))
      start, stop, _ = row_slice.indices(rows_per_micro)
      rows = np.full((len(micro), stop - start, shape[2]), losses.PAD_ID, np.int32)
      for i, m in enumerate(micro):
        if m >= filled:
          continue  # a micro-batch of padding
        samples = source.rows(consumed_samples + m * rows_per_micro + start,
                              consumed_samples + m * rows_per_micro + stop)[:, :trained]
        sources.check_token_ids(samples, vocab_size, f'{what} samples {consumed_samples}..'
                                f'{consumed_samples + global_batch_size - 1}')
        rows[i, :, :trained] = samples
      return rows[..., index[2]]

    return jax.make_array_from_callback(shape, self.batch_sharding, rows_for)

  def step_for(self, global_batch_size: int, seq_len: int):
    """The compiled step for this global batch size and sequence length (compiled once per
    micro-batch count the step runs with, `Config.step_microbatches`, and length)."""
    shape = self.batch_shape(global_batch_size, seq_len,
                             microbatches=self.cfg.step_microbatches(global_batch_size))
    key = (shape[0], shape[2])
    if key not in self._compiled:
      self._compiled[key] = self.compile(shape)
    return self._compiled[key]

  def eval_step_for(self, global_batch_size: int):
    shape = self.batch_shape(global_batch_size)
    if shape[0] not in self._compiled_eval:
      start = time.perf_counter()
      step = jax.jit(make_eval_step(self.cfg, self.layout),
                     in_shardings=(self.layout.shardings.params, self.batch_sharding))
      with self.watchdog.suspended():
        self._compiled_eval[shape[0]] = step.lower(
            self.layout.abstract.params,
            jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)).compile()
      self.writer.info(f'> compiled the evaluation step for {shape[0]} micro-batch(es) in '
                       f'{time.perf_counter() - start:.1f} s')
    return self._compiled_eval[shape[0]]

  def evaluate(self, state: TrainState, progress: Progress, sets: dict,
               at_end: bool = False) -> dict[str, float]:
    """Mean loss of eval.iters batches (the current global batch size) from the start of each
    set: the same samples at every evaluation, so evaluations compare. Logged Megatron-style."""
    gbs = self.cfg.train.global_batch_size_at(progress.consumed_samples)
    step = self.eval_step_for(gbs)
    results = {}
    for name, source in sets.items():
      self.watchdog.beat(f'evaluating {name!r} at iteration {progress.iteration}')
      start = time.perf_counter()
      batch_losses = [step(state.params, self.global_batch(i * gbs, gbs, source, f'{name!r}'))
                      for i in range(self.cfg.eval.iters)]
      loss = float(np.mean(jax.device_get(batch_losses)))
      results[name] = loss
      self.writer.eval_record({
          'iteration': progress.iteration, 'consumed_samples': progress.consumed_samples,
          'consumed_tokens': progress.consumed_tokens, 'set': name, 'lm_loss': loss,
          'ppl': metrics.perplexity(loss),
          'samples': self.cfg.eval.iters * gbs, 'eval_time_s': time.perf_counter() - start,
      }, (f'the end of training (iteration {progress.iteration})' if at_end
          else f'iteration {progress.iteration}'))
    return results

  def compile(self, batch_shape: tuple[int, int, int]):
    start = time.perf_counter()
    with self.watchdog.suspended():
      compiled = lower_train_step(self.cfg, self.layout, batch_shape[0],
                                  batch_shape[2] - 1).compile()
    bubble = ''
    if self.cfg.mesh.pipeline > 1:
      fraction = self.layout.plan.bubble_fraction(batch_shape[0],
                                                  self.cfg.pipeline.microbatch_group)
      bubble = f', pipeline bubble {fraction:.3f}'
    self.writer.info(f'> compiled the train step for {batch_shape[0]} micro-batch(es) of '
                     f'{batch_shape[1]}x{batch_shape[2]} tokens in '
                     f'{time.perf_counter() - start:.1f} s{bubble}')
    return compiled

  def describe_pipeline(self) -> str:
    """Stage plan, and parameters held per stage (all of a stage's tensor ranks together)."""
    plan, sizes = self.layout.plan, []
    per_slot, shared = 0, 0
    for path, a in jax.tree_util.tree_flatten_with_path(self.layout.logical.params)[0]:
      if pipeline.is_layer_leaf(path):
        per_slot += a.size // plan.num_slots
      else:
        axes = [x for ax in a.sharding.spec if ax
                for x in (ax if isinstance(ax, tuple) else (ax,))]
        shared += a.size // (self.mesh.shape['pipeline'] if 'pipeline' in axes else 1)
    for s in range(plan.stages):
      sizes.append((plan.layers_per_stage()[s] * per_slot + shared) / 1e6)
    return (f'> pipeline: {plan.describe()}; parameters per stage (M): '
            f'{[round(x, 2) for x in sizes]} (embedding spread over stages: '
            f'{self.cfg.padded_vocab_size % (self.cfg.mesh.tensor * plan.stages) == 0})')

  def describe_curriculum(self) -> str:
    c, seq = self.cfg.curriculum, self.cfg.train.seq_len
    lengths, step_lengths = self.cfg.seq_lens(), self.cfg.step_seq_lens()
    shape = 'linear' if c.schedule == 'fixed_linear' else f'root of degree {c.root_degree}'
    # Each length the step runs at is its own XLA program: many mean many compilations.
    if c.pad_to_multiple:
      compiled = (f'run at {len(step_lengths)} lengths padded to multiples of '
                  f'{c.pad_to_multiple} (padding outside the loss), the step compiled for each '
                  'when first reached')
    else:
      compiled = 'the step compiled for each when first reached' + (
          '; curriculum.pad_to_multiple or a larger curriculum.difficulty_step compiles fewer'
          if len(lengths) > 16 else '')
    return (f'> curriculum: sequence length {c.min_seq_len} -> {seq} in multiples of '
            f'{c.difficulty_step} over iterations 1-{c.total_iterations} ({shape}): '
            f'{len(lengths)} lengths, {compiled}; evaluation at {seq}' +
            (f'; learning rate decays over {self.cfg.optimizer.decay_tokens} tokens from the '
             f'{self.warmup_end_tokens} of the warm-up' if self.cfg.optimizer.decay_tokens
             else ''))

  # ------------------------------------------------------------------------------------ loop

  def check_data(self, progress: Progress) -> None:
    """Reads the next training batch and the first batch of every evaluation set once, before
    anything is compiled: ids outside the vocabulary are an error now, not after compiling."""
    gbs = self.cfg.train.global_batch_size_at(progress.consumed_samples)
    self.global_batch(progress.consumed_samples, gbs)
    if self.cfg.eval.interval:
      # Evaluations use the batch size of their time: at most the full one.
      self.data.check_evaluation(self.cfg.eval.iters, self.cfg.train.global_batch_size)
      for name, source in {**self.data.valid, 'test': self.data.test}.items():
        if source is not None:
          self.global_batch(0, gbs, source, f'{name!r}')
    for note in self.data.notes:
      self.writer.info(note)
    total = self.cfg.train.total_samples()
    for name, drawn, per_epoch in self.data.epochs(total):
      self.writer.info(f'> data: {name}: {drawn} of the run\'s {total} training samples, '
                       f'{drawn / per_epoch:.3g} epoch(s) of its {per_epoch} training samples')

  def skip_iteration(self, progress: Progress, total: int) -> None:
    """data.skip_train_iteration_range: the iteration's samples are consumed, nothing trains;
    the optimizer does not step, so it counts as a skipped iteration (Adam's count agrees)."""
    first = progress.iteration + 1
    if not self._skipping:  # the first of a run of skipped iterations
      self._skipping = True
      last = next(b for a, b in self.cfg.data.skip_ranges() if a <= first <= b)
      self.writer.info(f'> data.skip_train_iteration_range: iterations {first}-{min(last, total)}'
                       f' consume their samples without training (from sample '
                       f'{progress.consumed_samples})')
    gbs = self.cfg.train.global_batch_size_at(progress.consumed_samples)
    progress.iteration += 1
    progress.consumed_samples += gbs
    progress.consumed_tokens += gbs * self.cfg.seq_len_at(progress.iteration)
    progress.skipped_iterations += 1

  def train_iteration(self, state: TrainState, progress: Progress,
                      total: int) -> tuple[TrainState, bool]:
    """One train step on the next global batch; logs the Megatron line and a metrics record.
    Returns the new state and whether the step was finite (a non-finite one changed nothing)."""
    cfg = self.cfg
    self._skipping = False
    seq = cfg.seq_len_at(progress.iteration + 1)
    padded_seq = cfg.padded_seq_len_at(progress.iteration + 1)  # what the step runs at
    gbs = cfg.train.global_batch_size_at(progress.consumed_samples)
    compiled = self.step_for(gbs, padded_seq)
    flops = metrics.megatron_flops_per_iteration(cfg, gbs, seq)
    lr = optim.learning_rate(cfg.optimizer, progress.consumed_samples, progress.consumed_tokens,
                             self.warmup_end_tokens)
    start = time.perf_counter()
    step_micro = cfg.step_microbatches(gbs)
    batch = self.global_batch(progress.consumed_samples, gbs, seq_len=seq,
                              padded_seq_len=padded_seq, microbatches=step_micro)
    state, stats = compiled(state, batch, np.float32(lr), np.int32(progress.iteration))
    stats = jax.device_get(stats)
    elapsed = time.perf_counter() - start
    progress.iteration += 1
    progress.consumed_samples += gbs
    progress.consumed_tokens += gbs * seq
    progress.skipped_iterations += int(not stats['finite'])
    progress.nan_iterations += int(not stats['loss_finite'])
    tflops = flops / (elapsed * cfg.mesh.num_devices * 1e12)
    record = {
        'iteration': progress.iteration,
        'consumed_samples': progress.consumed_samples,
        'consumed_tokens': progress.consumed_tokens,
        'learning_rate': lr,
        'global_batch_size': gbs,
        'seq_len': seq,
        'lm_loss': float(stats['lm_loss']),
        'grad_norm': float(stats['grad_norm']),
        'num_zeros': float(stats['num_zeros']),
        'step_time_s': elapsed,
        'samples_per_sec': gbs / elapsed,
        'tokens_per_sec': gbs * seq / elapsed,
        'tflops': tflops,
        'mfu': tflops / self.peak_tflops,
        'skipped_iterations': progress.skipped_iterations,
        'nan_iterations': progress.nan_iterations,
    }
    if cfg.mesh.pipeline > 1:
      record['pipeline_bubble'] = self.layout.plan.bubble_fraction(
          step_micro, cfg.pipeline.microbatch_group)
    if cfg.curriculum.enabled:
      record['curriculum_seq_len'] = seq
    if cfg.curriculum.pad_to_multiple:
      record['padded_seq_len'] = padded_seq
    if cfg.train.rampup_microbatch_multiple:
      record['padded_microbatches'] = step_micro
    self.writer.record(record, total)
    finite = bool(stats['finite'])
    # The step time follows the length the step runs at (model FLOPs count the trained one).
    slowdown = self.throughput.add(progress.iteration, gbs, elapsed,
                                   padded_seq if cfg.curriculum.enabled else 0)
    if slowdown:
      self.writer.info(slowdown)
      self.alerts.send('slowdown', slowdown, progress.iteration)
    spike = self.spikes.add(progress.iteration, record['lm_loss'], record['grad_norm'])
    if spike:
      self.report_spike(spike, progress.iteration)
    return state, finite

  def check_replicas(self, state: TrainState, iteration: int) -> list[str]:
    """runtime.replica_check_interval: the replicated arrays whose copies differ, on this
    process's devices or across processes (the chronicles' LayerNorm weights that drifted apart
    across tensor ranks, found weeks later). One SPMD program updates every copy alike, so this
    should never find one; the check makes that a measured fact of the run, not an assumption.
    Every process calls it at the same iteration (a collective) and reaches the same verdict."""
    drifted = partitioning.replica_report(state)
    if drifted:
      where = '; '.join(f'{m.path} on process{"es" * (len(m.processes) > 1)} '
                        f'{", ".join(map(str, m.processes))}' for m in drifted)
      message = (f'> replica check at iteration {iteration}: the copies of '
                 f'{", ".join(m.path for m in drifted)} differ across devices. Resume from the '
                 'last checkpoint (a restore reads one copy) and report it with this log. The '
                 f'differing copies: {where}')
      self.writer.info(message)
      self.alerts.send('replica_mismatch', message, iteration)
      if not self.is_writer:
        print(message, file=sys.stderr, flush=True)
    elif jax.process_count() == 1:
      self.writer.info(f'> replica check at iteration {iteration}: every replicated array of the '
                       f'params and optimizer state is identical on this process\'s '
                       f'{self.mesh.devices.size} devices')
    else:
      self.writer.info(f'> replica check at iteration {iteration}: every replicated array of the '
                       'params and optimizer state is identical on all '
                       f'{self.mesh.devices.size} devices of the {jax.process_count()} processes')
    return [m.path for m in drifted]

  def report_spike(self, message: str, iteration: int) -> None:
    """Logs a spike with what a user needs next: the checkpoint from before it, kept past the
    keep policy, and the command that shows the batch it trained on."""
    kept = self.checkpointer.keep_last_before(iteration)
    where = (f'checkpoint {kept} (the last before it) is kept past checkpoint.max_to_keep'
             if kept is not None else 'no checkpoint was saved before it')
    self.writer.info(f'{message}. {where}; its batch: python -m t5x_like.data batch '
                     f'{self.workdir} --iteration {iteration}')
    self.alerts.send('spike', message, iteration)

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
      self.writer.info(f'> kill switch {rt.kill_switch_path} exists: exiting without training '
                       '(remove the file to train)')
      return self.resume_progress
    # Only the process that writes the log appends the stacks of a hang to it; every process
    # prints its own to stderr.
    log_path = self.writer.log_path if self.is_writer else None
    on_hang = functools.partial(self.alerts.send, 'hang')
    own_stop = stop is None
    stop_context = (runtime.StopConditions(rt.kill_switch_path, rt.exit_duration_mins,
                                           num_processes=jax.process_count())
                    if own_stop else contextlib.nullcontext(stop))
    try:
      with stop_context as stop, \
          runtime.Watchdog(rt.hang_timeout_mins * 60.0, log_path, on_hang) as self.watchdog, \
          self.writer:
        try:
          return self._train(stop)
        finally:
          self._close_checkpointer()
    except runtime.Interrupted as e:
      self.stop_reason = runtime.StopReason.SIGNAL
      if self.started:
        self.writer.info(f'> stopped: {e}')
        self.alerts.send('stopped', f'> stopped: {e}', self.resume_progress.iteration)
      if own_stop:
        return self.resume_progress
      raise
    except Exception as e:
      if self.started:
        self.alerts.send('crashed', f'{type(e).__name__}: {e}')
      raise
    finally:
      self.alerts.wait()
      self.release()

  def _close_checkpointer(self) -> None:
    """Waits for the save in flight (a SaveError if it failed, unless another error is already
    on its way out)."""
    if self.checkpointer is None:
      return
    checkpointer, self.checkpointer = self.checkpointer, None
    failing = sys.exc_info()[1] is not None
    try:
      checkpointer.close()
    except checkpoints.SaveError:
      if not failing:
        raise

  def save_or_stop(self, state: TrainState, progress: Progress) -> bool:
    """Saves; a state with non-finite params is never written: the run then stops as diverged.
    Returns whether the run goes on."""
    try:
      self.save_checkpoint(state, progress)
      return True
    except checkpoints.NonFiniteStateError as e:
      self.stop_diverged(f'> {e}')
      return False

  def stop_diverged(self, message: str) -> None:
    """Marks the run diverged and says what to do, with the chronicles' remedies."""
    self.stop_reason = runtime.StopReason.DIVERGED
    saved = self.checkpointer.saved_steps()
    before = saved[-1] if saved else None
    first = self.divergence.first_non_finite or self.divergence.last_finite.iteration + 1
    rollback = (f'roll back to checkpoint {before} (delete or move the later steps of '
                f'{self.ckpt_root}) and rerun' if before is not None else
                'no checkpoint was saved: rerun from scratch')
    self.writer.info(
        f'{message}. What to try (the BLOOM runs\' remedies): {rollback}; skip the data that '
        f'diverged with --config.data.skip_train_iteration_range="(\'{first}-{first + 99}\',)" '
        f'(its batch: python -m t5x_like.data batch {self.workdir} --iteration {first}); lower '
        'optimizer.lr (with checkpoint.override_lr_scheduler=True); or reset the optimizer '
        '(checkpoint.load_optimizer=False with lr 0 while the Adam moments warm up, README '
        '"Restart controls")')
    self.alerts.send('diverged', message, self.divergence.last_finite.iteration)

  def _train(self, stop: runtime.StopConditions) -> Progress:
    cfg = self.cfg
    num_params = cfg.model.num_params(cfg.mesh.tensor)
    self.writer.info(f'> t5x_like: {cfg.model.architecture} with {num_params / 1e6:.2f}M params '
                     f'on mesh data={cfg.mesh.data} pipeline={cfg.mesh.pipeline} '
                     f'tensor={cfg.mesh.tensor} ({jax.device_count()} {jax.devices()[0].platform} '
                     f'devices); {cfg.num_microbatches} micro-batch(es) of '
                     f'{cfg.train.micro_batch_size} per data rank')
    self.writer.info(f'> software: {provenance.describe(self.software)}')
    self.writer.info(describe_zero(self.layout))
    # Everything that can refuse the run comes before start(): the restore and the data check.
    state, progress = self.initial_state()
    self.check_data(progress)
    self.start(progress)
    if self.compilation_cache:
      entries = len(os.listdir(self.compilation_cache))
      self.writer.info(f'> compilation cache: {self.compilation_cache} ({entries} programs stored; '
                       'a program found there is loaded instead of compiled)')
    self.peak_tflops, peak_source = metrics.device_peak_tflops(cfg.model.dtype)
    self.writer.info(f'> MFU reference: {self.peak_tflops:.4f} TFLOP/s per device '
                     f'({peak_source})')
    if cfg.mesh.pipeline > 1:
      self.writer.info(self.describe_pipeline())
    if cfg.curriculum.enabled:
      self.writer.info(self.describe_curriculum())
    if cfg.curriculum.enabled or cfg.train.rampup_batch_size:
      # Each is an XLA compilation while every device waits: say up front how many there are.
      shapes = cfg.step_shapes()
      self.writer.info(f'> the train step runs at {len(shapes)} shapes over the run (micro-'
                       'batches x length: batch ramp-up, curriculum), each compiled when first '
                       'reached (`python -m t5x_like.plan` times one compilation)')
    if cfg.train.rampup_microbatch_multiple:
      padding, runs = cfg.padding_microbatches()
      cost = ('the pipeline computes them' if cfg.mesh.pipeline > 1 else
              'the step skips them')
      self.writer.info(f'> ramp-up: micro-batch counts rounded up to multiples of '
                       f'{cfg.train.rampup_microbatch_multiple}, {padding} of the run\'s {runs} '
                       f'micro-batches ({100 * padding / max(runs, 1):.2f}%) padding ({cost})')
    start_iteration = progress.iteration
    total = self.cfg.train.total_iterations()
    evaluate_every = cfg.eval.interval
    if progress.iteration < total:
      # Compiled now rather than in the loop: a signal during compilation ends the run at once,
      # and a failure shows in the first minutes rather than at iteration 1000.
      next_iteration = progress.iteration + 1
      self.step_for(cfg.train.global_batch_size_at(progress.consumed_samples),
                    cfg.padded_seq_len_at(next_iteration))
      if evaluate_every:
        self.eval_step_for(cfg.train.global_batch_size_at(progress.consumed_samples))
    stop.start_training()
    last_evaluated = None
    while progress.iteration < total:
      # The job's first step also sets up the communicators of its collectives: more time.
      self.watchdog.beat(f'in iteration {progress.iteration + 1}',
                         grace=runtime.FIRST_ITERATION_GRACE
                         if progress.iteration == start_iteration else 1.0)
      self.stop_reason = stop.poll()
      if self.stop_reason is not None:
        self.writer.info(f'> stopping at iteration {progress.iteration}: '
                         f'{stop.describe(self.stop_reason)}')
        break
      if cfg.data.skips(progress.iteration + 1):
        self.skip_iteration(progress, total)
      else:
        state, finite = self.train_iteration(state, progress, total)
        diverged = self.divergence.add(progress, finite)
        if diverged:
          # The skipped iterations left the state as the last finite one left it: keep that.
          last = self.divergence.last_finite
          if last.iteration > start_iteration:
            self.save_or_stop(state, last)
          self.stop_diverged(diverged)
          break
        replica_every = cfg.runtime.replica_check_interval
        if replica_every and progress.iteration % replica_every == 0:
          self.check_replicas(state, progress.iteration)
      # Not in the middle of non-finite iterations: a divergence keeps the last finite state.
      if self.checkpointer.should_save(progress.iteration) and not self.divergence.consecutive:
        if not self.save_or_stop(state, progress):
          break
      if evaluate_every and progress.iteration % evaluate_every == 0:
        self.evaluate(state, progress, self.data.valid)
        last_evaluated = progress.iteration
    trained = progress.iteration > start_iteration
    diverged = self.stop_reason is runtime.StopReason.DIVERGED
    if trained and not diverged:  # at the end, or before leaving early
      self.watchdog.beat(f'saving the checkpoint of iteration {progress.iteration}')
      self.save_or_stop(state, progress)
    diverged = self.stop_reason is runtime.StopReason.DIVERGED
    if evaluate_every and trained and not diverged and progress.iteration >= total:
      # The end of training (not an early stop): the validation sets unless just done, and the
      # test split, as Megatron evaluates after its last iteration.
      if last_evaluated != progress.iteration:
        self.evaluate(state, progress, self.data.valid)
      if self.data.test is not None:
        self.evaluate(state, progress, {'test': self.data.test}, at_end=True)
    self._close_checkpointer()
    code = runtime.exit_code(self.stop_reason)
    ended = (f'> {"done" if self.stop_reason is None else "stopped"}: '
             f'{progress.iteration} iterations, {progress.consumed_samples} samples; '
             f'exit code {int(code)} ({code.name})')
    self.writer.info(ended)
    if not diverged:
      self.alerts.send('finished' if self.stop_reason is None else 'stopped', ended,
                       progress.iteration)
    self.final_state = state
    return progress


def use_compilation_cache(workdir: str, cache_dir: str) -> str | None:
  """Points JAX's persistent compilation cache at runtime.compilation_cache_dir (relative to the
  workdir); returns its absolute path, or None when it is off. Programs that compile in under a
  second are not stored (JAX's default threshold): loading them would gain nothing."""
  if not cache_dir:
    return None
  path = os.path.join(workdir, cache_dir)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(f'runtime.compilation_cache_dir: cannot create {path} ({e.strerror}); '
                      "point it at a writable directory or set it to '' for no cache") from None
  if jax.config.jax_compilation_cache_dir != path:
    jax.config.update('jax_compilation_cache_dir', path)
    # JAX opens its cache once per process, at the first compilation that finds a directory set;
    # a cache opened before this (another Trainer in the same process) would keep its directory.
    compilation_cache.reset_cache()
  return path


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
