"""Megatron's memory-mapped indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and written.

The format, byte for byte as Megatron-DeepSpeed writes it (`MMapIndexedDataset`), little-endian:

* `PREFIX.bin`: the token ids of every document back to back (the end-of-document id included
  where the preprocessing appended it), in the index's dtype;
* `PREFIX.idx`: magic `b"MMIDIDX\\x00\\x00"`, uint64 version (1), uint8 dtype code, uint64 number
  of sequences N, uint64 number of document boundaries D, then int32 sizes[N] (tokens per
  sequence), int64 pointers[N] (byte offset of each sequence in the .bin) and int64 doc_idx[D]
  (the first sequence of each document, then N: D is the number of documents + 1).

Files made by Megatron's `tools/preprocess_data.py` (one sequence per document for GPT data) and by
`python -m t5x_like.data preprocess` are interchangeable. Reading maps both files; nothing is
loaded into memory until a sample asks for it, and nothing is unpickled.

Every structural fact is checked when a dataset is opened (`IndexedDataset`), so a truncated,
mismatched or foreign file is one `DataError` naming the file and the problem, before training
starts.
"""

from __future__ import annotations

import errno
import os
import struct
import tempfile
from collections.abc import Iterable

import numpy as np

from t5x_like import files

MAGIC = b'MMIDIDX\x00\x00'
VERSION = 1
# Megatron's dtype codes. Floating-point codes exist in the format but cannot hold token ids.
DTYPE_CODES = {
  1: np.uint8,
  2: np.int8,
  3: np.int16,
  4: np.int32,
  5: np.int64,
  6: np.float64,
  7: np.float32,
  8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct('<9sQBQQ')  # magic, version, dtype code, N, D


class DataError(ValueError):
  """A dataset file or data setting that cannot be used; the message names the file and the fix."""


def best_dtype(vocab_size: int) -> np.dtype:
  """The narrowest dtype for ids < vocab_size, as Megatron picks it (uint16 below 65,500)."""
  return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def paths(prefix: str) -> tuple[str, str]:
  return prefix + '.bin', prefix + '.idx'


def exists(prefix: str) -> bool:
  return any(os.path.exists(p) for p in paths(prefix))


class IndexedDataset:
  """A read-only Megatron mmap dataset: documents as contiguous token ranges of one memory map."""

  def __init__(self, prefix: str):
    self.prefix = prefix
    bin_path, idx_path = paths(prefix)
    for path in (idx_path, bin_path):
      if not os.path.isfile(path):
        raise DataError(
          f'{path} not found: a dataset prefix names a PREFIX.bin and PREFIX.idx '
          "pair (Megatron's preprocess_data.py output, or `python -m "
          't5x_like.data preprocess`); check the path, without the extension'
        )
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, 'rb') as f:
      header = f.read(_HEADER.size)
    if len(header) < _HEADER.size or header[: len(MAGIC)] != MAGIC:
      raise DataError(
        f'{idx_path} is not a Megatron mmap index (no {MAGIC!r} header); '
        'only the mmap format (`--dataset-impl mmap`) is supported'
      )
    _, version, code, num_sequences, num_bounds = _HEADER.unpack(header)
    if version != VERSION:
      raise DataError(f'{idx_path} has index version {version}; only version {VERSION} is known')
    if code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind == 'f':
      integer_codes = sorted(k for k, v in DTYPE_CODES.items() if np.dtype(v).kind != 'f')
      raise DataError(
        f'{idx_path} has dtype code {code}, which holds no integer token ids; '
        f'integer codes are {integer_codes}'
      )
    expected = _HEADER.size + 4 * num_sequences + 8 * num_sequences + 8 * num_bounds
    if idx_size != expected:
      raise DataError(
        f'{idx_path} is {idx_size} bytes but its header ({num_sequences} sequences, '
        f'{num_bounds} document bounds) needs {expected}: the file is truncated or '
        'was written by something else; re-run the preprocessing'
      )
    self.dtype = np.dtype(DTYPE_CODES[code])
    offset = _HEADER.size
    self.sizes = np.memmap(idx_path, np.int32, 'r', offset, (num_sequences,))
    offset += 4 * num_sequences
    self.pointers = np.memmap(idx_path, np.int64, 'r', offset, (num_sequences,))
    offset += 8 * num_sequences
    self.doc_idx = np.memmap(idx_path, np.int64, 'r', offset, (num_bounds,))
    self._check_layout(idx_path, bin_path)
    self.num_tokens = os.path.getsize(bin_path) // self.dtype.itemsize
    # An empty .bin cannot be memory-mapped; an empty dataset has no tokens to map.
    self.tokens = (
      np.memmap(bin_path, self.dtype, 'r') if self.num_tokens else np.zeros((0,), self.dtype)
    )

  def _check_layout(self, idx_path: str, bin_path: str) -> None:
    """The sequences tile the .bin in order and the documents tile the sequences."""
    sizes, pointers, doc_idx = self.sizes, self.pointers, self.doc_idx
    item = self.dtype.itemsize
    bin_size = os.path.getsize(bin_path)
    total = int(sizes.sum(dtype=np.int64)) * item
    if bin_size != total:
      raise DataError(
        f'{bin_path} is {bin_size} bytes but {idx_path} describes {total} '
        '(sizes x itemsize): the pair is mismatched or truncated; re-run the '
        'preprocessing'
      )
    if len(sizes) and (
      sizes.min() < 0
      or pointers[0] != 0
      or np.any(pointers[1:] != pointers[:-1] + sizes[:-1].astype(np.int64) * item)
    ):
      raise DataError(
        f'{idx_path}: the sequence pointers do not follow the sizes (sequences must '
        'be stored back to back, as Megatron writes them)'
      )
    if (
      len(doc_idx) < 1
      or doc_idx[0] != 0
      or doc_idx[-1] != len(sizes)
      or np.any(np.diff(doc_idx) < 0)
    ):
      raise DataError(
        f'{idx_path}: the document index must start at 0, never decrease and end at '
        f'the number of sequences ({len(sizes)})'
      )

  @property
  def num_documents(self) -> int:
    return len(self.doc_idx) - 1

  def document_token_offsets(self) -> np.ndarray:
    """Token offset of each document's start, then the total: int64 [num_documents + 1]."""
    starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)])
    return starts[np.asarray(self.doc_idx)]

  def document(self, index: int) -> np.ndarray:
    offsets = self.document_token_offsets()
    return np.asarray(self.tokens[offsets[index] : offsets[index + 1]])

  def max_token_id(self, chunk_tokens: int = 1 << 26) -> int:
    """The largest id in the .bin, read in chunks (a full scan of the file)."""
    top = -1
    for start in range(0, self.num_tokens, chunk_tokens):
      top = max(top, int(self.tokens[start : start + chunk_tokens].max()))
    return top


