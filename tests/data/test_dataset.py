"""Tests for the token stream, its cache, and the deterministic sampler."""

import json
import os

import numpy as np
import pytest

import t5x_like.data
from t5x_like import files
from t5x_like.data import corpus, dataset
from t5x_like.data.dataset import SampleSource
from t5x_like.data.tokenizer import Tokenizer

DOCUMENTS = [
  'The first document talks about lists and dictionaries.',
  'A second, shorter one.',
  'Ünïcödé text still encodes, thanks to byte fallback: 日本.',
]


@pytest.fixture(scope='module')
def tokenizer():
  return Tokenizer.load_default()


def _stream(size=1000):
  # Token value == position, so a window's values reveal exactly where it was cut from.
  return np.arange(size, dtype=np.int32)


# Token stream and cache.


def test_stream_is_each_document_followed_by_eod(tokenizer):
  expected = []
  for document in DOCUMENTS:
    expected += tokenizer.encode(document) + [tokenizer.eod_id]
  tokens = dataset.encode_documents(tokenizer, DOCUMENTS)
  assert tokens.dtype == np.int32
  assert tokens.tolist() == expected


def _count_encodes(monkeypatch):
  calls = []
  original = dataset.encode_documents

  def counting(*args):
    calls.append(1)
    return original(*args)

  monkeypatch.setattr(dataset, 'encode_documents', counting)
  return calls


def test_cache_round_trip_reuses_the_file(tokenizer, tmp_path, monkeypatch):
  calls = _count_encodes(monkeypatch)
  first = dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS)
  tokens_path, meta_path = dataset.cache_paths(
    str(tmp_path), corpus.corpus_fingerprint(DOCUMENTS), tokenizer.fingerprint
  )
  written = os.stat(tokens_path)
  second = dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS)
  assert calls == [1]
  np.testing.assert_array_equal(first, second)
  assert second.dtype == np.int32
  # Same inode and mtime: the second call read the file instead of replacing it.
  assert (os.stat(tokens_path).st_ino, os.stat(tokens_path).st_mtime_ns) == (
    written.st_ino,
    written.st_mtime_ns,
  )
  assert sorted(os.listdir(tmp_path)) == sorted(
    [os.path.basename(tokens_path), os.path.basename(meta_path)]
  )


def test_cache_is_keyed_by_corpus(tokenizer, tmp_path):
  dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS)
  other = dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS[:1])
  assert other.tolist() == tokenizer.encode(DOCUMENTS[0]) + [tokenizer.eod_id]
  assert len(os.listdir(tmp_path)) == 4


def _truncate(path):
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) - 4)


def _flip_last_byte(path):
  with open(path, 'r+b') as f:
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
    f.seek(-1, os.SEEK_END)
    f.write(bytes([last[0] ^ 0xFF]))


def _garble(path):
  with open(path, 'wb') as f:
    f.write(b'\x93NUMPY garbage')


@pytest.mark.parametrize(
  'damage,target',
  [
    (_truncate, 'tokens'),
    (_flip_last_byte, 'tokens'),
    (_garble, 'tokens'),
    (os.remove, 'tokens'),
    (_garble, 'meta'),
    (os.remove, 'meta'),
  ],
)
def test_damaged_cache_is_rebuilt(tokenizer, tmp_path, monkeypatch, damage, target):
  expected = dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS)
  tokens_path, meta_path = dataset.cache_paths(
    str(tmp_path), corpus.corpus_fingerprint(DOCUMENTS), tokenizer.fingerprint
  )
  damage(tokens_path if target == 'tokens' else meta_path)
  calls = _count_encodes(monkeypatch)
  np.testing.assert_array_equal(
    dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS), expected
  )
  assert calls == [1]
  # The rebuilt cache is whole again and is used as is.
  np.testing.assert_array_equal(
    dataset.corpus_tokens(tokenizer, str(tmp_path), DOCUMENTS), expected
  )
  assert calls == [1]


