"""The samples an iteration of a run trained on, from its workdir alone.

After a loss spike the chronicles' first question was "what data was in that batch?", answered
with ad-hoc scripts that had to repeat Megatron's sampler. Here a sample is a pure function of
(data settings, data seed, global sample index), and the global samples of iteration i follow
from the batch ramp-up (`schedule.global_batch_size_at`), so the batch of any iteration can be
rebuilt, before or after the fact, without running the model:

  python -m t5x_like.data batch WORKDIR --iteration 31214 [--tokenizer_json tokenizer.json] [--json]

Iterations skipped by `data.skip_train_iteration_range` consume their samples like trained ones,
so they shift nothing. Under a sequence-length curriculum the rows are cut to what the iteration
trained on, its first `schedule.seq_len_at(cfg, iteration) + 1` tokens.

A run's jobs may differ (a new blend, global batch or ramp-up after a restart): each job appends
its config and data seed to WORKDIR/config_history.jsonl with the first iteration it trains, and
the batch of iteration N is rebuilt with the latest job that started at or before N; where N
was trained, its metrics.jsonl record gives the consumed samples, batch size and length it
actually had (records after a rolled-back checkpoint are removed by the job that resumes it).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from t5x_like.config import Config, ConfigError, with_values_before_keys
from t5x_like.data import blending, sources
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.training import batches, schedule, startup


@dataclasses.dataclass
class IterationBatch:
  iteration: int
  first_sample: int  # global index of the batch's first sample (consumed samples before it)
  data_seed: int
  datasets: list[str]  # the dataset of each sample
  seq_len: int  # tokens per sample trained on (train.seq_len, or the curriculum's length)
  rows: np.ndarray  # int32 [global batch, seq_len + 1]: inputs rows[:, :-1], targets rows[:, 1:]


CONFIG_HISTORY = 'config_history.jsonl'


def record_job(workdir: str, first_iteration: int, cfg: Config, data_seed: int) -> None:
  """Appends the config and data seed a job trains iterations first_iteration.. with."""
  line = json.dumps(
    {'first_iteration': first_iteration, 'data_seed': data_seed, 'config': cfg.to_dict()}
  )
  path = os.path.join(workdir, CONFIG_HISTORY)
  with open(path, 'a+b') as f:
    f.seek(0)
    kept = f.read().rfind(b'\n') + 1  # a torn last line (no newline) is dropped
    f.truncate(kept)
    f.seek(kept)
    f.write(line.encode() + b'\n')


def read_history(workdir: str) -> list[dict]:
  """The jobs of WORKDIR/config_history.jsonl, oldest first ([] without one); a DataError names
  a damaged line. The trainer reads it before a run starts, so that it never appends to a
  history that `data batch` could not read."""
  history = os.path.join(workdir, CONFIG_HISTORY)
  if not os.path.isfile(history):
    return []
  jobs = []
  with open(history) as f:
    for number, line in enumerate(f, start=1):
      if not line.strip() or not line.endswith('\n'):
        continue  # a last line torn by a kill or a full disk: record_job drops it
      try:
        job = json.loads(line)
      except json.JSONDecodeError as e:
        job = f'not JSON ({e.msg})'
      if not (
        isinstance(job, dict)
        and all(
          isinstance(job.get(k), int) and not isinstance(job.get(k), bool)
          for k in ('first_iteration', 'data_seed')
        )
        and isinstance(job.get('config'), dict)
      ):
        raise DataError(
          f'{history} is damaged: line {number} is not a job record (a JSON mapping with '
          'an int first_iteration, an int data_seed and a config); remove that line, or '
          'the file (`python -m t5x_like.data batch` then uses config.json)'
        )
      jobs.append(job)
  return jobs


def _parsed_config(raw, where: str) -> Config:
  if not isinstance(raw, dict):
    raise DataError(
      f'{where} is not a t5x_like config (a {type(raw).__name__}, not a mapping '
      'of sections to their keys)'
    )
  try:
    return startup.check_config(Config.from_dict(with_values_before_keys(raw)))
  except ConfigError as e:
    raise DataError(f'{where} is not a t5x_like config ({e})') from None


def run_config(workdir: str, iteration: int | None = None) -> tuple[Config, int]:
  """The config and data seed that `iteration` was (or will be) trained with: the latest job in
  config_history.jsonl that started at or before it; without an iteration (or a history, from an
  older version) the latest job's `config.json` and the latest checkpoint's data seed (which a
  resumed run keeps whatever train.seed says; else train.seed)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise DataError(
      f'{path} not found: pass the workdir of a run (the directory given to '
      '`python -m t5x_like.train --workdir`)'
    )
  history = os.path.join(workdir, CONFIG_HISTORY)
  if iteration is not None:
    started = [job for job in read_history(workdir) if job['first_iteration'] <= iteration]
    if started:
      job = started[-1]
      return (
        _parsed_config(job['config'], f"{history}'s job from iteration {job['first_iteration']}"),
        int(job['data_seed']),
      )
  with open(path) as f:
    try:
      cfg = _parsed_config(json.load(f), path)
    except json.JSONDecodeError as e:
      raise DataError(f'{path} is not a t5x_like config ({e})') from None
  from t5x_like.checkpointing import (
    checkpoints,  # jax and orbax only when there are checkpoints to read
  )

  root = os.path.join(workdir, 'checkpoints')
  if checkpoints.available_steps(root):
    try:
      return cfg, int(checkpoints.read_meta(root)['data']['seed'])
    except checkpoints.CheckpointError as e:
      raise DataError(str(e)) from None
  return cfg, cfg.train.seed


