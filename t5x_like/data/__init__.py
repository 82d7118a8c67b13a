"""Training data: the default corpus, its tokenizer, and the index-addressable sample stream.

Typical use:

    tokenizer, source = t5x_like.data.load_default(seq_len=512, seed=0)
    batch = source.batch(consumed_samples, global_batch_size)  # int32 [gbs, seq_len + 1]

Exports resolve lazily (PEP 562) so that `python -m t5x_like.data.tokenizer` does not import the
module it is about to run, and so that importing the package costs nothing until used.

Layer 1: imports config.py, errors.py and files.py only (a clean layer: the batches of the
training loop and the replay of an iteration live in training/).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
  'Tokenizer': 'tokenizer',
  'default_documents': 'corpus',
  'corpus_fingerprint': 'corpus',
  'corpus_tokens': 'dataset',
  'SampleSource': 'dataset',
  'load_default': 'dataset',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
  globals()[name] = value  # Later lookups skip __getattr__.
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})