def _default_corpus_is(monkeypatch, documents):
  """corpus.default_documents() returns `documents`; returns the list of its calls."""
  calls = []

  def default_documents():
    calls.append(1)
    if documents is None:
      raise AssertionError('the default corpus was built')
    return list(documents)

  monkeypatch.setattr(corpus, 'default_documents', default_documents)
  return calls


def test_default_corpus_tokens_are_found_without_building_the_corpus(
  tokenizer, tmp_path, monkeypatch
):
  built = _default_corpus_is(monkeypatch, DOCUMENTS)
  first = dataset.corpus_tokens(tokenizer, str(tmp_path))
  assert built == [1]
  record = tmp_path / f'corpus-{corpus.sources_fingerprint()}.json'
  assert json.loads(record.read_text()) == {
    'corpus': corpus.corpus_fingerprint(DOCUMENTS),
    'num_documents': len(DOCUMENTS),
  }
  # The next process reads the recorded fingerprint and the tokens: no corpus is built.
  _default_corpus_is(monkeypatch, None)
  np.testing.assert_array_equal(dataset.corpus_tokens(tokenizer, str(tmp_path)), first)
  # Other sources (a Python upgrade, an edited library file): the corpus is built again.
  built = _default_corpus_is(monkeypatch, DOCUMENTS[:1])
  monkeypatch.setattr(corpus, 'sources_fingerprint', lambda: 'other-sources')
  again = dataset.corpus_tokens(tokenizer, str(tmp_path))
  assert built == [1] and again.tolist() == tokenizer.encode(DOCUMENTS[0]) + [tokenizer.eod_id]


@pytest.mark.parametrize('damage', ['garbled', 'no tokens'])
def test_a_damaged_corpus_record_or_its_missing_tokens_build_the_corpus_again(
  tokenizer, tmp_path, monkeypatch, caplog, damage
):
  _default_corpus_is(monkeypatch, DOCUMENTS)
  expected = dataset.corpus_tokens(tokenizer, str(tmp_path))
  record = tmp_path / f'corpus-{corpus.sources_fingerprint()}.json'
  if damage == 'garbled':
    record.write_text('{"corpus": ')
  else:
    for path in dataset.cache_paths(
      str(tmp_path), corpus.corpus_fingerprint(DOCUMENTS), tokenizer.fingerprint
    ):
      os.remove(path)
  built = _default_corpus_is(monkeypatch, DOCUMENTS)
  np.testing.assert_array_equal(dataset.corpus_tokens(tokenizer, str(tmp_path)), expected)
  assert built == [1]
  assert ('Unreadable corpus record' in caplog.text) == (damage == 'garbled')
  assert json.loads(record.read_text())['corpus'] == corpus.corpus_fingerprint(DOCUMENTS)


def test_failed_write_leaves_no_file(tmp_path):
  path = str(tmp_path / 'target.npy')

  def crash(f):
    f.write(b'partial')
    raise RuntimeError('simulated crash')

  with pytest.raises(RuntimeError):
    files.atomic_write(path, crash)
  assert os.listdir(tmp_path) == []


def test_default_cache_dir_follows_environment(tmp_path, monkeypatch):
  monkeypatch.setenv(dataset.CACHE_ENV_VAR, str(tmp_path))
  assert dataset.default_cache_dir() == str(tmp_path)
  monkeypatch.delenv(dataset.CACHE_ENV_VAR)
  assert dataset.default_cache_dir().endswith(os.path.join('.cache', 't5x_like'))


# Sampler.


def test_windows_are_contiguous_overlapping_by_one_token():
  source = SampleSource(_stream(1000), seq_len=10, seed=0)
  assert source.num_samples == 99  # (1000 - 1) // 10
  rows = source.rows(0, source.num_samples)
  assert rows.shape == (99, 11) and rows.dtype == np.int32
  for row in rows:
    start = int(row[0])
    assert start % 10 == 0
    np.testing.assert_array_equal(row, np.arange(start, start + 11))


