"""`python -m t5x_like.data preprocess | inspect`, run as a user runs them."""

import json
import os

import numpy as np

from t5x_like.data.indexed import IndexedDataset
from t5x_like.data.tokenizer import Tokenizer

from conftest import run_cli

TEXTS = ['The quick brown fox.', 'Ünïcode and\nnew lines\tand tabs.', '']


def write_jsonl(path, texts, key='text'):
  with open(path, 'w', encoding='utf-8') as f:
    for text in texts:
      f.write(json.dumps({key: text, 'meta': 1}) + '\n')


def test_preprocess_then_inspect(tmp_path):
  write_jsonl(tmp_path / 'a.jsonl', TEXTS[:2])
  (tmp_path / 'c.txt').write_text(TEXTS[1] + ' A whole file is one document.')
  prefix = str(tmp_path / 'out' / 'mix_text_document')
  r = run_cli(['-m', 't5x_like.data', 'preprocess', '--input', str(tmp_path / 'a.jsonl'),
               str(tmp_path / 'c.txt'), '--output_prefix', prefix])
  assert r.returncode == 0, r.stderr
  summary = json.loads(r.stdout)
  assert summary['documents'] == 3 and summary['dtype'] == 'uint16' and summary['eod_id'] == 1
  tokenizer = Tokenizer.load_default()
  dataset = IndexedDataset(prefix)
  texts = TEXTS[:2] + [TEXTS[1] + ' A whole file is one document.']
  for i, text in enumerate(texts):
    ids = dataset.document(i)
    assert ids[-1] == tokenizer.eod_id
    assert tokenizer.decode(ids[:-1]) == text
  assert summary['tokens'] == dataset.num_tokens

  r = run_cli(['-m', 't5x_like.data', 'inspect', prefix, '--split', '2,1,0', '--seq_len', '4',
               '--scan', '--json'])
  assert r.returncode == 0, r.stderr
  report = json.loads(r.stdout)
  assert report['documents'] == 3 and report['tokens'] == dataset.num_tokens
  assert report['splits']['train']['documents'] == [0, 2]
  assert report['splits']['valid']['documents'] == [2, 3]
  assert report['max_token_id'] == int(np.max(dataset.tokens))
  r = run_cli(['-m', 't5x_like.data', 'inspect', prefix])
  assert r.returncode == 0 and '3 documents' in r.stdout and 'train' in r.stdout


def test_bad_input_is_exit_2_and_writes_nothing(tmp_path):
  write_jsonl(tmp_path / 'good.jsonl', TEXTS)
  (tmp_path / 'broken.jsonl').write_text('{"text": "fine"}\n{"text": unquoted}\n')
  write_jsonl(tmp_path / 'other_key.jsonl', TEXTS, key='content')
  out = tmp_path / 'out'
  prefix = str(out / 'x')
  cases = [
      (['--input', str(tmp_path / 'broken.jsonl')], 'broken.jsonl:2: not a JSON object'),
      (['--input', str(tmp_path / 'other_key.jsonl')], "no string under the key 'text'"),
      (['--input', str(tmp_path / 'missing.jsonl')], 'not found'),
      (['--input', str(tmp_path / 'good.jsonl'), '--tokenizer_model', 'nope.model'],
       'nope.model'),
  ]
  for args, message in cases:
    r = run_cli(['-m', 't5x_like.data', 'preprocess', *args, '--output_prefix', prefix])
    assert r.returncode == 2 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert not out.exists() or os.listdir(out) == []

  # An existing dataset is never replaced without --overwrite.
  r = run_cli(['-m', 't5x_like.data', 'preprocess', '--input', str(tmp_path / 'good.jsonl'),
               '--output_prefix', prefix])
  assert r.returncode == 0, r.stderr
  before = open(prefix + '.bin', 'rb').read()
  write_jsonl(tmp_path / 'new.jsonl', ['different text'])
  args = ['-m', 't5x_like.data', 'preprocess', '--input', str(tmp_path / 'new.jsonl'),
          '--output_prefix', prefix]
  r = run_cli(args)
  assert r.returncode == 2 and 'already exist' in r.stderr
  assert open(prefix + '.bin', 'rb').read() == before
  assert run_cli(args + ['--overwrite']).returncode == 0
  assert IndexedDataset(prefix).num_documents == 1

  r = run_cli(['-m', 't5x_like.data', 'inspect', str(tmp_path / 'nothing')])
  assert r.returncode == 2 and 'nothing.idx not found' in r.stderr
