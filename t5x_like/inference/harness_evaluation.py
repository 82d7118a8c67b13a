"""lm-evaluation-harness tasks on the live params during training (eval.harness_tasks): the
harness backend (`harness_lm.T5xLikeLM`) over a copy of the train state's params, every
eval.harness_interval iterations and at the end, each task's metrics written to the log,
eval_metrics.jsonl and TensorBoard as the validation sets' are. The train command registers it
on the Trainer's hooks (`register`), as Levanter adds its evaluation hooks.

A task that fails is one line in the log (and a 'harness_failed' alert), never the end of the
run: the next evaluation tries again.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from t5x_like.config import Config, ConfigError


def task_names(cfg: Config) -> list[str]:
  """eval.harness_tasks as a list of names."""
  return [name.strip() for name in cfg.eval.harness_tasks.split(',') if name.strip()]


def harness_tokenizer(path: str):
  """eval.harness_tokenizer: a tokenizer.json (or its directory), a SentencePiece .model, or
  ('') the shipped tokenizer."""
  from t5x_like.inference.harness_lm import load_tokenizer

  if path.endswith('.model'):
    return load_tokenizer(tokenizer_model=path)
  return load_tokenizer(tokenizer_json=path or None)


@functools.cache
def indexed_tasks(include_path: str):
  """The harness's TaskManager over its own tasks and those of `include_path`, made once per
  process: indexing the harness's some 15,000 task YAMLs takes seconds."""
  from lm_eval.tasks import TaskManager

  return TaskManager(include_path=include_path or None)


def task_manager(cfg: Config):
  """The harness's TaskManager with eval.harness_include_path, every task name checked: one
  ConfigError naming the unknown ones, before the run starts."""
  import importlib.util
  import os

  if importlib.util.find_spec('lm_eval') is None:
    raise ConfigError("eval.harness_tasks needs lm-evaluation-harness: pip install -e '.[eval]'")
  include = cfg.eval.harness_include_path
  if include and not os.path.isdir(include):
    raise ConfigError(f'eval.harness_include_path {include!r} is not a directory')
  manager = indexed_tasks(os.path.abspath(include) if include else '')
  unknown = [name for name in task_names(cfg) if name not in manager.all_tasks]
  if unknown:
    raise ConfigError(
      f'eval.harness_tasks: no task named {", ".join(map(repr, unknown))} in the harness'
      + (f' or in {include}' if include else '')
      + ' (python -m lm_eval ls tasks lists them; eval.harness_include_path adds a folder of '
      'task YAMLs)'
    )
  return manager


def task_metrics(results: dict[str, Any], names) -> dict[str, float]:
  """The metrics `names` (the task's, as the harness's 'higher_is_better' lists them) of one
  task's harness results ({'acc,none': 0.5, 'acc_stderr,none': ..., 'alias': ...,
  'sample_len': ...}) by name: 'acc', or 'exact_match/strict-match' for a filter other than
  'none'."""
  metrics = {}
  for key, value in results.items():
    name, _, filtered = key.partition(',')
    if name not in names or not isinstance(value, (int, float)) or isinstance(value, bool):
      continue
    metrics[name if filtered in ('', 'none') else f'{name}/{filtered}'] = float(value)
  return metrics


