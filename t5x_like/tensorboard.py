"""TensorBoard event files of scalars, written without TensorFlow, PyTorch or tensorboardX.

The libraries that write event files bring a framework into the training process. TensorFlow's
`tf.summary` claims the GPUs, and tensorboardX imports PyTorch whenever it is installed (seconds
of start-up, a second copy of the CUDA libraries beside JAX's). A run logs only scalars, and their
file format is small enough to write here:

* a file `events.out.tfevents.<seconds>.<host>.<pid>.<n>` (TensorBoard reads a directory's
  files in name order) of TFRecord frames: uint64 length,
  masked CRC-32C of the length, the record, masked CRC-32C of the record (little-endian);
* each record an `Event` protocol buffer: wall_time (field 1, double), step (2, int64),
  file_version (3, string: the first record, "brain.Event:2"), summary (5: repeated Value of tag
  (1, string) and simple_value (2, float)), session_log (7: status (1) START = 1).

A SessionLog START at step N in a newer file tells TensorBoard to drop the older files' events
from step N on. A run resumed from its checkpoint at iteration N - 1 writes one, so each curve
shows one value per step.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time

_FILE_NUMBERS = itertools.count()  # two writers of one process in one second: distinct names

# CRC-32C (Castagnoli), reflected polynomial 0x82F63B78, as TFRecord frames use it.
_CRC_TABLE = []
for _byte in range(256):
  _crc = _byte
  for _ in range(8):
    _crc = (_crc >> 1) ^ (0x82F63B78 if _crc & 1 else 0)
  _CRC_TABLE.append(_crc)


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame(record: bytes) -> bytes:
  """One TFRecord frame around `record`."""
  length = struct.pack('<Q', len(record))
  return (length + struct.pack('<I', masked_crc32c(length)) + record +
          struct.pack('<I', masked_crc32c(record)))


def _varint(value: int) -> bytes:
  value &= (1 << 64) - 1  # int64 fields encode negatives as ten-byte two's complement
  out = bytearray()
  while True:
    low, value = value & 0x7F, value >> 7
    if value:
      out.append(low | 0x80)
    else:
      out.append(low)
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2)."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(step: int, wall_time: float, *, scalars: list[tuple[str, float]] = (),
          file_version: str | None = None, session_start: bool = False) -> bytes:
  """The bytes of one Event message."""
  out = b'\x09' + struct.pack('<d', wall_time) + b'\x10' + _varint(step)
  if file_version is not None:
    out += _field(3, file_version.encode())
  if scalars:
    values = b''.join(
        _field(1, _field(1, tag.encode()) + b'\x15' + struct.pack('<f', value))
        for tag, value in scalars)
    out += _field(5, values)
  if session_start:
    out += _field(7, b'\x08\x01')  # session_log (field 7), status START
  return out


class EventWriter:
  """Appends scalars to a new event file in `directory`; `purge_from` writes a SessionLog START
  at that step first (a resumed run). Each `add` is written and flushed at once."""

  def __init__(self, directory: str, purge_from: int | None = None):
    os.makedirs(directory, exist_ok=True)
    name = (f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.'
            f'{os.getpid()}.{next(_FILE_NUMBERS):04d}')
    self.path = os.path.join(directory, name)
    self._file = open(self.path, 'ab')  # pylint: disable=consider-using-with
    self._write([event(0, time.time(), file_version='brain.Event:2')])
    if purge_from is not None:
      self._write([event(purge_from, time.time(), session_start=True)])

  def add(self, scalars: list[tuple[str, float, int]]) -> None:
    """(tag, value, step) triples: one Event per step, its scalars together."""
    by_step: dict[int, list[tuple[str, float]]] = {}
    for tag, value, step in scalars:
      by_step.setdefault(int(step), []).append((tag, float(value)))
    now = time.time()
    self._write([event(step, now, scalars=values) for step, values in by_step.items()])

  def _write(self, events: list[bytes]) -> None:
    self._file.write(b''.join(frame(e) for e in events))
    self._file.flush()

  def close(self) -> None:
    self._file.close()
