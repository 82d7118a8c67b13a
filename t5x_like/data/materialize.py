"""A seqio Task's split, materialised once into the token store (Megatron .bin/.idx), cached.

Training never runs seqio's TensorFlow pipeline: the Task's 'targets' ids are written once, one
document per example in the order the Task yields them unshuffled, through the atomic
`indexed.IndexedDatasetWriter`, and read back by the index-addressable Megatron path
(`sources.py`), so the sample order is a pure function of (seed, index) as for any dataset:
independent of mesh and process count, exact on resume, replayable by `data batch`.

The cache is `CACHE_DIR/seqio/TASK/SPLIT.{bin,idx,json}`; the .json (written last) records the
sha256 fingerprint of the Task's definition (`definition`: its name, source, preprocessors'
qualified names and arguments, vocabulary, split and these settings) and the files' sizes and
index hash. An entry is reused only when all of it matches; a stale or damaged one is rebuilt,
with one log line saying why. Several processes (a multi-host job, two `prepare` commands) take
a lock on SPLIT.lock: the first builds, the others wait, then find the entry and read it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import TextIO

import numpy as np

from t5x_like import files
from t5x_like.data import dataset, indexed, seqio_tasks
from t5x_like.data.indexed import DataError

# Bumped when what is written for the same definition changes: older entries are then stale.
FORMAT_VERSION = 1
# How long a process waits for another one preparing the same split before giving up.
LOCK_TIMEOUT_S = 6 * 3600.0
_LOCK_POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class Materialized:
  """One Task split in the token store: its PREFIX.bin/.idx, and whether this call wrote it."""

  task: str
  split: str
  prefix: str
  documents: int
  tokens: int
  built: bool


def cache_root(cache_dir: str = '') -> str:
  """data.cache_dir, or ($T5X_LIKE_CACHE or ~/.cache/t5x_like), then seqio/."""
  return os.path.join(cache_dir or dataset.default_cache_dir(), 'seqio')


def cache_prefix(task_name: str, split: str, cache_dir: str = '') -> str:
  return os.path.join(cache_root(cache_dir), task_name, split)


def qualified_name(fn) -> str:
  """module.qualname of a function; a functools.partial adds its bound arguments."""
  if hasattr(fn, 'func'):  # functools.partial: the arguments change what it computes
    bound = [repr(a) for a in fn.args] + [f'{k}={v!r}' for k, v in sorted(fn.keywords.items())]
    return f'{qualified_name(fn.func)}({", ".join(bound)})'
  return f'{getattr(fn, "__module__", "?")}.{getattr(fn, "__qualname__", type(fn).__qualname__)}'


def vocabulary_definition(vocabulary) -> dict:
  """What identifies a vocabulary: its class, size, extra ids and (SentencePiece) model bytes."""
  described = {
    'class': qualified_name(type(vocabulary)),
    'vocab_size': vocabulary.vocab_size,
    'extra_ids': getattr(vocabulary, 'extra_ids', None),
  }
  model = getattr(vocabulary, 'sp_model', None)
  if isinstance(model, bytes):
    described['sp_model_sha256'] = hashlib.sha256(model).hexdigest()
  return described


def source_definition(source) -> dict:
  """The data source as its class, its dataset function or files, and (when it can say) its
  content's fingerprint (`content_fingerprint()`, as seqio_tasks.CorpusSource has)."""
  described = {'class': qualified_name(type(source)), 'splits': list(source.splits)}
  shown = repr(source)  # seqio's sources name their function or files in it
  if ' at 0x' not in shown:  # an address differs from run to run
    described['repr'] = shown
  for attribute in ('tfds_dataset', 'split_to_filepattern'):
    value = getattr(source, attribute, None)
    if value is not None:
      described[attribute] = getattr(value, 'name', None) or repr(value)
  if callable(getattr(source, 'content_fingerprint', None)):
    described['content'] = source.content_fingerprint()
  return described


def definition(task, split: str) -> dict:
  """Everything that decides what `task`'s `split` materialises to (JSON-ready)."""
  targets = task.output_features['targets']
  return {
    'format_version': FORMAT_VERSION,
    'task': task.name,
    'split': split,
    'source': source_definition(task.source),
    'preprocessors': [qualified_name(p) for p in task.preprocessors],
    'vocabulary': vocabulary_definition(targets.vocabulary),
    'targets': {'add_eos': bool(targets.add_eos), 'dtype': str(targets.dtype.name)},
    # Whole documents, untrimmed and unshuffled, one epoch; the Task's ids as they come.
    'sequence': {'sequence_length': None, 'shuffle': False, 'append_eod': False},
  }