def test_every_window_appears_once_per_epoch():
  source = SampleSource(_stream(1000), seq_len=10, seed=3)
  n = source.num_samples
  orders = []
  for epoch in range(3):
    starts = source.rows(epoch * n, (epoch + 1) * n)[:, 0] // 10
    np.testing.assert_array_equal(np.sort(starts), np.arange(n))
    orders.append(starts.tolist())
  assert orders[0] != orders[1] != orders[2]


def test_order_is_the_documented_permutation():
  seed, seq_len = 5, 7
  source = SampleSource(_stream(500), seq_len, seed)
  n = source.num_samples
  for index in (0, 1, n - 1, n, 2 * n + 3):
    epoch, position = divmod(index, n)
    window = np.random.default_rng([seed, epoch]).permutation(n)[position]
    np.testing.assert_array_equal(
      source.sample(index), np.arange(window * seq_len, window * seq_len + seq_len + 1)
    )


def test_order_is_a_pure_function_of_seed_and_index():
  first = SampleSource(_stream(), seq_len=16, seed=7)
  second = SampleSource(_stream(), seq_len=16, seed=7)
  # Different access orders (and so different permutation cache states) give the same samples.
  forward = first.rows(0, 300)
  backward = np.stack([second.sample(g) for g in reversed(range(300))])[::-1]
  np.testing.assert_array_equal(forward, backward)
  other_seed = SampleSource(_stream(), seq_len=16, seed=8)
  assert not np.array_equal(forward, other_seed.rows(0, 300))


def test_batch_is_concatenation_of_host_slices():
  source = SampleSource(_stream(), seq_len=8, seed=1)
  consumed, global_batch_size = 230, 48  # 124 samples per epoch: this batch spans two epochs.
  batch = source.batch(consumed, global_batch_size)
  assert batch.shape == (48, 9)
  fresh = SampleSource(_stream(), seq_len=8, seed=1)
  slices = [fresh.rows(consumed + i, consumed + i + 12) for i in range(0, 48, 12)]
  np.testing.assert_array_equal(batch, np.concatenate(slices))


def test_too_short_corpus_is_a_clear_error():
  SampleSource(_stream(11), seq_len=10, seed=0)  # Exactly one window fits.
  with pytest.raises(ValueError, match=r'10 tokens.*seq_len=10'):
    SampleSource(_stream(10), seq_len=10, seed=0)


@pytest.mark.parametrize(
  'kwargs',
  [
    dict(tokens=np.zeros((2, 50), np.int32), seq_len=4, seed=0),
    dict(tokens=_stream(), seq_len=0, seed=0),
    dict(tokens=_stream(), seq_len=4, seed=-1),
  ],
)
def test_invalid_arguments_are_rejected(kwargs):
  with pytest.raises(ValueError):
    SampleSource(**kwargs)


def test_negative_or_reversed_ranges_are_rejected():
  source = SampleSource(_stream(), seq_len=4, seed=0)
  with pytest.raises(ValueError):
    source.rows(-1, 3)
  with pytest.raises(ValueError):
    source.rows(5, 4)
  assert source.rows(4, 4).shape == (0, 5)


# Package entry point.


def test_load_default_serves_english_from_the_default_corpus(tmp_path):
  tokenizer, source = t5x_like.data.load_default(seq_len=64, seed=0, cache_dir=str(tmp_path))
  assert isinstance(tokenizer, t5x_like.data.Tokenizer)
  assert source.num_samples > 5000
  batch = source.batch(0, 8)
  assert batch.shape == (8, 65) and batch.dtype == np.int32
  assert int(batch.max()) < tokenizer.vocab_size
  text = ' '.join(tokenizer.decode(row) for row in batch)
  assert ' the ' in text


def test_package_exports():
  for name in ('Tokenizer', 'default_documents', 'corpus_tokens', 'SampleSource', 'load_default'):
    assert name in dir(t5x_like.data) and getattr(t5x_like.data, name) is not None
  assert t5x_like.data.SampleSource is SampleSource
  with pytest.raises(AttributeError):
    _ = t5x_like.data.no_such_name
