"""A run's sources from `data.*`: Megatron's data paths and split, blends, named validation sets."""

import os

import numpy as np
import pytest

from t5x_like.config import DataConfig
from t5x_like.data import sources
from t5x_like.data.indexed import DataError, IndexedDatasetWriter

SEQ = 8


def make_dataset(path, base, num_documents=50, length=20):
  """Document i is `length` copies of base + i, so every token says which document it is from."""
  with IndexedDatasetWriter(str(path), np.uint16) as writer:
    for i in range(num_documents):
      writer.add_document([base + i] * length)
  return str(path)


@pytest.fixture(scope='module')
def datasets(tmp_path_factory):
  root = tmp_path_factory.mktemp('datasets')
  return {
    'a': make_dataset(root / 'a_text_document', 1000),
    'b': make_dataset(root / 'b_text_document', 2000),
    'c': make_dataset(root / 'c_text_document', 3000, num_documents=10),
  }


def test_split_ranges_round_as_megatron():
  # Megatron: bounds from rounded cumulative shares, then every bound shifted by the excess.
  assert sources.split_ranges(733, '969,30,1') == [(0, 710), (710, 732), (732, 733)]
  assert sources.split_ranges(10, '1,1,1') == [(0, 4), (4, 7), (7, 10)]
  assert sources.split_ranges(10, '98/2') == [(0, 10), (10, 10), (10, 10)]
  for bad in ('', 'a,b', '1,2,3,4', '-1,2', '0,0,0'):
    with pytest.raises(DataError, match='data.split'):
      sources.parse_split(bad)


def test_data_path_syntax():
  assert sources.parse_data_path('/d/x') == [(1.0, '/d/x')]
  assert sources.parse_data_path(' 0.7 /d/x  0.3 /d/y') == [(0.7, '/d/x'), (0.3, '/d/y')]
  for bad in ('/d/x 0.5', '0.5 /d/x /d/y', 'x /d/x y /d/y', '0 /d/x 1 /d/y', 'nan /a 1 /b'):
    with pytest.raises(DataError, match='data.train_path'):
      sources.parse_data_path(bad)


def document_ids(rows):
  return set(np.unique(rows).tolist())


def test_blend_of_two_datasets_with_splits_and_a_named_validation_set(datasets):
  cfg = DataConfig(
    train_path=f'3 {datasets["a"]} 1 {datasets["b"]}',
    split='80,20,0',
    valid_path=(('c_set', datasets['c']),),
  )
  built = sources.build(cfg, SEQ, seed=5)
  train_ids = set(range(1000, 1040)) | set(range(2000, 2040))
  rows = built.train.rows(0, 400)
  assert document_ids(rows) <= train_ids
  # The mix: three samples of `a` for each of `b`, at every prefix.
  from_a = np.cumsum(rows[:, 0] < 2000)
  assert np.abs(from_a - 0.75 * np.arange(1, 401)).max() < 1.5
  assert set(built.valid) == {'valid', 'c_set'} and built.test is None
  assert document_ids(built.valid['valid'].rows(0, 50)) <= (
    set(range(1040, 1050)) | set(range(2040, 2050))
  )
  assert document_ids(built.valid['c_set'].rows(0, 20)) <= set(range(3000, 3010))
  assert len(built.notes) == 2
  assert 'documents per split: train 40, valid 10, test 0' in built.notes[0]
  # A pure function of (seed, index): a second build reads the same rows.
  again = sources.build(cfg, SEQ, seed=5)
  np.testing.assert_array_equal(again.train.rows(123, 160), built.train.rows(123, 160))
  assert not np.array_equal(sources.build(cfg, SEQ, seed=6).train.rows(0, 40), rows[:40])


def test_bad_sources_are_one_data_error(datasets, tmp_path):
  with pytest.raises(DataError, match=r'nope_text_document\.idx not found'):
    sources.build(DataConfig(train_path=str(tmp_path / 'nope_text_document')), SEQ, 0)
  with pytest.raises(DataError, match='leaves some dataset without training documents'):
    # 10 documents: 5% rounds to none of them.
    sources.build(
      DataConfig(train_path=f'1 {datasets["a"]} 1 {datasets["c"]}', split='5,95,0'), SEQ, 0
    )
  with pytest.raises(DataError, match='fewer than one sample'):
    sources.build(DataConfig(train_path=datasets['c'], split='50,50,0'), 200, 0)


def test_token_ids_outside_the_vocabulary_are_named():
  sources.check_token_ids(np.array([[0, 7]]), 8, 'training samples 0..0')
  with pytest.raises(DataError, match=r'training samples 0\.\.0 holds token id 8.*\[0, 8\)'):
    sources.check_token_ids(np.array([[0, 8]]), 8, 'training samples 0..0')


def megatron_parse(values):
  """Megatron-DeepSpeed's parse_data_paths (arguments.py) on --*-weighted-split-paths values:
  (names, weights, splits, paths), the reference our parser must agree with."""
  names = [v.split(':')[0] for v in values]
  prefixes = [':'.join(v.split(':')[1:]).strip() for v in values]
  weights = [[d.split()[0] for d in p.split(',')] for p in prefixes]
  splits = [[d.split()[1] for d in p.split(',')] for p in prefixes]
  paths = [[d.split()[2] for d in p.split(',')] for p in prefixes]
  return names, weights, splits, paths


def megatron_split_by_range(range_string, size):
  """Megatron-DeepSpeed's get_split_by_range_ (megatron/data/dataset_utils.py)."""
  splits = [float(i) for i in range_string.split(':')]
  return [round(s * float(size)) for s in splits]