def write_documents(
  prefix: str,
  dtype: np.dtype,
  documents: Iterable,
  what: str,
  no_tokens_fix: str,
  no_space_fix: str,
) -> tuple[int, int, int]:
  """Writes each token sequence of `documents` as one document of PREFIX.bin/.idx, all or
  nothing (IndexedDatasetWriter). An empty one is skipped and counted, as Megatron's
  preprocess_data.py does: a lone end-of-document would shift the document count, and with it
  every split boundary. Returns (documents, tokens, empty ones skipped). No document with tokens,
  or a full disk, is a DataError naming `what` and the fix."""
  written = tokens = empty = 0
  try:
    with IndexedDatasetWriter(prefix, dtype) as writer:
      for ids in documents:
        if not len(ids):
          empty += 1
          continue
        writer.add_document(ids)
        written += 1
        tokens += len(ids)
      if not written:  # raised inside the block: the writer discards its temporary files
        raise DataError(
          f'{what}: no text to tokenize ({empty} document(s), all empty); {no_tokens_fix}'
        )
  except OSError as e:
    if e.errno != errno.ENOSPC:
      raise
    raise DataError(
      f'no space left on the device of {prefix} while writing {what}; nothing was '
      f'written (the temporary files are removed): {no_space_fix}'
    ) from None
  return written, tokens, empty


class IndexedDatasetWriter:
  """Writes a dataset document by document; `PREFIX.bin`/`.idx` appear only when `close()` ends.

  Both files are written under temporary names beside their targets and renamed into place, the
  .bin first and the .idx last, so a crash while writing leaves nothing under the final names,
  never a half-written file. (Replacing an existing pair, which `preprocess` does only with
  --overwrite, can be cut between the two renames; the reader then finds the .idx and .bin
  sizes disagree and says so.) Use as a context manager: an exception inside the block discards
  the temporary files.
  """

  def __init__(self, prefix: str, dtype: np.dtype):
    self.prefix = prefix
    self.dtype = np.dtype(dtype)
    if self.dtype not in _CODE_OF or self.dtype.kind == 'f':
      raise DataError(f'cannot write token ids as {self.dtype}')
    directory = os.path.dirname(os.path.abspath(prefix))
    self._created_dirs = files.make_dirs(directory)  # a discarded dataset leaves none
    fd, self._bin_tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-', suffix='.bin')
    self._bin = os.fdopen(fd, 'wb')
    self._sizes: list[int] = []
    self._closed = False

  def add_document(self, ids: Iterable[int]) -> None:
    array = np.asarray(ids)
    if array.size and (
      array.min() < np.iinfo(self.dtype).min or array.max() > np.iinfo(self.dtype).max
    ):
      raise DataError(f'token id outside the range of {self.dtype}; write with a wider dtype')
    self._bin.write(array.astype(self.dtype, copy=False).tobytes(order='C'))
    self._sizes.append(int(array.size))

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    idx_tmp = None
    try:
      self._bin.close()  # flushes: a full disk can fail here
      sizes = np.asarray(self._sizes, dtype=np.int32)
      pointers = np.zeros(len(sizes), dtype=np.int64)
      if len(sizes) > 1:
        pointers[1:] = np.cumsum(sizes[:-1], dtype=np.int64) * self.dtype.itemsize
      doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)  # one sequence per document
      bin_path, idx_path = paths(self.prefix)
      directory = os.path.dirname(os.path.abspath(self.prefix))
      fd, idx_tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-', suffix='.idx')
      with os.fdopen(fd, 'wb') as f:
        f.write(_HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes), len(doc_idx)))
        f.write(sizes.astype('<i4').tobytes())
        f.write(pointers.astype('<i8').tobytes())
        f.write(doc_idx.astype('<i8').tobytes())
      for tmp in (self._bin_tmp, idx_tmp):
        os.chmod(tmp, 0o644)  # mkstemp makes owner-only files; datasets are shared read-only
      os.replace(self._bin_tmp, bin_path)
      os.replace(idx_tmp, idx_path)
    except BaseException:
      for leftover in (self._bin_tmp, idx_tmp):
        if leftover and os.path.exists(leftover):
          os.unlink(leftover)
      files.remove_made_dirs(self._created_dirs)
      raise

  def abort(self) -> None:
    if not self._closed:
      self._closed = True
      try:
        self._bin.close()  # may fail to flush (a full disk): the file goes anyway
      except OSError:
        pass
      finally:
        os.unlink(self._bin_tmp)
        files.remove_made_dirs(self._created_dirs)

  def __enter__(self) -> IndexedDatasetWriter:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:
      self.abort()
