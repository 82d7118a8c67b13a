"""Batch slicing, the one place that says which samples and tokens an iteration trains on: the
trainer builds its sharded global batch here, and `python -m t5x_like.data batch` reads the same
rows to show them.

An iteration's global batch is samples consumed_samples .. consumed_samples + global batch - 1
of the training stream (a pure function of the seed and the consumed samples), cut into
micro-batches of `micro_batch_size x mesh.data` rows in order. With a sequence-length curriculum
each sample keeps its first seq_len + 1 tokens, as Megatron-DeepSpeed truncates its batch: the
rest of the sample is consumed unseen.
"""

from __future__ import annotations

import jax
import numpy as np

from t5x_like.config import Config
from t5x_like.data import sources
from t5x_like.model import losses
from t5x_like.training import schedule


def batch_shape(
  cfg: Config, global_batch_size: int, seq_len: int | None = None, microbatches: int | None = None
) -> tuple[int, int, int]:
  """[micro-batches, rows, S + 1]: the micro-batches the global batch fills unless
  `microbatches` (`schedule.step_microbatches`) says how many the step runs with."""
  rows = cfg.train.micro_batch_size * cfg.mesh.data
  seq_len = cfg.train.seq_len if seq_len is None else seq_len
  if microbatches is None:
    microbatches = cfg.microbatches_for(global_batch_size)
  return (microbatches, rows, seq_len + 1)


def sample_rows(source, first: int, stop: int, seq_len: int | None = None) -> np.ndarray:
  """Samples first..stop-1 of `source`, each cut to its first seq_len + 1 tokens (all of them
  when seq_len is None): what an iteration trains on."""
  rows = source.rows(first, stop)
  return rows if seq_len is None else rows[:, : seq_len + 1]


def host_rows(
  cfg: Config,
  source,
  consumed_samples: int,
  global_batch_size: int,
  shape: tuple[int, int, int],
  index: tuple[slice, ...],
  trained: int,
  what: str,
) -> np.ndarray:
  """The part `index` of the [micro-batches, rows, S + 1] global batch that starts at sample
  consumed_samples: rows of samples, trained = the tokens kept of each (the rest, and the
  micro-batches past the batch's own, losses.PAD_ID). An id outside the model's vocabulary is a
  DataError naming the samples."""
  micro_slice, row_slice = index[0], index[1]
  micro = range(*micro_slice.indices(shape[0]))
  rows_per_micro = shape[1]
  start, stop, _ = row_slice.indices(rows_per_micro)
  filled = cfg.microbatches_for(global_batch_size)
  rows = np.full((len(micro), stop - start, shape[2]), losses.PAD_ID, np.int32)
  for i, m in enumerate(micro):
    if m >= filled:
      continue  # a micro-batch of padding
    first = consumed_samples + m * rows_per_micro
    samples = sample_rows(source, first + start, first + stop, trained - 1)
    sources.check_token_ids(
      samples,
      cfg.model.vocab_size,
      f'{what} samples {consumed_samples}..{consumed_samples + global_batch_size - 1}',
    )
    rows[i, :, :trained] = samples
  return rows[..., index[2]]


def global_batch(
  cfg: Config,
  sharding,
  source,
  consumed_samples: int,
  global_batch_size: int,
  what: str = 'training',
  seq_len: int | None = None,
  padded_seq_len: int | None = None,
  microbatches: int | None = None,
):
  """Samples consumed_samples.. of `source` as a [micro-batches, rows, S + 1] jax.Array with
  `sharding`; each device reads only the rows it holds. `seq_len` below train.seq_len (the
  curriculum) keeps the first seq_len + 1 tokens of each sample. `padded_seq_len` (above
  seq_len; curriculum.pad_to_multiple) makes S that, the tokens after the first seq_len + 1
  losses.PAD_ID. `microbatches` (above the batch's own count; train.rampup_microbatch_multiple)
  adds micro-batches of losses.PAD_ID after the batch's."""
  shape = batch_shape(
    cfg, global_batch_size, seq_len if padded_seq_len is None else padded_seq_len, microbatches
  )
  trained = shape[2] if seq_len is None else seq_len + 1

  def shard_rows(index: tuple[slice, ...] | None) -> np.ndarray:
    assert index is not None  # jax passes each addressable shard's index (its stubs allow None)
    return host_rows(cfg, source, consumed_samples, global_batch_size, shape, index, trained, what)

  return jax.make_array_from_callback(shape, sharding, shard_rows)


def check_run_data(cfg: Config, data, sharding, consumed_samples: int) -> list[str]:
  """Reads the next training batch and the first batch of every evaluation set once, before
  anything is compiled: ids outside the vocabulary are an error now, not after compiling.
  `data` is the run's sources.DataSources; returns the lines for the log about it."""
  gbs = schedule.global_batch_size_at(cfg.train, consumed_samples)
  global_batch(cfg, sharding, data.train, consumed_samples, gbs)
  if cfg.eval.interval:
    # Evaluations use the batch size of their time: at most the full one.
    data.check_evaluation(cfg.eval.iters, cfg.train.global_batch_size)
    for name, source in {**data.valid, 'test': data.test}.items():
      if source is not None:
        global_batch(cfg, sharding, source, 0, gbs, f'{name!r}')
  lines = list(data.notes)
  total = schedule.total_samples(cfg.train)
  for name, drawn, per_epoch in data.epochs(total):
    lines.append(
      f"> data: {name}: {drawn} of the run's {total} training samples, "
      f'{drawn / per_epoch:.3g} epoch(s) of its {per_epoch} training samples'
    )
  return lines


class SkippedIterations:
  """data.skip_train_iteration_range: a skipped iteration consumes its samples and trains
  nothing; the optimizer does not step, so it counts as a skipped iteration (Adam's count
  agrees). The first of each run of skipped iterations is logged."""

  def __init__(self, cfg: Config, log):
    self.cfg, self.log = cfg, log
    self.in_range = False  # inside a run of skipped iterations

  def skip(self, progress, total: int) -> None:
    first = progress.iteration + 1
    if not self.in_range:
      self.in_range = True
      last = next(b for a, b in self.cfg.data.skip_ranges() if a <= first <= b)
      self.log(
        f'> data.skip_train_iteration_range: iterations {first}-{min(last, total)} '
        f'consume their samples without training (from sample '
        f'{progress.consumed_samples})'
      )
    gbs = schedule.global_batch_size_at(self.cfg.train, progress.consumed_samples)
    progress.advance(gbs, schedule.seq_len_at(self.cfg, first))
    progress.skipped_iterations += 1

  def trained(self) -> None:
    """An iteration trained: the next skipped one starts a new run."""
    self.in_range = False
