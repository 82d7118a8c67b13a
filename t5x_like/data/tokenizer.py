"""The default subword tokenizer: a SentencePiece BPE model trained on the default corpus.

The trained model ships in `assets/tokenizer.model`, so loading it needs neither training nor a
download.  Regenerate it after changing the corpus or the settings below with

    python -m t5x_like.data.tokenizer --rebuild

Ids follow the T5/seqio layout (pad 0, eos 1, unk 2), so the same file also works as a
`seqio.SentencePieceVocabulary`.  The eos id `</s>` doubles as the end-of-document (EOD) token that
separates documents in the training stream.  Byte fallback makes every string encodable: characters
missing from the vocabulary become their UTF-8 bytes, and decoding restores them exactly.

The shipped file was trained on the corpus of CPython 3.11.7.  Other Python versions yield a
slightly different corpus; that does not matter for the tokenizer, which is loaded, not retrained.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import sentencepiece as spm

from t5x_like import files
from t5x_like.data import corpus
from t5x_like.data.indexed import DataError

DEFAULT_MODEL_PATH = os.path.join(os.path.dirname(__file__), 'assets', 'tokenizer.model')
DEFAULT_VOCAB_SIZE = 8192
# Fixed so that --rebuild is reproducible; it only matters where the trainer samples.
TRAINING_SEED = 1234

PAD_ID, EOS_ID, UNK_ID, BOS_ID = 0, 1, 2, 3


def training_options(vocab_size: int) -> dict[str, Any]:
  """SentencePiece trainer settings; every choice that affects the model is pinned here."""
  return dict(
    model_type='bpe',
    vocab_size=vocab_size,
    # Identity normalization and kept whitespace: decode(encode(text)) == text, and code
    # indentation survives (needed for prose that quotes code).
    normalization_rule_name='identity',
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    byte_fallback=True,
    # Rare characters are left to byte fallback instead of spending vocabulary on them.
    character_coverage=0.9995,
    pad_id=PAD_ID,
    eos_id=EOS_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    # One thread and the whole input (no sampling) make training deterministic.
    num_threads=1,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    minloglevel=2,
  )


def _training_lines(documents: Iterable[str]) -> Iterator[str]:
  # SentencePiece trains on lines, so '\n' is never in its vocabulary: it encodes as the byte
  # token <0x0A>, which costs one token, as a dedicated piece would.
  for document in documents:
    for line in document.splitlines():
      if line.strip():
        yield line


def train_tokenizer(
  documents: Sequence[str], output_path: str, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> str:
  """Trains a model on `documents` and writes it to `output_path` atomically; returns the path."""
  spm.set_random_generator_seed(TRAINING_SEED)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=_training_lines(documents), model_writer=model, **training_options(vocab_size)
  )
  files.atomic_write(output_path, lambda f: f.write(model.getvalue()))
  return output_path


class Tokenizer:
  """A SentencePiece model plus the ids the trainer needs (EOD, pad)."""

  def __init__(self, model_bytes: bytes, path: str | None = None):
    self.path = path
    # Hash of the exact bytes loaded: it keys caches of text encoded with this model.
    self.fingerprint = hashlib.sha256(model_bytes).hexdigest()[:16]
    try:
      self._processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    except RuntimeError:  # SentencePiece's only word on it: "ParseFromArray" failed
      raise DataError(
        f'{path or "the tokenizer model"} is not a SentencePiece model; pass a '
        '.model file that SentencePiece wrote (a Hugging Face tokenizer.json goes '
        'to --tokenizer_json)'
      ) from None

  @classmethod
  def from_file(cls, path: str) -> Tokenizer:
    with open(path, 'rb') as f:
      return cls(f.read(), path=path)

  @classmethod
  def load_default(cls) -> Tokenizer:
    """The shipped model in `assets/tokenizer.model`."""
    return cls.from_file(DEFAULT_MODEL_PATH)

  @property
  def vocab_size(self) -> int:
    return self._processor.get_piece_size()

  @property
  def eod_id(self) -> int:
    return self._processor.eos_id()

  @property
  def pad_id(self) -> int:
    return self._processor.pad_id()

  @property
  def bos_id(self) -> int:
    return self._processor.bos_id()

  @property
  def unk_id(self) -> int:
    return self._processor.unk_id()

  def encode(self, text: str) -> list[int]:
    return self._processor.encode(text, out_type=int)

  def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
    """Encodes many texts in C++ worker threads (-1: one per core)."""
    return self._processor.encode(list(texts), out_type=int, num_threads=num_threads)

  def decode(self, ids: Iterable[int]) -> str:
    return self._processor.decode([int(i) for i in ids])

  def id_to_piece(self, token_id: int) -> str:
    return self._processor.id_to_piece(int(token_id))


def seqio_vocabulary(path: str = DEFAULT_MODEL_PATH):
  """The same model as a `seqio.SentencePieceVocabulary`, for seqio pipelines.

  Imported here and not at module level: seqio pulls in TensorFlow, which takes seconds to import
  and is not needed by the trainer's own data path.
  """
  from t5x_like.data import tf_runtime  # pylint: disable=import-outside-toplevel

  tf_runtime.import_tensorflow()  # quietly, before seqio does
  import seqio  # pylint: disable=import-outside-toplevel

  return seqio.SentencePieceVocabulary(path)


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.data.tokenizer',
    description='Rebuild the shipped tokenizer from the default corpus.',
  )
  parser.add_argument('--rebuild', action='store_true', help='train and write the model')
  parser.add_argument('--output', default=DEFAULT_MODEL_PATH, help='where to write the model')
  parser.add_argument('--vocab_size', type=int, default=DEFAULT_VOCAB_SIZE)
  args = parser.parse_args(argv)
  if not args.rebuild:
    parser.error('nothing to do: pass --rebuild')
  documents = corpus.default_documents()
  train_tokenizer(documents, args.output, args.vocab_size)
  tokenizer = Tokenizer.from_file(args.output)
  print(
    f'wrote {args.output}: vocab {tokenizer.vocab_size}, '
    f'{os.path.getsize(args.output)} bytes, sha256 prefix {tokenizer.fingerprint}, '
    f'corpus {corpus.corpus_fingerprint(documents)}'
  )


if __name__ == '__main__':
  main()


def load_tokenizer(tokenizer_json: str | None = None, tokenizer_model: str | None = None):
  """The tokenizer the inference tools read text with: a Hugging Face tokenizer.json (or the
  directory a tokenizer was saved to with `save_pretrained`), a SentencePiece model, or by
  default the shipped one. A bad path is a DataError."""
  from t5x_like.data.hf_tokenizer import HFTokenizer

  if tokenizer_json and tokenizer_model:
    raise DataError('pass one of --tokenizer_json and --tokenizer_model')
  if tokenizer_json:
    if os.path.isdir(tokenizer_json):
      tokenizer_json = os.path.join(tokenizer_json, 'tokenizer.json')
    return HFTokenizer(tokenizer_json)
  path = tokenizer_model or DEFAULT_MODEL_PATH
  if not os.path.isfile(path):
    raise DataError(f'--tokenizer_model {path!r} not found')
  return Tokenizer.from_file(path)
