"""What a run reads: its training stream, validation sets and test split, built from `data.*`.

* `data.train_path` is Megatron's `--data-path`: one dataset prefix, or `W1 PREFIX1 W2 PREFIX2
  ...` to blend several by weight (`blending.py`). Empty: the embedded default corpus.
* `data.split` is Megatron's `--split` (default `969,30,1`): each dataset's documents, in file
  order, are cut into train / validation / test ranges with Megatron's rounding, so the same
  files and split give the same document ranges as Megatron did.
* `data.valid_path` names further validation sets, `{name: data path}`, each read whole.

Every source is a pure function of (train.seed, sample index): `SampleSource` windows over the
documents of its range, and a blend of them for several datasets. Opening checks every file
(`indexed.IndexedDataset`) and every range (enough tokens for one sample), so a bad path or a bad
split is one `DataError` before any compilation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from t5x_like.data import blending
from t5x_like.data import indexed
from t5x_like.data.dataset import SampleSource, corpus_tokens
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer

SPLIT_NAMES = ('train', 'valid', 'test')
# Sources sharing train.seed are told apart by a stream id: (split position in SPLIT_NAMES,
# dataset position), or (_NAMED_VALID, set position, dataset position) for data.valid_path.
_NAMED_VALID = 3
EMBEDDED = 'embedded'


def parse_data_path(spec: str, key: str = 'data.train_path') -> list[tuple[float, str]]:
  """`PREFIX` or `W1 PREFIX1 W2 PREFIX2 ...` (Megatron's --data-path) as [(weight, prefix)]."""
  words = spec.split()
  if len(words) == 1:
    return [(1.0, words[0])]
  if not words or len(words) % 2:
    raise DataError(f'{key}={spec!r}: give one dataset prefix, or weight/prefix pairs such as '
                    '"0.7 /data/en_text_document 0.3 /data/fr_text_document"')
  pairs = []
  for weight, prefix in zip(words[0::2], words[1::2]):
    try:
      value = float(weight)
    except ValueError:
      value = float('nan')
    if not value > 0 or not np.isfinite(value):
      raise DataError(f'{key}={spec!r}: {weight!r} is not a positive weight; weight/prefix pairs '
                      'alternate, weight first')
    pairs.append((value, prefix))
  total = sum(value for value, _ in pairs)
  # The blend divides by the sum and by each share: both must be finite numbers.
  tiny = [weight for weight, (value, _) in zip(words[0::2], pairs)
          if not np.isfinite(total / value)]
  if not np.isfinite(total) or tiny:
    problem = (f'the weights sum to {total:g}' if not np.isfinite(total) else
               f'the weight {tiny[0]} is too small a share of their sum {total:g}')
    raise DataError(f'{key}={spec!r}: {problem}; only the ratios of the weights matter, so use '
                    'moderate values such as "0.7 A 0.3 B"')
  return pairs


def parse_split(split: str) -> list[float]:
  """Megatron's --split string ('969,30,1' or '98/2/0') as three shares summing to 1."""
  parts = split.replace('/', ',').split(',')
  try:
    shares = [float(p) for p in parts if p.strip()]
  except ValueError:
    shares = []
  if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
    raise DataError(f'data.split={split!r}: give up to three non-negative train,valid,test '
                    'shares such as "969,30,1"')
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
    return self.tokens[int(self.offsets[first]):int(self.offsets[last])]


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
  train: object
  valid: dict[str, object]
  test: object | None
  notes: list[str]
  train_names: list[str] = dataclasses.field(default_factory=list)

  def epochs(self, total_samples: int) -> list[tuple[str, int, int]]:
    """(dataset, samples a run of `total_samples` draws from it, its training samples per epoch),
    so a run that repeats a small dataset many times is seen before it starts."""
    if isinstance(self.train, blending.BlendedSource):
      counts = self.train.blend.counts(total_samples)
      return [(name, int(count), source.num_samples)
              for name, count, source in zip(self.train_names, counts, self.train.sources)]
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
      fix = (f'set eval.iters <= {fits}' if fits else
             f'it holds less than one global batch ({global_batch_size}): give it more data '
             '(a larger share of data.split, or a larger data.valid_path set) or lower '
             'train.global_batch_size')
      raise DataError(f'the evaluation set {name!r} holds {held} samples, fewer than the '
                      f'{needed} an evaluation reads (eval.iters={eval_iters} x global batch '
                      f'{global_batch_size}), so it would repeat samples; {fix}')


def _source(stream: DocumentStream, documents: tuple[int, int], seq_len: int, seed: int,
            stream_id: tuple[int, ...], what: str) -> SampleSource:
  tokens = stream.documents(*documents)
  if tokens.size < seq_len + 1:
    raise DataError(f'{what}: documents {documents[0]}..{documents[1]} of {stream.name} hold '
                    f'{tokens.size} tokens, fewer than one sample of train.seq_len + 1 = '
                    f'{seq_len + 1}; change data.split or use more data')
  return SampleSource(tokens, seq_len, seed, stream=stream_id)


def _mix(sources: list[SampleSource], weights: list[float], names: list[str]):
  if len(sources) == 1:
    return sources[0]
  return blending.BlendedSource(sources, weights, names)


def build(data_cfg, seq_len: int, seed: int, tokenizer: Tokenizer | None = None) -> DataSources:
  """Opens every dataset `data_cfg` names and returns the run's sources (one DataError if bad)."""
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
        by_split[name].append(_source(stream, documents, seq_len, seed, (role, index),
                                      f'the {name} split (data.split={data_cfg.split!r})'))
        split_weights[name].append(weight)
        split_names[name].append(stream.name)
    counts = ', '.join(f'{n} {b - a}' for n, (a, b) in zip(SPLIT_NAMES, ranges))
    notes.append(f'> data: {stream.name} (weight {weight / sum(weights):.4f}): '
                 f'{len(stream.offsets) - 1} documents, {int(stream.offsets[-1])} tokens; '
                 f'documents per split: {counts}')
  if not by_split['train']:
    raise DataError(f'data.split={data_cfg.split!r} leaves no documents for training')
  if len(by_split['train']) < len(streams):
    raise DataError(f'data.split={data_cfg.split!r} leaves some dataset without training '
                    'documents; raise the train share')
  train = _mix(by_split['train'], split_weights['train'], split_names['train'])
  valid = {}
  if by_split['valid']:
    valid['valid'] = _mix(by_split['valid'], split_weights['valid'], split_names['valid'])
  for position, (name, spec) in enumerate(data_cfg.valid_path):
    named_pairs = parse_data_path(spec, key=f'data.valid_path[{name!r}]')
    sources = []
    for index, (_, prefix) in enumerate(named_pairs):
      stream = open_indexed(prefix)
      sources.append(_source(stream, (0, len(stream.offsets) - 1), seq_len, seed,
                             (_NAMED_VALID, position, index), f'validation set {name!r}'))
    valid[name] = _mix(sources, [w for w, _ in named_pairs], [p for _, p in named_pairs])
  test = (_mix(by_split['test'], split_weights['test'], split_names['test'])
          if by_split['test'] else None)
  return DataSources(train, valid, test, notes, split_names['train'])


def check_token_ids(rows: np.ndarray, vocab_size: int, what: str) -> None:
  """One DataError when a sample holds an id the model has no embedding row for."""
  top = int(rows.max()) if rows.size else 0
  low = int(rows.min()) if rows.size else 0
  if top >= vocab_size or low < 0:
    raise DataError(f'{what} holds token id {top if top >= vocab_size else low}, outside the '
                    f'model\'s vocabulary [0, {vocab_size}): the data was tokenized with another '
                    'tokenizer; set model.vocab_size to that tokenizer\'s size or re-tokenize')
