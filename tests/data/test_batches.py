"""Batch slicing (t5x_like/data/batches.py) is shared: the trainer's sharded global batch holds
the rows `python -m t5x_like.data batch` shows for the same iteration (data/replay.py), cut to
the curriculum's length, and padding only where the step pads."""

import jax
import numpy as np
from conftest import small_config

from t5x_like.data import sources
from t5x_like.mesh import partitioning
from t5x_like.model import losses
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import batches, replay
from t5x_like.training.step import batch_sharding


def test_the_trainers_batch_and_data_batch_slice_the_same_rows():
  cfg = small_config(
    model=dict(vocab_size=8192),
    train=dict(
      steps=4,
      global_batch_size=8,
      micro_batch_size=2,
      seq_len=32,
      rampup_batch_size=(4, 4, 8),
      rampup_microbatch_multiple=2,
    ),
    mesh=dict(data=2),
    curriculum=dict(min_seq_len=8, total_iterations=4, pad_to_multiple=16),
  )
  sharding = batch_sharding(make_layout(cfg, partitioning.make_mesh(2, 1, 1)))
  source = sources.build(cfg.data, cfg.train.seq_len, cfg.train.seed).train
  # Iteration 1: global batch 4 (one micro-batch of 4 rows, padded to 2 micro-batches), trained
  # on 8 tokens per sample (9 with the label), run at 16.
  shown = replay.iteration_batch(cfg, cfg.train.seed, 1)
  assert (shown.first_sample, shown.seq_len, len(shown.rows)) == (0, 8, 4)
  batch = np.asarray(
    jax.device_get(
      batches.global_batch(
        cfg, sharding, source, 0, 4, seq_len=8, padded_seq_len=16, microbatches=2
      )
    )
  )
  assert batch.shape == (2, 4, 17)
  np.testing.assert_array_equal(batch[0, :, :9], shown.rows)
  assert (batch[0, :, 9:] == losses.PAD_ID).all() and (batch[1] == losses.PAD_ID).all()
  # Iteration 3: the ramp reached 8 samples, from sample 8 on.
  shown = replay.iteration_batch(cfg, cfg.train.seed, 3)
  assert (shown.first_sample, shown.seq_len) == (8, 24)
  batch = np.asarray(
    jax.device_get(batches.global_batch(cfg, sharding, source, 8, 8, seq_len=24, padded_seq_len=32))
  )
  np.testing.assert_array_equal(batch.reshape(8, 33)[:, :25], shown.rows)
