"""Hugging Face `tokenizer.json` files (BLOOM's, GPT-2's, ...) for `preprocess` and `generate`.

BLOOM's tokenizer is a byte-level BPE of 250,680 tokens published as a `tokenizers` JSON file,
not a SentencePiece model; Megatron-DeepSpeed's `tools/preprocess_data.py --tokenizer-type
PretrainedFromHF` tokenized tr11's corpus with it. This wrapper gives `preprocess` the same three
things the shipped SentencePiece tokenizer gives it: `vocab_size`, `eod_id`, `encode_batch`.

Documents are encoded without the file's special-token template (`add_special_tokens=False`):
the only token added is the end-of-document id, which `preprocess` appends itself. The
tokenizer's own vocabulary size (its added tokens included) decides the dtype of the .bin; the
model's `vocab_size` may be padded above it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from t5x_like.data.indexed import DataError

# End-of-document tokens looked for when --eod_token is not given, in this order.
EOD_CANDIDATES = ('</s>', '<|endoftext|>', '<eos>', '<|end_of_text|>')


class HFTokenizer:
  """A `tokenizers.Tokenizer` loaded from a tokenizer.json, with its end-of-document id."""

  def __init__(self, path: str, eod_token: str | None = None):
    if not os.path.isfile(path):
      raise DataError(
        f'--tokenizer_json {path!r} not found; pass the tokenizer.json of a '
        "Hugging Face tokenizer (e.g. BLOOM's)"
      )
    try:
      import tokenizers
    except ImportError:
      raise DataError(
        '--tokenizer_json needs the `tokenizers` package: pip install tokenizers'
      ) from None
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a bare Exception for malformed files.
      raise DataError(f'--tokenizer_json {path!r} is not a tokenizers JSON file ({e})') from None
    self.path = path
    vocab = self._tokenizer.get_vocab(with_added_tokens=True)
    names = (eod_token,) if eod_token else EOD_CANDIDATES
    found = [name for name in names if name in vocab]
    if not found:
      what = (
        f'has no token --eod_token {eod_token!r}'
        if eod_token
        else f'has none of the usual end-of-document tokens {list(EOD_CANDIDATES)}'
      )
      raise DataError(
        f'--tokenizer_json {path!r} {what}; pass a token of its vocabulary that '
        'ends a document with --eod_token'
      )
    self.eod_token = found[0]
    self.eod_id = vocab[self.eod_token]
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    # The ids a model's config names (BLOOM's: <s> 1, </s> 2, <pad> 3); None where absent.
    self.bos_id: int | None = vocab.get('<s>')
    self.pad_id: int | None = vocab.get('<pad>')

  def encode(self, text: str) -> list[int]:
    return self._tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
    """Encodes many texts in the library's worker threads."""
    return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]
