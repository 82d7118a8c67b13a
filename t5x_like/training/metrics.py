"""The run's metrics records: the Megatron log line and evaluation lines, metrics.jsonl,
eval_metrics.jsonl, the log file and TensorBoard scalars (MetricsWriter), and the hooks that
write them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from t5x_like.training import runtime, summaries


def log_line(r: dict, total_iterations: int) -> str:
  """The Megatron-DeepSpeed iteration line (same fields, order and formatting)."""
  return (
    f' iteration {r["iteration"]:8d}/{total_iterations:8d} |'
    f' consumed samples: {r["consumed_samples"]:12d} |'
    f' consumed tokens: {r["consumed_tokens"]:12d} |'
    f' elapsed time per iteration (s): {r["step_time_s"]:.2f} |'
    f' learning rate: {r["learning_rate"]:.3E} |'
    f' global batch size: {r["global_batch_size"]:5d} |'
    f' lm loss: {r["lm_loss"]:.6E} |'
    f' grad norm: {r["grad_norm"]:.3f} |'
    f' num zeros: {r["num_zeros"]:.1f} |'
    + (f' curriculum seqlen: {r["curriculum_seq_len"]:5d} |' if 'curriculum_seq_len' in r else '')
    + f' number of skipped iterations: {r["skipped_iterations"]:3d} |'
    f' number of nan iterations: {r["nan_iterations"]:3d} |'
    f' samples per second: {r["samples_per_sec"]:.3f} |'
    f' TFLOPs: {r["tflops"]:.2f} |'
    + (f' pipeline bubble: {r["pipeline_bubble"]:.3f} |' if 'pipeline_bubble' in r else '')
  )


def eval_lines(r: dict, at: str) -> list[str]:
  """Megatron's evaluation lines: a rule, '<set> loss at <at> | lm loss value | lm loss PPL', a
  rule (the chronicles' 'valid loss at iteration 45000 | lm loss value: 2.327091E+00 | ...')."""
  line = (
    f' {r["set"]} loss at {at} | lm loss value: {r["lm_loss"]:.6E} | lm loss PPL: {r["ppl"]:.6E} |'
  )
  rule = '-' * len(line)
  return [rule, line, rule]


def harness_lines(r: dict, at: str) -> list[str]:
  """The lines of one lm-evaluation-harness task's metrics (eval.harness_tasks), in the form of
  the evaluation lines: ' harness <task> at <at> | acc: 0.5 | acc_norm: 0.5 |'."""
  values = ' | '.join(f'{name}: {value:.6g}' for name, value in r['metrics'].items())
  line = f' harness {r["task"]} at {at} | {values} |'
  rule = '-' * len(line)
  return [rule, line, rule]


def tensorboard_harness_scalars(record: dict) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]} of one harness task: `harness/<task>/<metric>`."""
  flat = dict(record, **{f'metric:{k}': v for k, v in record['metrics'].items()})
  tags = tuple((f'harness/{record["task"]}/{k}', f'metric:{k}') for k in record['metrics'])
  return _by_run(flat, {run: tags for run, _ in TENSORBOARD_RUNS})


def record_hook(writer: MetricsWriter, total_iterations: int):
  """Every iteration: the Megatron log line and the metrics record (metrics.jsonl, TensorBoard)."""

  def write_record(info) -> None:
    if info.record is not None:
      writer.record(info.record, total_iterations)

  return write_record


def end_line_hook(log: Callable[[str], None]):
  """At the end and on a stop: the run's last line, '> done: ...' or '> stopped: ...' with its
  exit code; kept in info.message for the hooks after it (alerts)."""

  def log_end(info) -> None:
    code = runtime.exit_code(info.stop_reason)
    info.message = (
      f'> {"done" if info.stop_reason is None else "stopped"}: '
      f'{info.iteration} iterations, {info.progress.consumed_samples} samples; '
      f'exit code {int(code)} ({code.name})'
    )
    log(info.message)

  return log_end


# TensorBoard runs, subdirectories of `runtime.tensorboard_dir` ('' is the directory itself), and
# the record field each uses as its x axis. Megatron-DeepSpeed also plots against consumed samples
# and tokens ("lm loss vs tokens": the only fair axis across runs with a batch-size ramp or a
# sequence-length curriculum). Each axis has its own run because a resumed run tells TensorBoard
# to drop the earlier events from its first step on (summaries.py), and that rule compares one
# step number across all tags of a run.
TENSORBOARD_RUNS = (
  ('', 'iteration'),
  ('vs_samples', 'consumed_samples'),
  ('vs_tokens', 'consumed_tokens'),
)


# (tag, record field) per iteration: Megatron-DeepSpeed's tag groups with '_' for their spaces
# (TensorBoard's own writers replace characters other than letters, digits, '-', '_', '.', '/'
# the same way).
_TRAINING_TAGS = (
  ('lm-loss-training/lm_loss', 'lm_loss'),
  ('learning-rate/learning-rate', 'learning_rate'),
  ('batch-size/batch-size', 'global_batch_size'),
  ('grad-norm/grad-norm', 'grad_norm'),
  ('num-zeros/num-zeros', 'num_zeros'),
  ('seqlen/curriculum_seqlen', 'curriculum_seq_len'),
)


# Only against the iteration: counters and speed.
_ITERATION_ONLY_TAGS = (
  ('consumed/samples', 'consumed_samples'),
  ('consumed/tokens', 'consumed_tokens'),
  ('iteration-time/iteration-time', 'step_time_s'),
  ('iteration-time/samples_per_second', 'samples_per_sec'),
  ('iteration-time/TFLOPs_per_device', 'tflops'),
  ('iteration-time/MFU', 'mfu'),
  ('skipped/skipped_iterations', 'skipped_iterations'),
  ('skipped/nan_iterations', 'nan_iterations'),
)


def _by_run(
  record: dict, tags: dict[str, tuple[tuple[str, str], ...]]
) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]}; a run's tags carry its axis as a suffix (`lm_loss_vs_tokens`,
  Megatron's "lm loss vs tokens"), so runs of several workdirs overlay by tag in TensorBoard."""
  out = {}
  for run, axis in TENSORBOARD_RUNS:
    if axis not in record:
      continue
    suffix = f'_{run}' if run else ''
    out[run] = [
      (tag + suffix, record[key], record[axis]) for tag, key in tags[run] if key in record
    ]
  return out


