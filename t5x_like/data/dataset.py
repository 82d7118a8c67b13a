"""The tokenized corpus as one token stream, and the deterministic sampler over it.

Megatron-style GPT data: every document is encoded and followed by the EOD id, all concatenated
into one int32 stream.  A sample is `seq_len + 1` contiguous tokens (inputs and shifted targets)
that may cross document boundaries.  Which window the g-th sample of training is depends only on
(seed, g), so any host can build any slice of any batch without reading the rest, and resuming from
`consumed_samples` reproduces the same data order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence

import numpy as np

from t5x_like import files
from t5x_like.data import corpus
from t5x_like.data.tokenizer import Tokenizer

CACHE_ENV_VAR = 'T5X_LIKE_CACHE'
# Permutations kept in memory: a batch straddles at most two epochs.
_CACHED_EPOCHS = 2


def default_cache_dir() -> str:
  return os.environ.get(CACHE_ENV_VAR) or os.path.join(
    os.path.expanduser('~'), '.cache', 't5x_like'
  )


def encode_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> np.ndarray:
  """All documents encoded and concatenated, each followed by the EOD id (int32)."""
  threads = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  encoded = tokenizer.encode_batch(documents, num_threads=threads or 1)
  eod = np.array([tokenizer.eod_id], dtype=np.int32)
  pieces = []
  for ids in encoded:
    pieces.append(np.asarray(ids, dtype=np.int32))
    pieces.append(eod)
  if not pieces:
    return np.zeros((0,), dtype=np.int32)
  return np.concatenate(pieces)


def _checksum(tokens: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(tokens, dtype='<i4').tobytes()).hexdigest()


def cache_paths(cache_dir: str, corpus_id: str, tokenizer_id: str) -> tuple[str, str]:
  """(tokens .npy, metadata .json) for a corpus and tokenizer fingerprint."""
  stem = os.path.join(cache_dir, f'tokens-{corpus_id}-{tokenizer_id}')
  return stem + '.npy', stem + '.json'


def _load_cached(tokens_path: str, meta_path: str) -> np.ndarray | None:
  """The cached stream if both files exist and agree; None (and a warning) otherwise."""
  if not (os.path.exists(tokens_path) and os.path.exists(meta_path)):
    return None
  try:
    with open(meta_path, encoding='utf-8') as f:
      meta = json.load(f)
    tokens = np.load(tokens_path, allow_pickle=False)
    valid = (
      tokens.dtype == np.int32
      and tokens.ndim == 1
      and tokens.size == meta['num_tokens']
      and _checksum(tokens) == meta['sha256']
    )
  except (OSError, ValueError, EOFError, KeyError, TypeError) as error:
    valid, tokens = False, None
    logging.warning('Unreadable token cache %s (%s); rebuilding it.', tokens_path, error)
  else:
    if not valid:
      logging.warning('Token cache %s does not match %s; rebuilding it.', tokens_path, meta_path)
  return tokens if valid else None


def _recorded_corpus_id(path: str) -> str | None:
  """The corpus fingerprint recorded at `path` (corpus_tokens), or None if there is none."""
  try:
    with open(path, encoding='utf-8') as f:
      corpus_id = json.load(f)['corpus']
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, TypeError) as error:
    logging.warning('Unreadable corpus record %s (%s); building the corpus.', path, error)
    return None
  return corpus_id if isinstance(corpus_id, str) and corpus_id else None


def corpus_tokens(
  tokenizer: Tokenizer, cache_dir: str | None = None, documents: Sequence[str] | None = None
) -> np.ndarray:
  """The encoded corpus (default: `corpus.default_documents()`) as one int32 stream, cached.

  The cache is keyed by the corpus fingerprint and the tokenizer file hash.  Its metadata file
  records the token count and checksum, so a truncated or corrupted cache is rebuilt, never used.
  The default corpus's fingerprint is kept too, keyed by what it is built from
  (`corpus.sources_fingerprint`), so that its cached tokens are found without building it.
  """
  cache_dir = cache_dir or default_cache_dir()
  sources_path = ''
  if documents is None:
    sources_path = os.path.join(cache_dir, f'corpus-{corpus.sources_fingerprint()}.json')
    known_id = _recorded_corpus_id(sources_path)
    if known_id:
      tokens = _load_cached(*cache_paths(cache_dir, known_id, tokenizer.fingerprint))
      if tokens is not None:
        return tokens
    documents = corpus.default_documents()
  corpus_id = corpus.corpus_fingerprint(documents)
  if sources_path:
    record = json.dumps({'corpus': corpus_id, 'num_documents': len(documents)}).encode('utf-8')
    files.atomic_write(sources_path, lambda f: f.write(record))
  tokens_path, meta_path = cache_paths(cache_dir, corpus_id, tokenizer.fingerprint)
  tokens = _load_cached(tokens_path, meta_path)
  if tokens is not None:
    return tokens

  tokens = encode_documents(tokenizer, documents)
  meta = dict(
    num_tokens=int(tokens.size),
    sha256=_checksum(tokens),
    corpus=corpus_id,
    tokenizer=tokenizer.fingerprint,
    num_documents=len(documents),
  )
  # Tokens first, metadata last: the metadata's presence vouches for a finished tokens file.
  files.atomic_write(tokens_path, lambda f: np.save(f, tokens, allow_pickle=False))
  files.atomic_write(meta_path, lambda f: f.write(json.dumps(meta, indent=2).encode('utf-8')))
  return tokens


class SampleSource:
  """Index-addressable training samples over a token stream.

  Window k is tokens[k * seq_len : k * seq_len + seq_len + 1]; consecutive windows share one
  token, so every token is a target exactly once per epoch.  Global sample g is window
  perm(seed, e)[g % num_samples] of epoch e = g // num_samples, where perm(seed, e) is a numpy
  permutation from default_rng([seed, *stream, e]): a pure function of (seed, stream, g).
  `stream` tells apart sources that share a seed (the datasets of a blend, their splits).

  `tokens` may be any 1-D integer array, a memory map of a Megatron .bin included: it is never
  copied whole, and each call reads only the windows it returns.
  """

  def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, stream: tuple[int, ...] = ()):
    if not isinstance(tokens, np.ndarray):
      tokens = np.asarray(tokens)
    if tokens.ndim != 1:
      raise ValueError(f'tokens must be a 1-D stream, got shape {tokens.shape}')
    if seq_len < 1:
      raise ValueError(f'seq_len must be positive, got {seq_len}')
    if seed < 0:
      raise ValueError(f'seed must be non-negative (numpy seeds are), got {seed}')
    if tokens.dtype.kind not in 'iu':
      raise ValueError(f'tokens must be integer ids, got dtype {tokens.dtype}')
    self.tokens = tokens
    self.seq_len = int(seq_len)
    self.seed = int(seed)
    self.stream = tuple(int(s) for s in stream)
    self.num_samples = max(self.tokens.size - 1, 0) // self.seq_len
    if self.num_samples < 1:
      raise ValueError(
        f'The corpus has {self.tokens.size} tokens, too few for one sample of seq_len + 1 = '
        f'{self.seq_len + 1} tokens (seq_len={self.seq_len}); use a smaller seq_len or a '
        'larger corpus.'
      )
    self._permutations: dict[int, np.ndarray] = {}

  def permutation(self, epoch: int) -> np.ndarray:
    """The window order of one epoch."""
    permutation = self._permutations.get(epoch)
    if permutation is None:
      permutation = np.random.default_rng([self.seed, *self.stream, epoch]).permutation(
        self.num_samples
      )
      if len(self._permutations) >= _CACHED_EPOCHS:
        # Training moves forward through epochs, so the oldest entry is the one to drop.
        del self._permutations[min(self._permutations)]
      self._permutations[epoch] = permutation
    return permutation

  def windows(self, start: int, stop: int) -> np.ndarray:
    """Window index of each global sample in [start, stop)."""
    if not 0 <= start <= stop:
      raise ValueError(f'need 0 <= start <= stop, got start={start}, stop={stop}')
    indices = np.arange(start, stop, dtype=np.int64)
    epochs, positions = np.divmod(indices, self.num_samples)
    windows = np.empty_like(indices)
    for epoch in np.unique(epochs):
      selected = epochs == epoch
      windows[selected] = self.permutation(int(epoch))[positions[selected]]
    return windows

  def rows(self, start: int, stop: int) -> np.ndarray:
    """Global samples start..stop-1 as int32 [stop - start, seq_len + 1]."""
    offsets = self.windows(start, stop) * self.seq_len
    # Sorted reads touch a memory-mapped file in order; the rows go back to sample order.
    order = np.argsort(offsets, kind='stable')
    rows = np.empty((stop - start, self.seq_len + 1), np.int32)
    rows[order] = self.tokens[offsets[order][:, None] + np.arange(self.seq_len + 1)]
    return rows

  def sample(self, index: int) -> np.ndarray:
    """Global sample `index` as int32 [seq_len + 1]."""
    return self.rows(index, index + 1)[0]

  def batch(self, consumed_samples: int, global_batch_size: int) -> np.ndarray:
    """The global batch after `consumed_samples`: int32 [global_batch_size, seq_len + 1]."""
    return self.rows(consumed_samples, consumed_samples + global_batch_size)


def load_default(
  seq_len: int, seed: int, cache_dir: str | None = None
) -> tuple[Tokenizer, SampleSource]:
  """The shipped tokenizer and a sampler over the default corpus (token stream cached on disk)."""
  tokenizer = Tokenizer.load_default()
  return tokenizer, SampleSource(corpus_tokens(tokenizer, cache_dir), seq_len, seed)
