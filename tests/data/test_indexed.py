"""Megatron's mmap indexed dataset: the exact bytes, reading back, and every kind of bad file."""

import os
import struct

import numpy as np
import pytest

from t5x_like.data import indexed
from t5x_like.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter

DOCUMENTS = [[5, 6, 7, 1], [8, 1], [], [9, 10, 11, 12, 13, 1]]


def megatron_bytes(sequences, doc_idx, code, dtype):
  """.idx and .bin as the facts file specifies them, written out by hand (little-endian)."""
  sizes = [len(s) for s in sequences]
  pointers = (
    np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) * np.dtype(dtype).itemsize
    if sequences
    else []
  )
  idx = b'MMIDIDX\x00\x00' + struct.pack('<Q', 1) + struct.pack('<B', code)
  idx += struct.pack('<Q', len(sizes)) + struct.pack('<Q', len(doc_idx))
  idx += b''.join(struct.pack('<i', s) for s in sizes)
  idx += b''.join(struct.pack('<q', int(p)) for p in pointers)
  idx += b''.join(struct.pack('<q', d) for d in doc_idx)
  data = b''.join(
    np.asarray(s, dtype=np.dtype(dtype).newbyteorder('<')).tobytes() for s in sequences
  )
  return idx, data


def write_raw(prefix, idx, data):
  with open(prefix + '.idx', 'wb') as f:
    f.write(idx)
  with open(prefix + '.bin', 'wb') as f:
    f.write(data)


def test_writer_produces_megatrons_bytes_and_reads_back(tmp_path):
  prefix = str(tmp_path / 'docs_text_document')
  with IndexedDatasetWriter(prefix, np.uint16) as writer:
    for doc in DOCUMENTS:
      writer.add_document(doc)
  idx, data = megatron_bytes(DOCUMENTS, list(range(len(DOCUMENTS) + 1)), code=8, dtype=np.uint16)
  assert open(prefix + '.idx', 'rb').read() == idx
  assert open(prefix + '.bin', 'rb').read() == data
  dataset = IndexedDataset(prefix)
  assert dataset.dtype == np.uint16 and dataset.num_documents == 4 and dataset.num_tokens == 12
  for i, doc in enumerate(DOCUMENTS):
    np.testing.assert_array_equal(dataset.document(i), doc)
  assert dataset.max_token_id() == 13
  assert not [f for f in os.listdir(tmp_path) if f.startswith('.tmp')]


@pytest.mark.parametrize('code, dtype', [(4, np.int32), (8, np.uint16)])
def test_reads_documents_of_several_sequences(tmp_path, code, dtype):
  """Megatron's BERT-style files split documents into sentences: doc_idx is not the identity."""
  sequences = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
  prefix = str(tmp_path / 'sentences')
  write_raw(prefix, *megatron_bytes(sequences, [0, 2, 3, 5], code, dtype))
  dataset = IndexedDataset(prefix)
  assert dataset.num_documents == 3
  np.testing.assert_array_equal(dataset.document_token_offsets(), [0, 3, 6, 9])
  np.testing.assert_array_equal(dataset.document(0), [1, 2, 3])
  np.testing.assert_array_equal(dataset.document(2), [7, 8, 9])


def test_best_dtype_follows_megatron():
  assert indexed.best_dtype(50257) == np.uint16 and indexed.best_dtype(250880) == np.int32


def test_a_failed_write_leaves_nothing_under_the_output_names(tmp_path):
  prefix = str(tmp_path / 'half')
  with pytest.raises(RuntimeError):
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
      writer.add_document([1, 2, 3])
      raise RuntimeError('tokenizer crashed')
  assert os.listdir(tmp_path) == []
  with pytest.raises(DataError, match='outside the range of uint16'):
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
      writer.add_document([70000])
  assert os.listdir(tmp_path) == []


def bad_files():
  good_idx, good_bin = megatron_bytes(DOCUMENTS, [0, 1, 2, 3, 4], 8, np.uint16)
  header = len(b'MMIDIDX\x00\x00') + 8 + 1 + 8 + 8
  float_idx = bytearray(good_idx)
  float_idx[len(b'MMIDIDX\x00\x00') + 8] = 7  # float32
  bad_doc_idx, _ = megatron_bytes(DOCUMENTS, [0, 2, 1, 3, 4], 8, np.uint16)
  return [
    ('magic', b'NOTANIDX!' + good_idx[9:], good_bin, 'not a Megatron mmap index'),
    ('version', good_idx[:9] + struct.pack('<Q', 2) + good_idx[17:], good_bin, 'index version 2'),
    ('float', bytes(float_idx), good_bin, 'holds no integer token ids'),
    ('truncated idx', good_idx[:-5], good_bin, 'truncated'),
    ('short header', good_idx[: header - 3], good_bin, 'not a Megatron mmap index'),
    ('truncated bin', good_idx, good_bin[:-2], 'mismatched or truncated'),
    ('doc order', bad_doc_idx, good_bin, 'never decrease'),
  ]


@pytest.mark.parametrize('case, idx, data, message', bad_files(), ids=[c[0] for c in bad_files()])
def test_bad_files_are_one_data_error_naming_the_file(tmp_path, case, idx, data, message):
  prefix = str(tmp_path / 'bad')
  write_raw(prefix, idx, data)
  with pytest.raises(DataError, match=message) as error:
    IndexedDataset(prefix)
  assert 'bad.' in str(error.value)


def test_missing_half_of_the_pair(tmp_path):
  prefix = str(tmp_path / 'only_bin')
  (tmp_path / 'only_bin.bin').write_bytes(b'\x00\x00')
  with pytest.raises(DataError, match=r'only_bin\.idx not found.*without the extension'):
    IndexedDataset(prefix)
