"""What a run reads: its training stream, validation sets and test split, built from `data.*`.

* `data.train_path` is Megatron's `--data-path`: one dataset prefix, or `W1 PREFIX1 W2 PREFIX2
  ...` to blend several by weight (`blending.py`). Empty: the embedded default corpus.
* `data.split` is Megatron's `--split` (default `969,30,1`): each dataset's documents, in file
  order, are cut into train / validation / test ranges with Megatron's rounding, so the same
  files and split give the same document ranges as Megatron did. It cuts only these datasets
  and the embedded corpus (`uses_split`): the weighted split paths and a seqio Task name their
  splits themselves, and a config's split for the embedded corpus (configs/tiny.py) does not
  apply to them.
* `data.valid_path` names further validation sets, `{name: data path}`, each read whole.
* `data.train_weighted_split_paths` (and `valid_`, `test_`) are Megatron-DeepSpeed's
  `--*-weighted-split-paths`, tr11's form: named groups `NAME: W1 START:END PREFIX1, ...` whose
  START:END fractions of each dataset's documents are cut as Megatron cuts them
  (`range_documents`); relative prefixes are read under `data.root` (docs/data.md).
* `data.mixture_or_task` names a registered seqio Task or Mixture (`seqio_tasks.py`), which
  `materialize.py` writes once into cached .bin/.idx files that are then read like any dataset:
  the Mixture's rates are the blend weights, each Task's validation splits named validation sets.

Every source is a pure function of (train.seed, sample index): `SampleSource` windows over the
documents of its range, and a blend of them for several datasets. Opening checks every file
(`indexed.IndexedDataset`) and every range (enough tokens for one sample), so a bad path or a bad
split is one `DataError` before any compilation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any

import numpy as np

from t5x_like.data import blending, indexed
from t5x_like.data.dataset import SampleSource, corpus_tokens
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.errors import ConfigError

SPLIT_NAMES = ('train', 'valid', 'test')
# Sources sharing train.seed are told apart by a stream id: (split position in SPLIT_NAMES,
# dataset position), or (_NAMED_VALID, set position, dataset position) for data.valid_path.
_NAMED_VALID = 3
# ... or (_WEIGHTED, split position, group position, dataset position) for the weighted split
# paths.
_WEIGHTED = 4
# ... or (_SEQIO, role (0 train, 1 validation), Task position, split position) for seqio Tasks.
_SEQIO = 5
EMBEDDED = 'embedded'


def parse_data_path(spec: str, key: str = 'data.train_path') -> list[tuple[float, str]]:
  """`PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` (Megatron's --data-path) as [(weight, prefix)]."""
  words = spec.split()
  if len(words) == 1:
    return [(1.0, words[0])]
  if not words or len(words) % 2:
    raise DataError(
      f'{key}={spec!r}: give one dataset prefix, or weight/prefix pairs such as '
      '"0.7 /data/en_text_document 0.3 /data/fr_text_document"'
    )
  pairs = []
  for weight, prefix in zip(words[0::2], words[1::2]):
    try:
      value = float(weight)
    except ValueError:
      value = float('nan')
    if not value > 0 or not np.isfinite(value):
      raise DataError(
        f'{key}={spec!r}: {weight!r} is not a positive weight; weight/prefix pairs '
        'alternate, weight first'
      )
    pairs.append((value, prefix))
  total = sum(value for value, _ in pairs)
  # The blend divides by the sum and by each share: both must be finite numbers.
  tiny = [
    weight for weight, (value, _) in zip(words[0::2], pairs) if not np.isfinite(total / value)
  ]
  if not np.isfinite(total) or tiny:
    problem = (
      f'the weights sum to {total:g}'
      if not np.isfinite(total)
      else f'the weight {tiny[0]} is too small a share of their sum {total:g}'
    )
    raise DataError(
      f'{key}={spec!r}: {problem}; only the ratios of the weights matter, so use '
      'moderate values such as "0.7 A 0.3 B"'
    )
  return pairs


def parse_split(split: str) -> list[float]:
  """Megatron's --split string ('969,30,1' or '98/2/0') as three shares summing to 1."""
  parts = split.replace('/', ',').split(',')
  try:
    shares = [float(p) for p in parts if p.strip()]
  except ValueError:
    shares = []
  if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
    raise DataError(
      f'data.split={split!r}: give up to three non-negative train,valid,test '
      'shares such as "969,30,1"'
    )
  shares += [0.0] * (3 - len(shares))
  return [s / sum(shares) for s in shares]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
  """Document ranges of train, valid and test, rounded as Megatron's get_train_valid_test_split_."""
  bounds = [0]
  for share in parse_split(split):
    bounds.append(bounds[-1] + int(round(share * float(num_documents))))
  excess = bounds[-1] - num_documents
  bounds = [bounds[0]] + [b - excess for b in bounds[1:]]
  return list(zip(bounds[:-1], bounds[1:]))


@dataclasses.dataclass
class DocumentStream:
  """One dataset's tokens and its document boundaries (token offsets, [num_documents + 1])."""

  name: str
  tokens: np.ndarray
  offsets: np.ndarray

  def documents(self, first: int, last: int) -> np.ndarray:
    return self.tokens[int(self.offsets[first]) : int(self.offsets[last])]


def open_indexed(prefix: str) -> DocumentStream:
  dataset = indexed.IndexedDataset(prefix)
  return DocumentStream(prefix, dataset.tokens, dataset.document_token_offsets())


def open_embedded(tokenizer: Tokenizer) -> DocumentStream:
  """The embedded corpus; its documents end with the EOD id, which marks the boundaries."""
  tokens = corpus_tokens(tokenizer)
  ends = np.flatnonzero(tokens == tokenizer.eod_id) + 1
  return DocumentStream(EMBEDDED, tokens, np.concatenate([[0], ends]).astype(np.int64))


@dataclasses.dataclass
class DataSources:
  """The sources of a run, and lines for the start-up log that say what they hold."""

  train: Any  # a SampleSource or a blending.BlendedSource
  valid: dict[str, Any]
  test: Any | None
  notes: list[str]
  train_names: list[str] = dataclasses.field(default_factory=list)

  def epochs(self, total_samples: int) -> list[tuple[str, int, int]]:
    """(dataset, samples a run of `total_samples` draws from it, its training samples per epoch),
    so a run that repeats a small dataset many times is seen before it starts."""
    if isinstance(self.train, blending.BlendedSource):
      counts = self.train.blend.counts(total_samples)
      return [
        (name, int(count), source.num_samples)
        for name, count, source in zip(self.train_names, counts, self.train.sources)
      ]
    return [(self.train_names[0], total_samples, self.train.num_samples)]

  def check_evaluation(self, eval_iters: int, global_batch_size: int) -> None:
    """One DataError when an evaluation (eval.iters batches of `global_batch_size` samples from
    the start of each set) needs more samples than a validation set (or the test split) holds:
    it would silently count some samples twice."""
    sets = dict(self.valid)
    if self.test is not None:
      sets['test'] = self.test
    needed = eval_iters * global_batch_size
    for name, source in sets.items():
      held = source.num_samples
      if needed <= held:
        continue
      fits = held // global_batch_size
      fix = (
        f'set eval.iters <= {fits}'
        if fits
        else f'it holds less than one global batch ({global_batch_size}): give it more data '
        '(a larger share of data.split, or a larger data.valid_path set) or lower '
        'train.global_batch_size'
      )
      raise DataError(
        f'the evaluation set {name!r} holds {held} samples, fewer than the '
        f'{needed} an evaluation reads (eval.iters={eval_iters} x global batch '
        f'{global_batch_size}), so it would repeat samples; {fix}'
      )


def _source(
  stream: DocumentStream,
  documents: tuple[int, int],
  seq_len: int,
  seed: int,
  stream_id: tuple[int, ...],
  what: str,
) -> SampleSource:
  tokens = stream.documents(*documents)
  if tokens.size < seq_len + 1:
    raise DataError(
      f'{what}: documents {documents[0]}..{documents[1]} of {stream.name} hold '
      f'{tokens.size} tokens, fewer than one sample of train.seq_len + 1 = '
      f'{seq_len + 1}; change data.split or use more data'
    )
  return SampleSource(tokens, seq_len, seed, stream=stream_id)


def _mix(sources: list[SampleSource], weights: list[float], names: list[str], order: str):
  if len(sources) == 1:
    return sources[0]
  return blending.BlendedSource(sources, weights, names, order)


def _valid_path_sets(data_cfg, seq_len: int, seed: int) -> dict[str, Any]:
  """data.valid_path: each named set read whole."""
  valid = {}
  for position, (name, spec) in enumerate(data_cfg.valid_path):
    named_pairs = parse_data_path(spec, key=f'data.valid_path[{name!r}]')
    sources = []
    for index, (_, prefix) in enumerate(named_pairs):
      stream = open_indexed(prefix)
      sources.append(
        _source(
          stream,
          (0, len(stream.offsets) - 1),
          seq_len,
          seed,
          (_NAMED_VALID, position, index),
          f'validation set {name!r}',
        )
      )
    valid[name] = _mix(
      sources, [w for w, _ in named_pairs], [p for _, p in named_pairs], data_cfg.blend_order
    )
  return valid


def build(data_cfg, seq_len: int, seed: int, tokenizer: Tokenizer | None = None) -> DataSources:
  """Opens every dataset `data_cfg` names and returns the run's sources (one DataError if bad)."""
  if not uses_split(data_cfg):
    built = (_build_weighted if uses_weighted_split_paths(data_cfg) else _build_seqio)(
      data_cfg, seq_len, seed
    )
    if data_cfg.split != type(data_cfg)().split:
      built.notes.append(
        f'> data: data.split={data_cfg.split!r} is not used: it cuts data.train_path or the '
        'embedded corpus, and this run names its splits itself'
      )
    return built
  if data_cfg.train_path:
    pairs = parse_data_path(data_cfg.train_path)
    streams = [open_indexed(prefix) for _, prefix in pairs]
  else:
    pairs = [(1.0, EMBEDDED)]
    streams = [open_embedded(tokenizer or Tokenizer.load_default())]
  weights = [w for w, _ in pairs]
  notes = []
  by_split: dict[str, list[SampleSource]] = {name: [] for name in SPLIT_NAMES}
  split_weights: dict[str, list[float]] = {name: [] for name in SPLIT_NAMES}
  split_names: dict[str, list[str]] = {name: [] for name in SPLIT_NAMES}
  for index, (stream, weight) in enumerate(zip(streams, weights)):
    ranges = split_ranges(len(stream.offsets) - 1, data_cfg.split)
    for role, (name, documents) in enumerate(zip(SPLIT_NAMES, ranges)):
      if documents[1] > documents[0]:
        by_split[name].append(
          _source(
            stream,
            documents,
            seq_len,
            seed,
            (role, index),
            f'the {name} split (data.split={data_cfg.split!r})',
          )
        )
        split_weights[name].append(weight)
        split_names[name].append(stream.name)
    counts = ', '.join(f'{n} {b - a}' for n, (a, b) in zip(SPLIT_NAMES, ranges))
    notes.append(
      f'> data: {stream.name} (weight {weight / sum(weights):.4f}): '
      f'{len(stream.offsets) - 1} documents, {int(stream.offsets[-1])} tokens; '
      f'documents per split: {counts}'
    )
  if not by_split['train']:
    raise DataError(f'data.split={data_cfg.split!r} leaves no documents for training')
  if len(by_split['train']) < len(streams):
    raise DataError(
      f'data.split={data_cfg.split!r} leaves some dataset without training '
      'documents; raise the train share'
    )
  train = _mix(
    by_split['train'], split_weights['train'], split_names['train'], data_cfg.blend_order
  )
  valid = {}
  if by_split['valid']:
    valid['valid'] = _mix(
      by_split['valid'], split_weights['valid'], split_names['valid'], data_cfg.blend_order
    )
  valid.update(_valid_path_sets(data_cfg, seq_len, seed))
  test = (
    _mix(by_split['test'], split_weights['test'], split_names['test'], data_cfg.blend_order)
    if by_split['test']
    else None
  )
  return DataSources(train, valid, test, notes, split_names['train'])


def check_token_ids(rows: np.ndarray, vocab_size: int, what: str) -> None:
  """One DataError when a sample holds an id the model has no embedding row for."""
  top = int(rows.max()) if rows.size else 0
  low = int(rows.min()) if rows.size else 0
  if top >= vocab_size or low < 0:
    raise DataError(
      f'{what} holds token id {top if top >= vocab_size else low}, outside the '
      f"model's vocabulary [0, {vocab_size}): the data was tokenized with another "
      "tokenizer; set model.vocab_size to that tokenizer's size or re-tokenize"
    )


def check_config(d, e) -> None:
  """Config-time check of data.* (`d`, a config.DataConfig) and eval.* (`e`) syntax: one
  ConfigError naming the fix. The files themselves are opened by the trainer, still before any
  compilation."""
  try:
    if d.train_path:
      parse_data_path(d.train_path)
    shares = parse_split(d.split)
    split_applies = uses_split(d)
    names = set()
    for entry in d.valid_path:
      if not (
        isinstance(entry, tuple)
        and len(entry) == 2
        and all(isinstance(x, str) and x for x in entry)
      ):
        raise ConfigError(
          f'data.valid_path must map set names to data paths, e.g. '
          f'{{"en": "/data/en_text_document"}}; got the entry {entry!r}'
        )
      name, spec = entry
      if not re.fullmatch(r'[\w.-]+', name):
        raise ConfigError(
          f'data.valid_path: the set name {name!r} goes into log lines and '
          'TensorBoard tags; use letters, digits, "_", "-" and "." only'
        )
      if name in names or (name == 'valid' and split_applies and shares[1] > 0) or name == 'test':
        raise ConfigError(
          f'data.valid_path names a set {name!r} twice, or a name the '
          f'data.split already uses ("valid" for its validation share, '
          f'"test"); rename it'
        )
      names.add(name)
      parse_data_path(spec, key=f'data.valid_path[{name!r}]')
  except DataError as error:
    raise ConfigError(str(error)) from None
  check_weighted_split_paths(d, e)
  if uses_seqio(d):
    check_seqio(d, e)
    return
  if e.interval and split_applies and shares[1] == 0 and not d.valid_path:
    raise ConfigError(
      f'eval.interval={e.interval} but there is no validation set: give '
      f'data.split a validation share (e.g. "969,30,1") or set data.valid_path'
    )


# ------------------------------------- Megatron's --(train|valid|test)-weighted-split-paths

WEIGHTED_SPLIT_ROLES = ('train', 'valid', 'test')
_GROUP_EXAMPLE = '"train: 0.7 0:0.95 /d/en_text_document, 0.3 0:0.95 /d/fr_text_document"'


@dataclasses.dataclass(frozen=True)
class RangedDataset:
  """One dataset of a weighted split group: its weight, the fractions START:END of its documents
  it contributes, and its prefix as written (relative ones are read under data.root)."""

  weight: float
  start: float
  end: float
  prefix: str


def weighted_split_key(role: str) -> str:
  return f'data.{role}_weighted_split_paths'


def uses_weighted_split_paths(data_cfg) -> bool:
  return any(getattr(data_cfg, f'{role}_weighted_split_paths', ()) for role in WEIGHTED_SPLIT_ROLES)


def uses_seqio(data_cfg) -> bool:
  return bool(getattr(data_cfg, 'mixture_or_task', ''))


def uses_split(data_cfg) -> bool:
  """Whether data.split cuts this run's datasets: those of data.train_path, or the embedded
  corpus. A seqio Task and the weighted split paths name their splits themselves, so a split
  that a config file sets for the embedded corpus does not apply to them (nor block them)."""
  return not uses_weighted_split_paths(data_cfg) and not uses_seqio(data_cfg)


def uses_embedded_corpus(data_cfg) -> bool:
  """No dataset is named: the run reads the embedded corpus with the shipped tokenizer."""
  return (
    not data_cfg.train_path and not uses_weighted_split_paths(data_cfg) and not uses_seqio(data_cfg)
  )


def parse_weighted_split_group(text: str, key: str) -> tuple[str, list[RangedDataset]]:
  """`NAME: W1 START:END PREFIX1, W2 START:END PREFIX2, ...` (one group of Megatron's
  --*-weighted-split-paths) as (NAME, [RangedDataset]); one DataError naming the fix if bad."""
  if not isinstance(text, str):
    raise DataError(f'{key}: a group is a string such as {_GROUP_EXAMPLE}, got {text!r}')
  name, colon, body = text.partition(':')
  name = name.strip()
  # Megatron takes whatever precedes the first ':' as the name; here a missing name ("1 0:1 /d")
  # is an error rather than a set silently called "1 0".
  if not colon or not re.fullmatch(r'[\w.-]+', name):
    raise DataError(
      f'{key}: the group {text!r} has no name; write NAME: WEIGHT START:END PREFIX, '
      f'... such as {_GROUP_EXAMPLE} (a name is letters, digits, "_", "-", ".")'
    )
  entries = []
  for part in body.split(','):
    words = part.split()
    if len(words) != 3:
      raise DataError(
        f'{key}: group {name!r}: {part.strip()!r} is not "WEIGHT START:END PREFIX"; '
        f'datasets are separated by commas, as in {_GROUP_EXAMPLE}'
      )
    weight, span, prefix = words
    try:
      value = float(weight)
    except ValueError:
      value = math.nan
    if not (value > 0 and math.isfinite(value)):
      raise DataError(
        f'{key}: group {name!r}: the weight {weight!r} of {prefix} must be a '
        "number > 0 (only the ratios of a group's weights matter)"
      )
    try:
      start, end = (float(x) for x in span.split(':'))
    except ValueError:
      start = end = math.nan
    if not 0 <= start < end <= 1:
      raise DataError(
        f'{key}: group {name!r}: the range {span!r} of {prefix} must be START:END '
        'with 0 <= START < END <= 1, the fractions of its documents to read '
        '(tr11: 0:0.950 to train, 0.950:1.0 to validate)'
      )
    entries.append(RangedDataset(value, start, end, prefix))
  total = sum(entry.weight for entry in entries)
  if not math.isfinite(total) or not all(math.isfinite(total / e.weight) for e in entries):
    raise DataError(
      f'{key}: group {name!r}: the weights sum to {total:g}, or one is too small a '
      'share of their sum; only their ratios matter, so use moderate values'
    )
  return name, entries


def weighted_split_groups(data_cfg, role: str) -> list[tuple[str, list[RangedDataset]]]:
  """The groups of data.<role>_weighted_split_paths: one string is one group, a tuple several."""
  value = getattr(data_cfg, f'{role}_weighted_split_paths')
  groups = (value,) if isinstance(value, str) else tuple(value)
  return [parse_weighted_split_group(group, weighted_split_key(role)) for group in groups]


def range_documents(num_documents: int, start: float, end: float) -> tuple[int, int]:
  """The documents [first, last) that START:END selects, rounded as Megatron's
  get_split_by_range_ rounds them: Python's round() (half to even) of START x N and END x N."""
  return round(start * float(num_documents)), round(end * float(num_documents))


def check_weighted_split_paths(d, e) -> None:
  """Config-time checks of data.*_weighted_split_paths and data.root (`d` a DataConfig, `e` an
  EvalConfig): the syntax, Megatron's exclusion of --data-path/--split, and the set names."""
  try:
    groups = {role: weighted_split_groups(d, role) for role in WEIGHTED_SPLIT_ROLES}
  except DataError as error:
    raise ConfigError(str(error)) from None
  if not any(groups.values()):
    if d.root:
      raise ConfigError(
        f'data.root={d.root!r} is where the prefixes of the weighted split paths '
        'are read, and none is set; set data.train_weighted_split_paths or '
        "data.root=''"
      )
    return
  if d.train_path:
    raise ConfigError(
      "data.train_path (Megatron's --data-path, cut by data.split) cannot be combined "
      "with data.*_weighted_split_paths, which name each dataset's range themselves; "
      "keep one of the two (data.train_path='' for the weighted split paths)"
    )
  if len(groups['train']) != 1:
    raise ConfigError(
      f'data.train_weighted_split_paths takes one group, the training blend (as '
      f"Megatron's --train-weighted-split-paths), got {len(groups['train'])}; "
      'put all training datasets in one group'
    )
  names = {name for name, _ in d.valid_path}
  for role in ('valid', 'test'):
    for name, _ in groups[role]:
      if name in names:
        raise ConfigError(
          f'{weighted_split_key(role)}: the set name {name!r} is used twice (by '
          'another group or data.valid_path); rename one'
        )
      names.add(name)
  if len(groups['test']) > 1:
    raise ConfigError(
      f'data.test_weighted_split_paths holds {len(groups["test"])} groups; the '
      'trainer evaluates one test set: give one group'
    )
  if e.interval and not groups['valid'] and not d.valid_path:
    raise ConfigError(
      f'eval.interval={e.interval} but there is no validation set: set '
      'data.valid_weighted_split_paths (tr11: 0.950:1.0 of each dataset) or '
      'data.valid_path, or eval.interval=0'
    )


def _build_weighted(data_cfg, seq_len: int, seed: int) -> DataSources:
  """The sources of data.*_weighted_split_paths: each group a blend of document ranges."""
  root = data_cfg.root
  if root and not os.path.isdir(root):
    raise DataError(
      f'data.root={root!r} is not a directory; point it at the directory that holds '
      "the datasets' prefixes (--config.data.root=/path/to/data)"
    )
  streams: dict[str, DocumentStream] = {}
  notes: list[str] = []

  def group_source(role: str, position: int, name: str, entries: list[RangedDataset]):
    key = weighted_split_key(role)
    parts, weights, names = [], [], []
    total = sum(entry.weight for entry in entries)
    for index, entry in enumerate(entries):
      path = os.path.join(root, entry.prefix) if root else entry.prefix
      if path not in streams:  # a dataset named by several groups is opened once
        streams[path] = open_indexed(path)
      stream = streams[path]
      count = len(stream.offsets) - 1
      first, last = range_documents(count, entry.start, entry.end)
      if last <= first:
        raise DataError(
          f'{key}: group {name!r}: the range {entry.start:g}:{entry.end:g} of '
          f'{path} ({count} documents) rounds to no document; widen the range'
        )
      parts.append(
        _source(
          stream,
          (first, last),
          seq_len,
          seed,
          (_WEIGHTED, WEIGHTED_SPLIT_ROLES.index(role), position, index),
          f'{key} group {name!r}',
        )
      )
      weights.append(entry.weight)
      names.append(path)
      notes.append(
        f'> data: {role} group {name!r}: {path} (weight {entry.weight / total:.4f}): '
        f'documents {first}..{last} of {count}'
      )
    return _mix(parts, weights, names, data_cfg.blend_order), names

  ((train_name, train_entries),) = weighted_split_groups(data_cfg, 'train')
  train, train_names = group_source('train', 0, train_name, train_entries)
  valid = {
    name: group_source('valid', position, name, entries)[0]
    for position, (name, entries) in enumerate(weighted_split_groups(data_cfg, 'valid'))
  }
  valid.update(_valid_path_sets(data_cfg, seq_len, seed))
  test_groups = weighted_split_groups(data_cfg, 'test')
  test = group_source('test', 0, *test_groups[0])[0] if test_groups else None
  return DataSources(train, valid, test, notes, train_names)


# ------------------------------------------------------------ seqio Tasks and Mixtures


def check_seqio(d, e) -> None:
  """Config-time checks of data.mixture_or_task (`d` a DataConfig, `e` an EvalConfig): no other
  training data named, the module imports, the name is registered, each Task has 'targets', and
  evaluation has a validation split to read. Imports seqio (TensorFlow: seconds)."""
  from t5x_like.data import seqio_tasks  # pylint: disable=import-outside-toplevel  # TF: slow

  others = [
    key
    for key, is_set in (
      ('data.train_path', d.train_path),
      ('data.*_weighted_split_paths', uses_weighted_split_paths(d)),
    )
    if is_set
  ]
  if others:
    raise ConfigError(
      f'data.mixture_or_task={d.mixture_or_task!r} names the training data and '
      f'its splits itself, and {" and ".join(others)} too; keep one of the two '
      "(data.train_path='', no weighted split paths)"
    )
  try:
    provider = seqio_tasks.get_mixture_or_task(d.mixture_or_task, d.mixture_or_task_module)
    seqio_tasks.training_tasks(provider)
  except DataError as error:
    raise ConfigError(str(error)) from None
  names = {name for name, _ in d.valid_path}
  sets = [
    seqio_tasks.validation_set_name(task.name, split)
    for task in seqio_tasks.subtasks(provider)
    for split in seqio_tasks.validation_splits(task)
  ]
  clash = sorted(names.intersection(sets) | {n for n in sets if sets.count(n) > 1})
  if clash:
    raise ConfigError(
      f"the validation set name {clash[0]!r} is used twice (by a seqio Task's "
      'split and data.valid_path, or two splits); rename the data.valid_path set'
    )
  if e.interval and not sets and not d.valid_path:
    raise ConfigError(
      f'eval.interval={e.interval} but data.mixture_or_task='
      f'{d.mixture_or_task!r} has no validation split (a split other than train '
      'and test) and data.valid_path is empty; give one, or eval.interval=0'
    )


def _build_seqio(data_cfg, seq_len: int, seed: int) -> DataSources:
  """The sources of data.mixture_or_task: its Tasks materialised (or found in the cache), the
  training splits blended by the Mixture's rates, each validation split a named set."""
  from t5x_like.data import (
    materialize,  # pylint: disable=import-outside-toplevel  # TF: slow
    seqio_tasks,  # pylint: disable=import-outside-toplevel
  )

  prepared = materialize.prepare(
    data_cfg.mixture_or_task, data_cfg.mixture_or_task_module, data_cfg.cache_dir
  )
  parts, weights, names, notes, valid = [], [], [], [], {}
  total = sum(task.rate for task in prepared)
  for position, task in enumerate(prepared):
    for split_position, (split, entry) in enumerate(task.valid.items()):
      stream = open_indexed(entry.prefix)
      name = seqio_tasks.validation_set_name(task.name, split)
      valid[name] = _source(
        stream,
        (0, entry.documents),
        seq_len,
        seed,
        (_SEQIO, 1, position, split_position),
        f'validation set {name!r}',
      )
    if task.train is None:  # rate 0: evaluated, not trained on
      continue
    stream = open_indexed(task.train.prefix)
    parts.append(
      _source(
        stream,
        (0, task.train.documents),
        seq_len,
        seed,
        (_SEQIO, 0, position, 0),
        f'the train split of seqio Task {task.name!r}',
      )
    )
    weights.append(task.rate)
    names.append(task.name)
    built = 'materialised now' if task.train.built else 'cached'
    notes.append(
      f'> data: seqio Task {task.name} (weight {task.rate / total:.4f}): '
      f'{task.train.documents} documents, {task.train.tokens} tokens in its train '
      f'split ({built}: {task.train.prefix}); validation sets: '
      f'{", ".join(task.valid) or "none"}'
    )
  valid.update(_valid_path_sets(data_cfg, seq_len, seed))
  return DataSources(_mix(parts, weights, names, data_cfg.blend_order), valid, None, notes, names)
