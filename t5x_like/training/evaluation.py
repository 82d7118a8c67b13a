"""Evaluation during training (eval.interval): the validation sets' loss at an iteration, and
the test split at the end. Registers its own hooks
(`register`), as training/run_checkpoints.py does."""

from __future__ import annotations

from typing import Any

import numpy as np

from t5x_like.config import Config


class TrainingEvaluator:
  """The training run's evaluation (eval.interval): the mean loss of eval.iters batches (the
  current global batch size) from the start of each validation set, the same samples at every
  evaluation so evaluations compare, logged Megatron-style; at the end of training also the
  test split, as Megatron evaluates after its last iteration. One compiled evaluation step per
  micro-batch count. `watchdog` is the run's runtime.Watchdog."""

  def __init__(self, cfg: Config, layout, batch_sharding, data, writer, watchdog):
    self.cfg, self.layout, self.batch_sharding = cfg, layout, batch_sharding
    self.data, self.writer, self.watchdog = data, writer, watchdog
    self.compiled: dict[int, Any] = {}
    self.last_evaluated: int | None = None

  def step_for(self, global_batch_size: int):
    import time

    import jax
    import jax.numpy as jnp

    from t5x_like.training import batches
    from t5x_like.training.step import make_eval_step

    shape = batches.batch_shape(self.cfg, global_batch_size)
    if shape[0] not in self.compiled:
      start = time.perf_counter()
      step = jax.jit(
        make_eval_step(self.cfg, self.layout),
        in_shardings=(self.layout.shardings.params, self.batch_sharding),
      )
      with self.watchdog.suspended():
        self.compiled[shape[0]] = step.lower(
          self.layout.abstract.params,
          jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding),
        ).compile()
      self.writer.info(
        f'> compiled the evaluation step for {shape[0]} micro-batch(es) in '
        f'{time.perf_counter() - start:.1f} s'
      )
    return self.compiled[shape[0]]

  def evaluate(self, state, progress, sets: dict, at_end: bool = False) -> dict[str, float]:
    import time

    import jax

    from t5x_like.training import accounting, batches, schedule

    gbs = schedule.global_batch_size_at(self.cfg.train, progress.consumed_samples)
    step = self.step_for(gbs)
    results = {}
    for name, source in sets.items():
      self.watchdog.beat(f'evaluating {name!r} at iteration {progress.iteration}')
      start = time.perf_counter()
      batch_losses = [
        step(
          state.params,
          batches.global_batch(self.cfg, self.batch_sharding, source, i * gbs, gbs, f'{name!r}'),
        )
        for i in range(self.cfg.eval.iters)
      ]
      loss = float(np.mean(jax.device_get(batch_losses)))
      results[name] = loss
      self.writer.eval_record(
        {
          'iteration': progress.iteration,
          'consumed_samples': progress.consumed_samples,
          'consumed_tokens': progress.consumed_tokens,
          'set': name,
          'lm_loss': loss,
          'ppl': accounting.perplexity(loss),
          'samples': self.cfg.eval.iters * gbs,
          'eval_time_s': time.perf_counter() - start,
        },
        (
          f'the end of training (iteration {progress.iteration})'
          if at_end
          else f'iteration {progress.iteration}'
        ),
      )
    self.last_evaluated = progress.iteration
    return results

  def register(self, hooks) -> None:
    """Adds the evaluation to the run's hooks (hooks.Hooks), when eval.interval is set: every
    eval.interval iterations, and at the end of training."""
    if self.cfg.eval.interval:
      hooks.add_hook(self.iteration_hook, every=self.cfg.eval.interval)
      hooks.at_end(self.end_hook)

  def iteration_hook(self, info) -> None:
    """Every eval.interval iterations (hooks.Hooks.add_hook): the validation sets."""
    self.evaluate(info.state, info.progress, self.data.valid)

  def end_hook(self, info) -> None:
    """At the end of training (not an early stop), if it trained: the validation sets unless
    just done, and the test split."""
    if info.stop_reason is not None or info.iteration <= info.start_iteration:
      return
    if self.last_evaluated != info.iteration:
      self.evaluate(info.state, info.progress, self.data.valid)
    if self.data.test is not None:
      self.evaluate(info.state, info.progress, {'test': self.data.test}, at_end=True)
