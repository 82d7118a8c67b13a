"""One iteration of the loop (Trainer.train_iteration): the step compiled for the iteration's
global batch size and length, the learning rate, the batch, the step, and the iteration's
metrics record."""

from __future__ import annotations

import time

import jax
import numpy as np

from t5x_like.config import Config
from t5x_like.parallel.train_state import Progress, TrainState
from t5x_like.training import accounting, batches, device_memory, schedule
from t5x_like.training.evaluation import TrainingEvaluator
from t5x_like.training.step import CompiledSteps


class TrainIteration:
  """What one iteration of the loop does, timed from the batch to the stats on the host; the
  record is accounting.iteration_record's. `peak` is the run's accounting.PeakReference, the MFU
  reference."""

  def __init__(
    self, cfg: Config, layout, steps: CompiledSteps, batch_sharding, peak, lr_zero_until: int = 0
  ):
    self.cfg, self.layout, self.steps, self.batch_sharding = cfg, layout, steps, batch_sharding
    self.peak = peak
    # The iterations up to this one train at lr 0 (an optimizer reset's warm-up, resume.py).
    self.lr_zero_until = lr_zero_until
    # optimizer.decay_tokens counts from here (a pure function of the config).
    self.warmup_end_tokens = schedule.warmup_end_tokens(cfg) if cfg.optimizer.decay_tokens else 0

  def compile_ahead(self, progress: Progress, evaluator: TrainingEvaluator) -> None:
    """Compiles the next iteration's step (and the evaluation step) before the loop rather than
    in it: a signal during compilation ends the run at once, and a failure shows in the first
    minutes rather than at iteration 1000. Where the device's memory is known, also the step of
    the run's last iteration, the largest (the full batch size and length after a ramp-up or a
    curriculum): a step that would not fit there is one error now, not days into the run."""
    cfg = self.cfg
    gbs = schedule.global_batch_size_at(cfg.train, progress.consumed_samples)
    self.steps.get(gbs, schedule.padded_seq_len_at(cfg, progress.iteration + 1))
    if self.steps.memory_limit is not None:
      last = schedule.total_iterations(cfg.train)
      largest = (cfg.train.global_batch_size, schedule.padded_seq_len_at(cfg, last))
      if not self.steps.compiled(*largest):
        self.steps.log(
          f"> the run's largest step (iteration {last}'s, {largest[0]} samples of "
          f'{largest[1]} tokens) is compiled now to check that it fits in memory'
        )
        self.steps.get(*largest)
    if cfg.eval.interval:
      evaluator.step_for(gbs)

  def __call__(
    self, state: TrainState, progress: Progress, source
  ) -> tuple[TrainState, dict, bool]:
    cfg = self.cfg
    seq = schedule.seq_len_at(cfg, progress.iteration + 1)
    padded_seq = schedule.padded_seq_len_at(cfg, progress.iteration + 1)  # what the step runs at
    gbs = schedule.global_batch_size_at(cfg.train, progress.consumed_samples)
    compiled = self.steps.get(gbs, padded_seq)
    lr = schedule.learning_rate(
      cfg.optimizer, progress.consumed_samples, progress.consumed_tokens, self.warmup_end_tokens
    )
    if progress.iteration + 1 <= self.lr_zero_until:
      lr = 0.0
    start = time.perf_counter()
    step_micro = schedule.step_microbatches(cfg, gbs)
    batch = batches.global_batch(
      cfg,
      self.batch_sharding,
      source,
      progress.consumed_samples,
      gbs,
      seq_len=seq,
      padded_seq_len=padded_seq,
      microbatches=step_micro,
    )
    state, stats = compiled(state, batch, np.float32(lr), np.int32(progress.iteration))
    stats = jax.device_get(stats)
    elapsed = time.perf_counter() - start
    progress.advance(gbs, seq)
    progress.skipped_iterations += int(not stats['finite'])
    progress.nan_iterations += int(not stats['loss_finite'])
    bubble = (
      self.layout.placement.bubble_fraction(step_micro, cfg.pipeline.microbatch_group)
      if cfg.mesh.pipeline > 1
      else None
    )
    peak = self.peak.measured[0]
    record = accounting.iteration_record(
      cfg, progress, lr, gbs, seq, padded_seq, step_micro, stats, elapsed, peak, bubble
    )
    counted = device_memory.allocator_bytes()
    if counted is not None:
      record['peak_memory_gib'] = round(counted[0] / 2**30, 3)
    return state, record, bool(stats['finite'])
