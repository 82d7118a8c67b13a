"""Tests for the shipped SentencePiece tokenizer and its rebuild path."""

import os
import stat

import pytest

from t5x_like.data import corpus
from t5x_like.data import tokenizer as tokenizer_lib
from t5x_like.data.tokenizer import Tokenizer

SAMPLES = [
  'The quick brown fox jumps over the lazy dog.',
  '  Leading spaces,\ttabs\nand newlines\n\n  survive.  ',
  'def f(x):\n    return x ** 2  # squared\n',
  'Naïve café — Grüße, 日本語, emoji 🎉, combining e\u0301.',
  '',
]


@pytest.fixture(scope='module')
def tokenizer():
  return Tokenizer.load_default()


def test_shipped_model_is_small_and_has_the_expected_ids(tokenizer):
  assert os.path.getsize(tokenizer_lib.DEFAULT_MODEL_PATH) < 1_000_000
  assert tokenizer.vocab_size == 8192
  assert tokenizer.eod_id == 1 and tokenizer.id_to_piece(tokenizer.eod_id) == '</s>'
  assert tokenizer.pad_id == 0 and tokenizer.id_to_piece(0) == '<pad>'
  assert len(tokenizer.fingerprint) == 16


@pytest.mark.parametrize('text', SAMPLES)
def test_round_trip_is_exact(tokenizer, text):
  ids = tokenizer.encode(text)
  assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids)
  assert tokenizer.decode(ids) == text


def test_characters_outside_the_vocabulary_use_byte_fallback(tokenizer):
  pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode('日本')]
  # Two CJK characters are six UTF-8 bytes; none of them is in an English-trained vocabulary.
  assert pieces[-6:] == ['<0xE6>', '<0x97>', '<0xA5>', '<0xE6>', '<0x9C>', '<0xAC>']
  assert tokenizer.unk_id not in tokenizer.encode('日本 \x00 \U0010fffd')


def test_english_compresses_to_subwords(tokenizer):
  text = (
    'Return a new list containing all items from the iterable in ascending order. '
    'A custom key function can be supplied to customize the sort order.'
  )
  assert len(tokenizer.encode(text)) < len(text) / 3.5


def test_encode_batch_matches_encode(tokenizer):
  assert tokenizer.encode_batch(SAMPLES, num_threads=2) == [tokenizer.encode(t) for t in SAMPLES]


def test_decode_accepts_numpy_integers(tokenizer):
  import numpy as np  # pylint: disable=import-outside-toplevel

  ids = tokenizer.encode('numpy ids')
  assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == 'numpy ids'


def _tiny_corpus():
  return corpus.topic_documents()[:8]


def test_train_tokenizer_is_deterministic_and_atomic(tmp_path):
  first = tokenizer_lib.train_tokenizer(_tiny_corpus(), str(tmp_path / 'a' / 'tok.model'), 512)
  second = tokenizer_lib.train_tokenizer(_tiny_corpus(), str(tmp_path / 'b.model'), 512)
  with open(first, 'rb') as f, open(second, 'rb') as g:
    assert f.read() == g.read()
  assert os.listdir(tmp_path / 'a') == ['tok.model']  # No temporary file left behind.
  assert stat.S_IMODE(os.stat(first).st_mode) == 0o644
  trained = Tokenizer.from_file(first)
  assert trained.vocab_size == 512 and trained.eod_id == 1 and trained.path == first
  text = 'An assert statement, then ünïcödé.'
  assert trained.decode(trained.encode(text)) == text


def test_rebuild_command_trains_on_the_default_corpus(tmp_path, monkeypatch, capsys):
  # The real corpus takes seconds to train on; the command wiring is what is tested here.
  monkeypatch.setattr(corpus, 'default_documents', _tiny_corpus)
  output = str(tmp_path / 'rebuilt.model')
  tokenizer_lib.main(['--rebuild', '--output', output, '--vocab_size', '400'])
  assert Tokenizer.from_file(output).vocab_size == 400
  assert output in capsys.readouterr().out


def test_command_without_rebuild_flag_fails():
  with pytest.raises(SystemExit):
    tokenizer_lib.main([])


def test_seqio_vocabulary_matches(tokenizer):
  vocabulary = tokenizer_lib.seqio_vocabulary()
  assert vocabulary.vocab_size == tokenizer.vocab_size
  assert vocabulary.eos_id == tokenizer.eod_id
  text = SAMPLES[0]
  assert list(vocabulary.encode(text)) == tokenizer.encode(text)