def fingerprint(described: dict) -> str:
  return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def _idx_sha256(prefix: str) -> str:
  with open(indexed.paths(prefix)[1], 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()


def cache_problem(prefix: str, expected: str) -> str | None:
  """Why the cache entry at `prefix` cannot be trusted for the fingerprint `expected`, or None
  when it can. Checks the manifest, the files' sizes and the index's hash (the .bin is not
  hashed: it can be terabytes, and its size must match the index's every document)."""
  manifest_path = prefix + '.json'
  if not os.path.exists(manifest_path):
    return 'missing'
  try:
    with open(manifest_path, encoding='utf-8') as f:
      manifest = json.load(f)
    if manifest['fingerprint'] != expected:
      return 'stale (its Task definition, vocabulary or source changed)'
    bin_path, _ = indexed.paths(prefix)
    if os.path.getsize(bin_path) != manifest['bin_bytes']:
      return (
        f'damaged ({bin_path} has {os.path.getsize(bin_path)} bytes, not {manifest["bin_bytes"]})'
      )
    if _idx_sha256(prefix) != manifest['idx_sha256']:
      return 'damaged (its .idx does not match the hash recorded when it was written)'
    opened = indexed.IndexedDataset(prefix)
    if (opened.num_documents, int(opened.document_token_offsets()[-1])) != (
      manifest['documents'],
      manifest['tokens'],
    ):
      return 'damaged (its documents or tokens differ from the manifest)'
  except (OSError, ValueError, KeyError, TypeError, DataError) as error:
    return f'damaged ({error})'
  return None


class SplitLock:
  """An exclusive flock on PREFIX.lock, polled until `timeout_s` (then one DataError).

  `discard()` (while held) removes the lock file and the directories this lock created, so a
  split that failed to materialise leaves no trace. A process waiting on the removed file finds,
  once it holds it, that the path no longer names it, and locks the path anew: two processes
  never hold the split at once."""

  def __init__(self, prefix: str, timeout_s: float):
    self.path = prefix + '.lock'
    self.timeout_s = timeout_s
    self._file: TextIO | None = None  # open from _open on
    self._created_file = False
    self._created_dirs: list[str] = []  # innermost first

  def __enter__(self) -> SplitLock:
    deadline = time.monotonic() + self.timeout_s
    while True:
      if self._open() and self._wait(deadline):
        if self._still_named():
          return self
        self.file.close()  # removed by a writer that failed: lock the path anew

  def _open(self) -> bool:
    self._created_dirs = files.make_dirs(os.path.dirname(self.path))
    self._created_file = not os.path.exists(self.path)
    try:
      self._file = open(self.path, 'a+', encoding='utf-8')  # pylint: disable=consider-using-with
    except FileNotFoundError:  # a failing writer removed the directory just now: make it again
      return False
    return True

  @property
  def file(self) -> TextIO:
    """The lock file, which _open has opened."""
    assert self._file is not None, 'the lock file is not open'
    return self._file

  def _wait(self, deadline: float) -> bool:
    while True:
      try:
        fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
      except OSError as error:
        if error.errno not in (errno.EAGAIN, errno.EACCES):
          raise
      if time.monotonic() >= deadline:
        self.file.close()
        raise DataError(
          f'waited {self.timeout_s:g} s for another process preparing '
          f'{self.path[:-5]} (it holds {self.path}); let it finish, run `python -m '
          't5x_like.data prepare` alone first, or point data.cache_dir elsewhere'
        )
      time.sleep(_LOCK_POLL_S)

  def _still_named(self) -> bool:
    try:
      return os.path.samestat(os.fstat(self.file.fileno()), os.stat(self.path))
    except FileNotFoundError:
      return False

  def discard(self) -> None:
    """Removes what taking the lock created (the lock file, its directories), while held."""
    if not self._created_file:
      return
    try:
      os.unlink(self.path)
    except FileNotFoundError:
      pass
    files.remove_made_dirs(self._created_dirs)  # not the ones another split fills by now

  def __exit__(self, *exc) -> None:
    fcntl.flock(self.file, fcntl.LOCK_UN)
    self.file.close()


def _checked_ids(task, split: str, data) -> Iterator[np.ndarray]:
  """The 'targets' ids of every example of `data` (`task`'s `split`), each checked as it is read:
  an id outside the vocabulary is one DataError, raised before that document is written."""
  vocab_size = int(task.output_features['targets'].vocabulary.vocab_size)
  for index, example in enumerate(data.as_numpy_iterator()):
    ids = example['targets']
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
      raise DataError(
        f'the seqio Task {task.name!r}, split {split!r}: example {index} has the '
        f'token id {outside[0]}, outside its "targets" vocabulary (ids '
        f'0..{vocab_size - 1}); nothing was written: make its preprocessors give '
        "ids of output_features['targets'].vocabulary, or declare the vocabulary "
        'that the ids are of'
      )
    yield ids


def _write(task, split: str, data, prefix: str, expected: str, described: dict) -> None:
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel  # only when writing

  targets = task.output_features['targets']
  vocabulary = targets.vocabulary
  # An empty text comes out of seqio's append_eos as a lone EOS: no text either.
  lone_eos = [vocabulary.eos_id] if targets.add_eos else []
  # The check inside the progress bar: an error closes the bar before it is printed.
  examples = tqdm(
    _checked_ids(task, split, data),
    desc=f'{task.name}:{split}',
    total=task.source.num_input_examples(split),
    unit=' docs',
    mininterval=1.0,
  )
  documents, tokens, empty = indexed.write_documents(
    prefix,
    indexed.best_dtype(vocabulary.vocab_size),
    (ids[:0] if ids.tolist() == lone_eos else ids for ids in examples),  # an empty text
    f'the seqio Task {task.name!r}, split {split!r}',
    'check its source and preprocessors',
    'free some space or point data.cache_dir elsewhere',
  )
  if empty:
    logging.warning(
      'seqio %s:%s: skipped %d example(s) without tokens (an empty text), as '
      'preprocess does; %d written',
      task.name,
      split,
      empty,
      documents,
    )
  manifest = {
    'fingerprint': expected,
    'definition': described,
    'documents': documents,
    'tokens': tokens,
    'empty_skipped': empty,
    'bin_bytes': os.path.getsize(indexed.paths(prefix)[0]),
    'idx_sha256': _idx_sha256(prefix),
  }
  files.atomic_write(prefix + '.json', lambda f: f.write(json.dumps(manifest, indent=1).encode()))


def materialize(
  task, split: str, cache_dir: str = '', timeout_s: float = LOCK_TIMEOUT_S, data=None
) -> Materialized:
  """`task`'s `split` in the token store: the cached entry when it matches the definition, else
  written now (under the split's lock, so one process writes while the others wait). `data`:
  the split's pipeline, already built by `seqio_tasks.split_examples` (else built here).

  A Task that gives no token ids fails before anything is created (its pipeline is built and
  checked first), one with an id outside its vocabulary as the id is read: either way the cache
  holds nothing of it afterwards (no .bin/.idx, no lock file, no directory of its own)."""
  described = definition(task, split)
  expected = fingerprint(described)
  prefix = cache_prefix(task.name, split, cache_dir)
  if data is None and cache_problem(prefix, expected):
    data = seqio_tasks.split_examples(task, split)
  built = False
  with SplitLock(prefix, timeout_s) as lock:
    problem = cache_problem(prefix, expected)
    if problem:
      if problem != 'missing':
        logging.warning('seqio cache %s is %s; rebuilding it', prefix, problem)
      manifest = prefix + '.json'
      if os.path.exists(manifest):  # no manifest while the files are rewritten: never trusted
        os.unlink(manifest)
      logging.info('materialising seqio %s:%s into %s', task.name, split, prefix)
      try:
        if data is None:  # cached when this process looked, damaged or gone since
          data = seqio_tasks.split_examples(task, split)
        _write(task, split, data, prefix, expected, described)
      except BaseException:
        lock.discard()
        raise
      built = True
  opened = indexed.IndexedDataset(prefix)
  return Materialized(
    task.name, split, prefix, opened.num_documents, int(opened.document_token_offsets()[-1]), built
  )


@dataclasses.dataclass(frozen=True)
class MaterializedTask:
  """One Task of a run: its blend weight (rate), training split and validation splits."""

  name: str
  rate: float
  train: Materialized | None
  valid: dict[str, Materialized]


def prepare(
  name: str, module: str = '', cache_dir: str = '', timeout_s: float = LOCK_TIMEOUT_S
) -> list[MaterializedTask]:
  """Materialises every split a run on the Task or Mixture `name` reads: each training Task's
  train split and each Task's validation splits. One DataError for a bad name or module, or a
  Task that gives no token ids (before any split is written)."""
  provider = seqio_tasks.get_mixture_or_task(name, module)
  rates = {task.name: rate for task, rate in seqio_tasks.training_tasks(provider)}
  tasks = seqio_tasks.subtasks(provider)
  wanted = {
    task.name: ([seqio_tasks.TRAIN_SPLIT] if task.name in rates else [])
    + seqio_tasks.validation_splits(task)
    for task in tasks
  }
  # Every split to write is built and its 'targets' checked before the first is written: a Task
  # that gives no token ids leaves nothing behind, not even the splits of the Tasks before it.
  pipelines = {
    (task.name, split): seqio_tasks.split_examples(task, split)
    for task in tasks
    for split in wanted[task.name]
    if cache_problem(
      cache_prefix(task.name, split, cache_dir), fingerprint(definition(task, split))
    )
  }
  prepared = []
  for task in tasks:
    entries = {
      split: materialize(task, split, cache_dir, timeout_s, pipelines.get((task.name, split)))
      for split in wanted[task.name]
    }
    train = entries.pop(seqio_tasks.TRAIN_SPLIT, None)
    prepared.append(MaterializedTask(task.name, rates.get(task.name, 0.0), train, entries))
  return prepared
