"""A run's sources from `data.*`: Megatron's data paths and split, blends, named validation sets."""

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
  return {'a': make_dataset(root / 'a_text_document', 1000),
          'b': make_dataset(root / 'b_text_document', 2000),
          'c': make_dataset(root / 'c_text_document', 3000, num_documents=10)}


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
  cfg = DataConfig(train_path=f"3 {datasets['a']} 1 {datasets['b']}", split='80,20,0',
                   valid_path=(('c_set', datasets['c']),))
  built = sources.build(cfg, SEQ, seed=5)
  train_ids = set(range(1000, 1040)) | set(range(2000, 2040))
  rows = built.train.rows(0, 400)
  assert document_ids(rows) <= train_ids
  # The mix: three samples of `a` for each of `b`, at every prefix.
  from_a = np.cumsum(rows[:, 0] < 2000)
  assert np.abs(from_a - 0.75 * np.arange(1, 401)).max() < 1.5
  assert set(built.valid) == {'valid', 'c_set'} and built.test is None
  assert document_ids(built.valid['valid'].rows(0, 50)) <= (
      set(range(1040, 1050)) | set(range(2040, 2050)))
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
    sources.build(DataConfig(train_path=f"1 {datasets['a']} 1 {datasets['c']}",
                             split='5,95,0'), SEQ, 0)
  with pytest.raises(DataError, match='fewer than one sample'):
    sources.build(DataConfig(train_path=datasets['c'], split='50,50,0'), 200, 0)


def test_token_ids_outside_the_vocabulary_are_named():
  sources.check_token_ids(np.array([[0, 7]]), 8, 'training samples 0..0')
  with pytest.raises(DataError, match=r'training samples 0\.\.0 holds token id 8.*\[0, 8\)'):
    sources.check_token_ids(np.array([[0, 8]]), 8, 'training samples 0..0')
