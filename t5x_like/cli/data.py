"""`python -m t5x_like.data`: make and inspect Megatron mmap datasets.

  python -m t5x_like.data preprocess --input docs.jsonl [more ...] --output_prefix DIR/NAME
      [--json_key text] [--tokenizer_model FILE.model | --tokenizer_json tokenizer.json
      [--eod_token '</s>']] [--no_eod] [--overwrite]
  python -m t5x_like.data inspect DIR/NAME [--split 969,30,1] [--seq_len 2048] [--scan] [--json]
  python -m t5x_like.data batch WORKDIR --iteration N [--tokenizer_json F | --tokenizer_model F]
      [--max_tokens K] [--json]
  python -m t5x_like.data prepare --mixture_or_task NAME [--mixture_or_task_module M]
      [--cache_dir DIR]

`preprocess` reads loose JSON (one object per line, the text under --json_key: the input of
Megatron's tools/preprocess_data.py) or, for any other extension, one document per file; it
tokenizes with a SentencePiece model (default: the shipped one) or a Hugging Face tokenizer.json
(BLOOM's: `hf_tokenizer.py`), skips documents without tokens (an empty text; Megatron does too,
and logs how many), appends the end-of-document id and writes DIR/NAME.bin and DIR/NAME.idx
(`indexed.py`), which `data.train_path` then names.
`inspect` prints what a dataset holds and how `data.split` cuts it; `--scan` also reads every
token for the largest id (compare it with model.vocab_size).
`batch` rebuilds the global batch a run trained on at iteration N (`replay.py`): each sample's
global index, dataset, token ids and text, and the override that skips it on the next restart.
`prepare` materialises a seqio Task or Mixture (`data.mixture_or_task`) into the cache that
training reads (`materialize.py`) ahead of the run, and prints one JSON line per split.

Exit codes: 0 done, 2 bad input (one message naming the file and the fix; nothing is written).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from t5x_like.data import indexed, sources
from t5x_like.data.hf_tokenizer import EOD_CANDIDATES, HFTokenizer
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import DEFAULT_MODEL_PATH, Tokenizer
from t5x_like.errors import ConfigError
from t5x_like.files import check_writable

BAD_INPUT = 2
_BATCH_DOCUMENTS = 1024  # documents per multi-threaded encode call


def read_documents(paths: Sequence[str], json_key: str) -> Iterator[str]:
  """The documents of every input in order: JSON lines (.jsonl/.json) or whole text files."""
  for path in paths:
    if not os.path.isfile(path):
      raise DataError(f'input {path!r} not found')
    if path.endswith(('.jsonl', '.json')):
      with open(path, 'rb') as f:
        for number, raw_line in enumerate(f, 1):
          line = _decoded(raw_line, path, number)
          if not line.strip():
            continue
          try:
            record = json.loads(line)
          except json.JSONDecodeError as e:
            raise DataError(
              f'{path}:{number}: not a JSON object ({e.msg}); the input has one '
              'JSON object per line'
            ) from None
          text = record.get(json_key) if isinstance(record, dict) else None
          if not isinstance(text, str):
            raise DataError(
              f'{path}:{number}: no string under the key {json_key!r}; pass the '
              'key that holds the text with --json_key'
            )
          yield text
    else:
      with open(path, 'rb') as f:
        data = f.read()
      try:
        yield data.decode('utf-8')
      except UnicodeDecodeError as e:
        number = data.count(b'\n', 0, e.start) + 1
        raise _not_utf8(path, number, e) from None


def _not_utf8(path: str, number: int, error: UnicodeDecodeError) -> DataError:
  return DataError(
    f'{path}:{number}: not UTF-8 text ({error.reason} at byte '
    f'{error.object[error.start : error.start + 1]!r}); convert the file to UTF-8, '
    'e.g. iconv -f latin1 -t utf-8'
  )


def _decoded(raw_line: bytes, path: str, number: int) -> str:
  try:
    return raw_line.decode('utf-8')
  except UnicodeDecodeError as e:
    raise _not_utf8(path, number, e) from None


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
  batch = []
  for document in documents:
    batch.append(document)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def preprocess(
  inputs: Sequence[str],
  output_prefix: str,
  tokenizer: Tokenizer | HFTokenizer,
  json_key: str = 'text',
  append_eod: bool = True,
  overwrite: bool = False,
) -> dict:
  """Tokenizes `inputs` into output_prefix.bin/.idx; returns counts. Existing outputs are kept
  unless `overwrite`; on any error nothing is written under the output names."""
  if indexed.exists(output_prefix) and not overwrite:
    raise DataError(
      f'{output_prefix}.bin and .idx already exist; pass --overwrite to replace them '
      'or choose another --output_prefix'
    )
  for path in inputs:
    if os.path.isdir(path):
      raise DataError(
        f'input {path!r} is a directory; pass its files (JSON lines or text), e.g. '
        f'--input {os.path.join(path, "*.jsonl")}'
      )
  try:
    check_writable(
      os.path.dirname(os.path.abspath(output_prefix)),
      f'--output_prefix {output_prefix}: its directory',
      'choose an --output_prefix in a directory you can write to',
    )
  except ConfigError as e:
    raise DataError(str(e)) from None
  dtype = indexed.best_dtype(tokenizer.vocab_size)
  start = time.perf_counter()
  encoded = (
    ids + [tokenizer.eod_id] if ids and append_eod else ids
    for batch in _batches(read_documents(inputs, json_key), _BATCH_DOCUMENTS)
    for ids in tokenizer.encode_batch(batch)
  )
  documents, tokens, empty = indexed.write_documents(
    output_prefix,
    dtype,
    encoded,
    ', '.join(inputs),
    'check --input and --json_key',
    'free some space or choose another --output_prefix',
  )
  if empty:
    logging.warning(
      "preprocess: skipped %d empty document(s) (no tokens), as Megatron's "
      'preprocess_data.py does; %d written',
      empty,
      documents,
    )
  return {
    'output_prefix': output_prefix,
    'documents': documents,
    'empty_skipped': empty,
    'tokens': tokens,
    'dtype': dtype.name,
    'vocab_size': tokenizer.vocab_size,
    'eod_id': tokenizer.eod_id if append_eod else None,
    'seconds': round(time.perf_counter() - start, 3),
  }


def inspect(prefix: str, split: str = '969,30,1', seq_len: int = 2048, scan: bool = False) -> dict:
  """What a dataset holds, and the documents, tokens and samples of each split."""
  dataset = indexed.IndexedDataset(prefix)
  offsets = dataset.document_token_offsets()
  report: dict[str, Any] = {
    'prefix': prefix,
    'dtype': dataset.dtype.name,
    'documents': dataset.num_documents,
    'sequences': len(dataset.sizes),
    'tokens': int(offsets[-1]),
    'bytes': int(offsets[-1]) * dataset.dtype.itemsize,
    'split': split,
    'seq_len': seq_len,
    'splits': {},
  }
  for name, (first, last) in zip(
    sources.SPLIT_NAMES, sources.split_ranges(dataset.num_documents, split)
  ):
    count = int(offsets[last] - offsets[first])
    report['splits'][name] = {
      'documents': [first, last],
      'tokens': count,
      'samples_per_epoch': max(count - 1, 0) // seq_len,
    }
  if scan:
    report['max_token_id'] = dataset.max_token_id()
  return report


def _print_inspect(report: dict) -> None:
  print(
    f'{report["prefix"]}: {report["documents"]:,} documents, {report["tokens"]:,} tokens '
    f'({report["dtype"]}, {report["bytes"] / 2**20:.1f} MiB)'
  )
  if 'max_token_id' in report:
    print(f'largest token id: {report["max_token_id"]} (needs model.vocab_size > it)')
  print(f'split {report["split"]!r}, samples of seq_len {report["seq_len"]} + 1 tokens:')
  for name, s in report['splits'].items():
    first, last = s['documents']
    print(
      f'  {name:5s}  documents {first:>10,}..{last:<10,}  tokens {s["tokens"]:>14,}  '
      f'samples per epoch {s["samples_per_epoch"]:>12,}'
    )


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.data',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  commands = parser.add_subparsers(dest='command', required=True)
  make = commands.add_parser('preprocess', help='text -> PREFIX.bin/.idx')
  make.add_argument('--input', nargs='+', required=True, help='.jsonl files or text files')
  make.add_argument('--output_prefix', required=True, help='writes PREFIX.bin and PREFIX.idx')
  make.add_argument('--json_key', default='text', help='the key of the text in JSON lines')
  which = make.add_mutually_exclusive_group()
  which.add_argument(
    '--tokenizer_model',
    default=DEFAULT_MODEL_PATH,
    help='a SentencePiece .model file (default: the shipped tokenizer)',
  )
  which.add_argument(
    '--tokenizer_json', default=None, help="a Hugging Face tokenizer.json (BLOOM's, GPT-2's)"
  )
  make.add_argument(
    '--eod_token',
    default=None,
    help='with --tokenizer_json: the token appended to each document (default: '
    'the first of ' + ', '.join(EOD_CANDIDATES) + ' in the vocabulary)',
  )
  make.add_argument('--no_eod', action='store_true', help='do not append the EOD id')
  make.add_argument('--overwrite', action='store_true', help='replace an existing dataset')
  look = commands.add_parser('inspect', help='what a dataset holds and how it splits')
  look.add_argument('prefix')
  look.add_argument('--split', default='969,30,1', help="Megatron's --split (data.split)")
  look.add_argument('--seq_len', type=int, default=2048)
  look.add_argument('--scan', action='store_true', help='read every token for the largest id')
  look.add_argument('--json', action='store_true', help='print one JSON object')
  show = commands.add_parser('batch', help='the samples one iteration of a run trained on')
  show.add_argument('workdir', help="the run's workdir (its config.json and checkpoints)")
  show.add_argument('--iteration', type=int, required=True, help='1-based, as in the log')
  decode = show.add_mutually_exclusive_group()
  decode.add_argument(
    '--tokenizer_json', default=None, help='decode with this Hugging Face tokenizer.json'
  )
  decode.add_argument(
    '--tokenizer_model',
    default=None,
    help='decode with this SentencePiece .model (the embedded corpus needs none)',
  )
  show.add_argument(
    '--max_tokens',
    type=int,
    default=0,
    help='show at most this many tokens of each sample (0: all)',
  )
  show.add_argument('--json', action='store_true', help='print one JSON object')
  ready = commands.add_parser('prepare', help='materialise a seqio Task or Mixture ahead of a run')
  ready.add_argument('--mixture_or_task', required=True, help='data.mixture_or_task')
  ready.add_argument(
    '--mixture_or_task_module',
    default='',
    help='data.mixture_or_task_module: the module that registers it',
  )
  ready.add_argument(
    '--cache_dir', default='', help='data.cache_dir (default: $T5X_LIKE_CACHE or ~/.cache/t5x_like)'
  )
  args = parser.parse_args(argv)
  try:
    if args.command == 'batch':
      from t5x_like.training import replay

      if args.max_tokens < 0:
        raise DataError(f'--max_tokens must be >= 0, got {args.max_tokens}')
      cfg, data_seed = replay.run_config(args.workdir, args.iteration)
      batch = replay.iteration_batch(
        cfg, data_seed, args.iteration, replay.recorded_position(args.workdir, args.iteration)
      )
      result = replay.report(
        batch, replay.decoder(cfg, args.tokenizer_json, args.tokenizer_model), args.max_tokens
      )
      if args.json:
        print(json.dumps(result))
      else:
        replay.print_report(result)
    elif args.command == 'prepare':
      from t5x_like.data import materialize  # seqio and TensorFlow: only for this command

      for task in materialize.prepare(
        args.mixture_or_task, args.mixture_or_task_module, args.cache_dir
      ):
        for entry in filter(None, (task.train, *task.valid.values())):
          print(
            json.dumps(
              {
                'task': entry.task,
                'split': entry.split,
                'rate': task.rate,
                'prefix': entry.prefix,
                'documents': entry.documents,
                'tokens': entry.tokens,
                'built': entry.built,
              }
            )
          )
    elif args.command == 'preprocess':
      tokenizer: Tokenizer | HFTokenizer
      if args.tokenizer_json:
        tokenizer = HFTokenizer(args.tokenizer_json, args.eod_token)
      elif args.eod_token:
        raise DataError(
          '--eod_token applies to --tokenizer_json; a SentencePiece model ends '
          'documents with its own </s> id'
        )
      elif not os.path.isfile(args.tokenizer_model):
        raise DataError(f'--tokenizer_model {args.tokenizer_model!r} not found')
      else:
        tokenizer = Tokenizer.from_file(args.tokenizer_model)
      print(
        json.dumps(
          preprocess(
            args.input,
            args.output_prefix,
            tokenizer,
            args.json_key,
            not args.no_eod,
            args.overwrite,
          )
        )
      )
    else:
      if args.seq_len < 1:
        raise DataError(f'--seq_len must be >= 1, got {args.seq_len}')
      report = inspect(args.prefix, args.split, args.seq_len, args.scan)
      print(json.dumps(report)) if args.json else _print_inspect(report)
  except (DataError, OSError, UnicodeDecodeError) as e:
    print(f'error: {e}', file=sys.stderr)
    return BAD_INPUT
  return 0


if __name__ == '__main__':
  sys.exit(main())