def test_tr11_weighted_split_paths_parse_into_megatrons_datasets_and_ranges():
  from conftest import REPO

  from t5x_like.config import load_config_file

  cfg = load_config_file(f'{REPO}/configs/bloom_176b.py')
  d = cfg.data
  assert (d.train_path, d.test_weighted_split_paths) == ('', ())
  for role, values in (
    ('train', d.train_weighted_split_paths),
    ('valid', d.valid_weighted_split_paths),
  ):
    ours = sources.weighted_split_groups(d, role)
    names, weights, splits, paths = megatron_parse(values)
    assert [name for name, _ in ours] == names
    assert [[e.weight for e in entries] for _, entries in ours] == [
      [float(w) for w in group] for group in weights
    ]
    assert [[f'{e.start}:{e.end}' for e in entries] for _, entries in ours] == [
      [':'.join(str(float(x)) for x in s.split(':')) for s in group] for group in splits
    ]
    assert [[e.prefix for e in entries] for _, entries in ours] == paths
  # tr11: one training group of 28 datasets, 0:0.950 each, by catalogue weight; 29 validation
  # sets (the same blend as 'valid', then each dataset alone), 0.950:1.0; no test set.
  ((name, train),) = sources.weighted_split_groups(d, 'train')
  assert name == 'train' and len(train) == 28
  assert {(e.start, e.end) for e in train} == {(0.0, 0.95)}
  assert abs(sum(e.weight for e in train) - 1) < 1e-12
  by_name = {e.prefix.split('/')[0]: e.weight for e in train}
  assert by_name['en'] == 0.22171164529099704 and by_name['indic-as'] == 0.00011021422347108609
  assert train[0].prefix == (
    'ar/bigscience-catalogue-data-dev_byte-level-bpe-tokenizer-no-norm-'
    '250k-whitespace-and-eos-regex-alpha-v3-dedup-lines-articles_ar_'
    'text_document'
  )
  valid = sources.weighted_split_groups(d, 'valid')
  assert [n for n, _ in valid] == ['valid'] + [f'valid_{p}' for p in by_name]
  assert all((e.start, e.end) == (0.95, 1.0) for _, entries in valid for e in entries)
  assert [e.prefix for e in valid[0][1]] == [e.prefix for e in train]
  assert [(e.weight, e.prefix) for _, (e,) in valid[1:]] == [(1.0, e.prefix) for e in train]
  # The documents each range selects: Megatron's rounding (Python's round, half to even).
  for size in (1, 7, 10, 19, 20, 30, 50, 733, 1001, 999_999, 123_456_789):
    for span in ('0:0.950', '0.950:1.0', '0:1', '0.25:0.75'):
      start, end = (float(x) for x in span.split(':'))
      assert list(sources.range_documents(size, start, end)) == megatron_split_by_range(span, size)
  assert sources.range_documents(1000, 0.0, 0.95) == (0, 950)
  assert sources.range_documents(30, 0.95, 1.0) == (28, 30)  # 28.5 rounds to even


def test_weighted_split_paths_build_named_sets_from_document_ranges(datasets, tmp_path):
  root = os.path.dirname(datasets['a'])
  cfg = DataConfig(
    train_weighted_split_paths='train: 3 0:0.8 a_text_document, 1 0:0.8 b_text_document',
    valid_weighted_split_paths=(
      'valid: 1 0.8:1 a_text_document, 1 0.8:1.0 b_text_document',
      f'valid_c: 1 0.5:1.0 {datasets["c"]}',
    ),  # an absolute prefix ignores data.root
    root=root,
  )
  built = sources.build(cfg, SEQ, seed=5)
  rows = built.train.rows(0, 400)
  assert document_ids(rows) <= set(range(1000, 1040)) | set(range(2000, 2040))
  from_a = np.cumsum(rows[:, 0] < 2000)
  assert np.abs(from_a - 0.75 * np.arange(1, 401)).max() < 1.5
  assert list(built.valid) == ['valid', 'valid_c'] and built.test is None
  assert document_ids(built.valid['valid'].rows(0, 50)) <= (
    set(range(1040, 1050)) | set(range(2040, 2050))
  )
  assert document_ids(built.valid['valid_c'].rows(0, 10)) <= set(range(3005, 3010))
  assert built.train_names == [
    os.path.join(root, 'a_text_document'),
    os.path.join(root, 'b_text_document'),
  ]
  assert "train group 'train'" in built.notes[0] and 'documents 0..40 of 50' in built.notes[0]
  # A pure function of (seed, index), and not the stream of data.train_path's blend.
  again = sources.build(cfg, SEQ, seed=5)
  np.testing.assert_array_equal(again.train.rows(77, 99), rows[77:99])
  # The files are checked when opened: a missing prefix or a range of no document.
  with pytest.raises(DataError, match=r'nope_text_document\.idx not found'):
    sources.build(
      DataConfig(train_weighted_split_paths='train: 1 0:1 nope_text_document', root=root), SEQ, 0
    )
  with pytest.raises(DataError, match=r"group 'train': the range 0:0.01 .* rounds to no document"):
    sources.build(DataConfig(train_weighted_split_paths=f'train: 1 0:0.01 {datasets["c"]}'), SEQ, 0)
  with pytest.raises(DataError, match="data.root='.*missing' is not a directory"):
    sources.build(
      DataConfig(
        train_weighted_split_paths='train: 1 0:1 a_text_document', root=str(tmp_path / 'missing')
      ),
      SEQ,
      0,
    )
