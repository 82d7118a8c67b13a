"""`python -m t5x_like.data preprocess | inspect`, run as a user runs them."""

import json
import os

import numpy as np
from conftest import run_cli

from t5x_like.data.indexed import IndexedDataset
from t5x_like.data.tokenizer import Tokenizer

TEXTS = ['The quick brown fox.', 'Ünïcode and\nnew lines\tand tabs.', '']


def write_jsonl(path, texts, key='text'):
  with open(path, 'w', encoding='utf-8') as f:
    for text in texts:
      f.write(json.dumps({key: text, 'meta': 1}) + '\n')


def test_preprocess_then_inspect(tmp_path):
  write_jsonl(tmp_path / 'a.jsonl', TEXTS[:2])
  (tmp_path / 'c.txt').write_text(TEXTS[1] + ' A whole file is one document.')
  prefix = str(tmp_path / 'out' / 'mix_text_document')
  r = run_cli(
    [
      '-m',
      't5x_like.data',
      'preprocess',
      '--input',
      str(tmp_path / 'a.jsonl'),
      str(tmp_path / 'c.txt'),
      '--output_prefix',
      prefix,
    ]
  )
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

  r = run_cli(
    [
      '-m',
      't5x_like.data',
      'inspect',
      prefix,
      '--split',
      '2,1,0',
      '--seq_len',
      '4',
      '--scan',
      '--json',
    ]
  )
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
    (['--input', str(tmp_path / 'good.jsonl'), '--tokenizer_model', 'nope.model'], 'nope.model'),
  ]
  for args, message in cases:
    r = run_cli(['-m', 't5x_like.data', 'preprocess', *args, '--output_prefix', prefix])
    assert r.returncode == 2 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert not out.exists() or os.listdir(out) == []

  # An existing dataset is never replaced without --overwrite.
  r = run_cli(
    [
      '-m',
      't5x_like.data',
      'preprocess',
      '--input',
      str(tmp_path / 'good.jsonl'),
      '--output_prefix',
      prefix,
    ]
  )
  assert r.returncode == 0, r.stderr
  before = open(prefix + '.bin', 'rb').read()
  write_jsonl(tmp_path / 'new.jsonl', ['different text'])
  args = [
    '-m',
    't5x_like.data',
    'preprocess',
    '--input',
    str(tmp_path / 'new.jsonl'),
    '--output_prefix',
    prefix,
  ]
  r = run_cli(args)
  assert r.returncode == 2 and 'already exist' in r.stderr
  assert open(prefix + '.bin', 'rb').read() == before
  assert run_cli(args + ['--overwrite']).returncode == 0
  assert IndexedDataset(prefix).num_documents == 1

  r = run_cli(['-m', 't5x_like.data', 'inspect', str(tmp_path / 'nothing')])
  assert r.returncode == 2 and 'nothing.idx not found' in r.stderr


def test_preprocess_skips_empty_texts_as_megatron_does(tmp_path, caplog):
  """Megatron's preprocess_data.py writes no document for a text without tokens; a lone EOD
  would add a document and move every split boundary of the same JSONL."""
  from t5x_like.cli import data as cli

  write_jsonl(tmp_path / 'a.jsonl', ['first text', '', 'second text', ''])
  prefix = str(tmp_path / 'a_text_document')
  tokenizer = Tokenizer.load_default()
  with caplog.at_level('WARNING'):
    summary = cli.preprocess([str(tmp_path / 'a.jsonl')], prefix, tokenizer)
  assert (summary['documents'], summary['empty_skipped']) == (2, 2)
  assert 'skipped 2 empty document(s)' in caplog.text
  dataset = IndexedDataset(prefix)
  assert dataset.num_documents == 2 and summary['tokens'] == dataset.num_tokens
  for i, text in enumerate(['first text', 'second text']):
    assert tokenizer.decode(dataset.document(i)[:-1]) == text


def byte_level_bpe(path, extra_tokens=0):
  """A small byte-level BPE in tokenizers' JSON format, the kind BLOOM's tokenizer is."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tokenizer = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400,
    special_tokens=['<unk>', '<s>', '</s>', '<pad>'],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tokenizer.train_from_iterator(TEXTS * 20 + ['fox and lines and tabs'] * 20, trainer)
  if extra_tokens:
    tokenizer.add_tokens([f'<extra_{i}>' for i in range(extra_tokens)])
  tokenizer.save(str(path))
  return str(path)


def test_preprocess_with_a_hugging_face_tokenizer_json_matches_transformers(tmp_path):
  import transformers

  from t5x_like.cli import data as cli

  write_jsonl(tmp_path / 'a.jsonl', TEXTS)
  tokenizer_json = byte_level_bpe(tmp_path / 'tokenizer.json')
  prefix = str(tmp_path / 'hf_text_document')
  assert (
    cli.main(
      [
        'preprocess',
        '--input',
        str(tmp_path / 'a.jsonl'),
        '--output_prefix',
        prefix,
        '--tokenizer_json',
        tokenizer_json,
      ]
    )
    == 0
  )
  # The reference: transformers' fast tokenizer on the same file, as Megatron-DeepSpeed's
  # PretrainedFromHF tokenizer encodes, plus the EOD id of '</s>'.
  reference = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)
  eod = reference.convert_tokens_to_ids('</s>')
  dataset = IndexedDataset(prefix)
  texts = [text for text in TEXTS if text]  # the empty text is skipped, as Megatron skips it
  assert dataset.num_documents == len(texts) and dataset.dtype == np.uint16
  for i, text in enumerate(texts):
    want = reference(text, add_special_tokens=False)['input_ids'] + [eod]
    assert dataset.document(i).tolist() == want
    assert reference.decode(want[:-1]) == text

  # BLOOM's 250,680 tokens do not fit uint16: ids are written as int32, as Megatron writes them.
  wide_json = byte_level_bpe(tmp_path / 'wide.json', extra_tokens=66_000)
  wide = str(tmp_path / 'wide_text_document')
  assert (
    cli.main(
      [
        'preprocess',
        '--input',
        str(tmp_path / 'a.jsonl'),
        '--output_prefix',
        wide,
        '--tokenizer_json',
        wide_json,
        '--eod_token',
        '<extra_65999>',
      ]
    )
    == 0
  )
  dataset = IndexedDataset(wide)
  assert dataset.dtype == np.int32 and dataset.document(0)[-1] > 65_500

  # Bad input: one message, exit 2, nothing written.
  bad = str(tmp_path / 'bad_text_document')
  for flags in (
    ['--tokenizer_json', str(tmp_path / 'missing.json')],
    ['--tokenizer_json', tokenizer_json, '--eod_token', '<|endoftext|>'],
    ['--tokenizer_json', str(tmp_path / 'a.jsonl')],
    ['--eod_token', '</s>'],
  ):
    assert (
      cli.main(['preprocess', '--input', str(tmp_path / 'a.jsonl'), '--output_prefix', bad, *flags])
      == 2
    )
  assert not any(name.startswith('bad') for name in os.listdir(tmp_path))