def first_sample_of(cfg: Config, iteration: int) -> tuple[int, int]:
  """(global index of the first sample, global batch size) of iteration `iteration` (1-based)."""
  consumed = schedule.consumed_samples_after(cfg.train, iteration - 1)
  return consumed, schedule.global_batch_size_at(cfg.train, consumed)


def recorded_position(workdir: str, iteration: int) -> tuple[int, int, int] | None:
  """(first sample, global batch size, trained length) of `iteration` from the run's
  metrics.jsonl, or None where it has no record (not trained yet, or skipped)."""
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    return None
  found = None
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut by a killed job
      if record.get('iteration') == iteration:
        found = record  # the last one: a resumed job removes records past its checkpoint
  if found is None:
    return None
  size = int(found['global_batch_size'])
  return int(found['consumed_samples']) - size, size, int(found['seq_len'])


def iteration_batch(
  cfg: Config, data_seed: int, iteration: int, recorded: tuple[int, int, int] | None = None
) -> IterationBatch:
  """The training samples of `iteration`, read the way the trainer reads them; `recorded`
  (`recorded_position`) replaces the position the config's ramp-up and curriculum give."""
  total = schedule.total_iterations(cfg.train)
  if not 1 <= iteration <= total and recorded is None:
    raise DataError(f'--iteration {iteration} is outside the run, which has iterations 1..{total}')
  data = sources.build(cfg.data, cfg.train.seq_len, data_seed)
  if recorded is None:
    first, size = first_sample_of(cfg, iteration)
    seq_len = schedule.seq_len_at(cfg, iteration)
  else:
    first, size, seq_len = recorded
  if isinstance(data.train, blending.BlendedSource):
    which, _ = data.train.blend.assign(first, first + size)
    names = [data.train.names[int(d)] for d in which]
  else:
    names = [data.train_names[0]] * size
  return IterationBatch(
    iteration,
    first,
    data_seed,
    names,
    seq_len,
    batches.sample_rows(data.train, first, first + size, seq_len),
  )


def decoder(cfg: Config, tokenizer_json: str | None, tokenizer_model: str | None):
  """A function ids -> text for the run's data, or None when its tokenizer is not known."""
  if tokenizer_json:
    from t5x_like.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(tokenizer_json).decode
  if tokenizer_model:
    if not os.path.isfile(tokenizer_model):
      raise DataError(f'--tokenizer_model {tokenizer_model!r} not found')
    return Tokenizer.from_file(tokenizer_model).decode
  if sources.uses_embedded_corpus(cfg.data):  # the embedded corpus: the shipped tokenizer made it
    return Tokenizer.load_default().decode
  if sources.uses_seqio(cfg.data):  # seqio Tasks: their 'targets' vocabulary made the ids
    from t5x_like.data import seqio_tasks  # pylint: disable=import-outside-toplevel  # TF: slow

    return seqio_tasks.targets_decoder(cfg.data.mixture_or_task, cfg.data.mixture_or_task_module)
  return None


def report(batch: IterationBatch, decode, max_tokens: int) -> dict:
  """JSON-ready: where the batch sits in the run, then each sample's dataset, ids and text."""
  samples = []
  for offset, (name, row) in enumerate(zip(batch.datasets, batch.rows)):
    ids = row[:max_tokens] if max_tokens else row
    entry = {'sample': batch.first_sample + offset, 'dataset': name, 'ids': [int(i) for i in ids]}
    if decode is not None:
      entry['text'] = decode(ids)
    samples.append(entry)
  return {
    'iteration': batch.iteration,
    'first_sample': batch.first_sample,
    'global_batch_size': len(batch.rows),
    'data_seed': batch.data_seed,
    'seq_len': batch.seq_len,
    'skip_with': f"data.skip_train_iteration_range=('{batch.iteration}-{batch.iteration}',)",
    'samples': samples,
  }


def print_report(result: dict) -> None:
  last = result['first_sample'] + result['global_batch_size'] - 1
  print(
    f'iteration {result["iteration"]}: samples {result["first_sample"]}..{last} '
    f'({result["global_batch_size"]} samples of {result["seq_len"]} + 1 tokens, data seed '
    f'{result["data_seed"]})'
  )
  for s in result['samples']:
    print(
      f'--- sample {s["sample"]} ({s["dataset"]}): {len(s["ids"])} ids: '
      f'{" ".join(map(str, s["ids"][:16]))}{" ..." if len(s["ids"]) > 16 else ""}'
    )
    if 'text' in s:
      print(s['text'])
  if result['samples'] and 'text' not in result['samples'][0]:
    print('(no text: pass the tokenizer of the data with --tokenizer_json or --tokenizer_model)')
  key, _, value = result['skip_with'].partition('=')
  print(f'to train past this batch: --config.{key}="{value}"')  # quoted for the shell