class HarnessEvaluator:
  """The run's harness evaluation (eval.harness_*). `trainer` is the training.trainer.Trainer
  whose state it evaluates: its config, layout, writer, alerts and watchdog. Constructing it
  checks the tasks and the tokenizer (ConfigError) and builds the inference layout: a
  data 1 x pipeline 1 x tensor T copy of the model on the first T devices."""

  def __init__(self, trainer):
    from t5x_like.inference.loading import inference_config
    from t5x_like.mesh import partitioning
    from t5x_like.parallel.train_state import make_layout

    self.cfg, self.tasks = trainer.cfg, task_names(trainer.cfg)
    self.train_layout, self.writer = trainer.layout, trainer.writer
    self.alerts, self.watchdog = trainer.alerts, trainer.watchdog
    self.manager = task_manager(self.cfg)
    self.tokenizer = harness_tokenizer(self.cfg.eval.harness_tokenizer)
    self.inference_cfg = inference_config(self.cfg, tensor=self.cfg.mesh.tensor, with_data=False)
    self.layout = make_layout(
      self.inference_cfg, partitioning.make_mesh(1, 1, self.cfg.mesh.tensor)
    )
    self.last_evaluated: int | None = None

  def register(self, hooks) -> None:
    """Every eval.harness_interval iterations (if set), and at the end of training."""
    if self.cfg.eval.harness_interval:
      hooks.add_hook(self.iteration_hook, every=self.cfg.eval.harness_interval)
    hooks.at_end(self.end_hook)

  def iteration_hook(self, info) -> None:
    self.evaluate(info.state, info.progress)

  def end_hook(self, info) -> None:
    """At the end of training, if it trained and was not just evaluated."""
    if info.iteration > info.start_iteration and self.last_evaluated != info.iteration:
      self.evaluate(info.state, info.progress, at_end=True)

  def live_params(self, state):
    """The train state's params as the inference layout holds them (canonical order, no ZeRO
    split or padding, the compute shardings of the data 1 x 1 x T mesh)."""
    import jax

    canonical = self.train_layout.to_canonical(state.params, 'params')
    target = jax.tree.map(lambda a: a.sharding, self.layout.canonical.params)
    placed = jax.device_put(canonical, target)
    return self.layout.compute_params(self.layout.from_canonical(placed, 'params'))

  def evaluate(self, state, progress, at_end: bool = False) -> dict[str, dict[str, float]]:
    """Runs the tasks on `state`'s params, one after another; {task: {metric: value}} of those
    that ran. A task that fails is one log line and alert; the others still run."""
    from t5x_like.inference.harness_lm import T5xLikeLM

    at = (
      f'the end of training (iteration {progress.iteration})'
      if at_end
      else f'iteration {progress.iteration}'
    )
    self.last_evaluated = progress.iteration  # tried here: the end does not try again
    model = None
    out = {}
    for task in self.tasks:
      self.watchdog.beat(f'running the harness task {task!r} at iteration {progress.iteration}')
      try:
        if model is None:  # once per evaluation: a copy of the live params
          model = T5xLikeLM.from_params(
            self.inference_cfg,
            self.live_params(state),
            self.tokenizer,
            batch_size=self.cfg.eval.harness_batch_size,
          )
        out[task] = self.run_task(model, task, progress, at)
      except Exception as e:  # a task's failure is reported, never the end of the run
        message = f'> harness: the task {task} failed at {at}: {type(e).__name__}: {e}'
        self.writer.info(message)
        self.alerts.send('harness_failed', message, progress.iteration)
    return out

  def run_task(self, model, task: str, progress, at: str) -> dict[str, float]:
    """One task through the harness (lm_eval.simple_evaluate), its metrics written."""
    import time

    import lm_eval

    start, limit = time.perf_counter(), self.cfg.eval.harness_limit
    with self.watchdog.suspended():  # compilations and the task's loading, besides the requests
      results = lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        limit=limit or None,
        task_manager=self.manager,
        log_samples=False,
        bootstrap_iters=0,  # no standard errors: 100,000 resamples per metric by default
        verbosity='ERROR',
      )
    results = results or {}
    names = results.get('higher_is_better', {}).get(task, {})
    metrics = task_metrics(results.get('results', {}).get(task, {}), names)
    metrics = {name: value for name, value in metrics.items() if math.isfinite(value)}
    self.writer.harness_record(
      {
        'iteration': progress.iteration,
        'consumed_samples': progress.consumed_samples,
        'consumed_tokens': progress.consumed_tokens,
        'task': task,
        'metrics': metrics,
        'limit': limit,
        'eval_time_s': time.perf_counter() - start,
      },
      at,
    )
    return metrics
