"""t5x_like.tensorboard: event files that TensorFlow's own reader parses, CRCs included."""

import os

import pytest

from t5x_like import tensorboard

from conftest import read_tensorboard


def test_crc32c_is_castagnoli():
  assert tensorboard.crc32c(b'123456789') == 0xE3069283  # the CRC-32C check value
  assert tensorboard.crc32c(b'') == 0


def test_tensorflow_reads_the_scalars_steps_and_purge_back(tmp_path):
  first = tensorboard.EventWriter(str(tmp_path))
  first.add([('loss/lm_loss', 2.5, 1), ('lr/lr', 1e-4, 1)])
  first.add([('loss/lm_loss', 2.25, 2), ('loss/lm_loss', 2.0, 3)])
  first.add([('big/step', -1.0, 2**40)])  # multi-byte varint steps
  first.close()
  # A resumed run from step 2: the first file's steps 2 and on are dropped.
  second = tensorboard.EventWriter(str(tmp_path), purge_from=2)
  second.add([('loss/lm_loss', 2.125, 2)])
  second.close()
  assert len(os.listdir(tmp_path)) == 2
  scalars, = read_tensorboard(str(tmp_path))
  assert scalars['loss/lm_loss'] == [(1, 2.5), (2, 2.125)]
  assert scalars['lr/lr'] == [(1, pytest.approx(1e-4))]
  assert scalars['big/step'] == []  # purged: 2**40 >= 2