def tensorboard_scalars(record: dict) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]} of one iteration's record (TENSORBOARD_RUNS)."""
  return _by_run(
    record,
    {
      '': _TRAINING_TAGS + _ITERATION_ONLY_TAGS,
      'vs_samples': _TRAINING_TAGS,
      'vs_tokens': _TRAINING_TAGS,
    },
  )


def tensorboard_eval_scalars(record: dict) -> dict[str, list[tuple[str, float, int]]]:
  """{run: [(tag, value, step)]} of one evaluated set: `lm-loss-validation/<set>_lm_loss` and its
  PPL."""
  tag = f'lm-loss-validation/{record["set"]}_lm_loss'
  tags = ((tag, 'lm_loss'), (f'{tag}_PPL', 'ppl'))
  return _by_run(record, {run: tags for run, _ in TENSORBOARD_RUNS})


class MetricsWriter:
  """Appends to WORKDIR/logs/main_log.txt, WORKDIR/metrics.jsonl (one record per trained
  iteration) and WORKDIR/eval_metrics.jsonl (one per evaluated set), and writes the same numbers
  as TensorBoard scalars (clu.metric_writers, summaries.py) under `tensorboard_dir` ('': none),
  with the config as text (`config_text`); only process 0 writes. Use as a
  context manager, or call close(), so the last TensorBoard events reach the disk."""

  def __init__(self, workdir: str, enabled: bool = True, tensorboard_dir: str = ''):
    self.enabled = enabled
    self.log_path = os.path.join(workdir, 'logs', 'main_log.txt')
    self.jsonl_path = os.path.join(workdir, 'metrics.jsonl')
    self.eval_jsonl_path = os.path.join(workdir, 'eval_metrics.jsonl')
    # Relative to the workdir; an absolute path is kept as it is.
    self.tensorboard_dir = os.path.join(workdir, tensorboard_dir) if tensorboard_dir else ''
    self._tensorboard: dict[str, summaries.RunWriter] = {}  # created on first use
    self._purge_steps: dict[str, int] = {}
    # Lines logged before the run started (`open`) are printed at once and kept for the log file:
    # a run refused at start-up leaves no file behind.
    self._pending: list[str] | None = []

  @property
  def opened(self) -> bool:
    return self._pending is None

  def open(self) -> None:
    """The run starts: creates the log directory and writes the lines logged so far."""
    pending, self._pending = self._pending, None
    if self.enabled:
      os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
      with open(self.log_path, 'a') as f:
        f.writelines(line + '\n' for line in pending or ())

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    for writer in self._tensorboard.values():
      writer.close()
    self._tensorboard = {}

  def truncate_after(self, iteration: int, consumed_samples: int, consumed_tokens: int) -> None:
    """Drops records past `iteration` (written after the checkpoint a restart resumes from, which
    had consumed these samples and tokens)."""
    if not self.enabled:
      return
    for path in (self.jsonl_path, self.eval_jsonl_path):
      if not os.path.exists(path):
        continue
      with open(path) as f:
        keep = [line for line in f if _iteration_of(line) <= iteration]
      tmp = path + '.tmp'
      with open(tmp, 'w') as f:
        f.writelines(keep)
      os.replace(tmp, path)
    # TensorBoard hides the events of a run's earlier files from this step on (summaries.py).
    at = {
      'iteration': iteration,
      'consumed_samples': consumed_samples,
      'consumed_tokens': consumed_tokens,
    }
    self._purge_steps = {run: at[axis] + 1 for run, axis in TENSORBOARD_RUNS}

  def info(self, message: str) -> None:
    """A line for stdout and main_log.txt."""
    if not self.enabled:
      return
    try:
      print(message, flush=True)
    except OSError:
      # The terminal is gone (a SIGHUP is on its way) or the reader of the pipe ended: the run
      # goes on, and the log file has every line.
      runtime.silence(sys.stdout)
    if self._pending is not None:
      self._pending.append(message)
      return
    with open(self.log_path, 'a') as f:
      f.write(message + '\n')

  def record(self, record: dict, total_iterations: int) -> None:
    self.info(log_line(record, total_iterations))
    self._append(self.jsonl_path, record)
    self._scalars(tensorboard_scalars(record))

  def eval_record(self, record: dict, at: str) -> None:
    for line in eval_lines(record, at):
      self.info(line)
    self._append(self.eval_jsonl_path, record)
    self._scalars(tensorboard_eval_scalars(record))

  def harness_record(self, record: dict, at: str) -> None:
    """One harness task's metrics (`task`, `metrics`, and the counters of the iteration) to the
    log, eval_metrics.jsonl and TensorBoard."""
    for line in harness_lines(record, at):
      self.info(line)
    self._append(self.eval_jsonl_path, record)
    self._scalars(tensorboard_harness_scalars(record))

  def config_text(self, config_json: str, iteration: int) -> None:
    """The resolved config as TensorBoard text (tag `config`, run ''), at the job's first
    `iteration`: one entry per job, replaced with the iterations when a job is redone."""
    if not (self.enabled and self.tensorboard_dir):
      return
    code_block = ''.join(f'    {line}\n' for line in config_json.splitlines())  # Markdown
    self._run('').texts(iteration, {'config': code_block})

  def _run(self, run: str) -> summaries.RunWriter:
    if run not in self._tensorboard:
      self._tensorboard[run] = summaries.RunWriter(
        os.path.join(self.tensorboard_dir, run), self._purge_steps.get(run)
      )
    return self._tensorboard[run]

  def _scalars(self, scalars: dict[str, list[tuple[str, float, int]]]) -> None:
    if not (self.enabled and self.tensorboard_dir):
      return
    for run, run_scalars in scalars.items():
      by_step: dict[int, dict[str, float]] = {}
      for tag, value, step in run_scalars:
        by_step.setdefault(int(step), {})[tag] = float(value)
      for step, values in by_step.items():
        self._run(run).scalars(step, values)

  def _append(self, path: str, record: dict) -> None:
    if self.enabled:
      with open(path, 'a') as f:
        f.write(json.dumps(record) + '\n')


def _iteration_of(line: str) -> float:
  """A record's iteration; a line torn by a kill mid-write counts as past every checkpoint."""
  try:
    return json.loads(line)['iteration']
  except (ValueError, KeyError, TypeError):
    return float('inf')
