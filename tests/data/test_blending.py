"""Weighted blending: the divisor order, any slice computed alone, and the mix at every prefix."""

import heapq

import numpy as np
import pytest

from t5x_like.data.blending import Blend, BlendedSource
from t5x_like.data.dataset import SampleSource

WEIGHTS = {
    'two equal': [1.0, 1.0],
    'two uneven': [0.9, 0.1],
    'three': [0.5, 0.3, 0.2],
    'twenty-nine (tr11-like)': list(np.random.default_rng(0).dirichlet(np.ones(29)) * 5),
}


def merged_order(weights, n):
  """The reference: repeatedly take the smallest key (k + 1/2) / w_d, lower d first on ties."""
  w = np.asarray(weights, float) / np.sum(weights)
  heap = [(0.5 / w[d], d, 0) for d in range(len(w))]
  heapq.heapify(heap)
  out = []
  for _ in range(n):
    _, d, k = heapq.heappop(heap)
    out.append((d, k))
    heapq.heappush(heap, ((k + 1.5) / w[d], d, k + 1))
  return np.array(out)


@pytest.mark.parametrize('name', list(WEIGHTS))
def test_any_slice_equals_the_same_slice_of_the_whole_order(name):
  weights = WEIGHTS[name]
  reference = merged_order(weights, 3000)
  blend = Blend(weights)
  datasets, indices = blend.assign(0, 3000)
  np.testing.assert_array_equal(datasets, reference[:, 0])
  np.testing.assert_array_equal(indices, reference[:, 1])
  for start, size in [(0, 1), (1, 7), (1234, 256), (2999, 1), (2500, 500), (17, 0)]:
    d, k = blend.assign(start, start + size)
    np.testing.assert_array_equal(d, reference[start:start + size, 0])
    np.testing.assert_array_equal(k, reference[start:start + size, 1])
  for n in (0, 1, 2, 999, 3000):
    np.testing.assert_array_equal(blend.counts(n),
                                  np.bincount(reference[:n, 0].astype(int), minlength=len(weights)))


@pytest.mark.parametrize('name', list(WEIGHTS))
def test_every_prefix_follows_the_weights_within_about_one_sample(name):
  """Megatron's greedy rule keeps every dataset within about one sample of its share; so does
  this order (measured here over 20,000 prefixes, and far into a 200M-sample run)."""
  blend = Blend(WEIGHTS[name])
  datasets, _ = blend.assign(0, 20000)
  counts = np.cumsum(np.eye(len(blend.weights))[datasets], axis=0)
  expected = np.arange(1, 20001)[:, None] * blend.weights[None, :]
  assert np.abs(counts - expected).max() < 1.5
  for n in (199_999_999, 200_000_000, 200_000_513):
    assert np.abs(blend.counts(n) - n * blend.weights).max() < 1.5
  # A slice deep into training costs what a slice at the start does, and continues the counts.
  start = 200_000_000
  d, k = blend.assign(start, start + 2048)
  for dataset in range(len(blend.weights)):
    mine = k[d == dataset]
    assert np.array_equal(mine, blend.counts(start)[dataset] + np.arange(len(mine)))


def test_bad_weights():
  for weights in ([], [1.0, 0.0], [1.0, -2.0], [float('nan')]):
    with pytest.raises(ValueError, match='positive and finite'):
      Blend(weights)


def test_blended_source_takes_each_row_from_its_dataset():
  seq = 4
  # Dataset d holds only ids in [100 d, 100 d + 100): every row says where it came from.
  parts = [SampleSource(np.arange(100 * d, 100 * d + 100, dtype=np.uint16), seq, seed=3,
                        stream=(0, d)) for d in range(3)]
  source = BlendedSource(parts, [0.5, 0.3, 0.2])
  rows = source.rows(40, 140)
  assert rows.shape == (100, seq + 1) and rows.dtype == np.int32
  datasets, indices = source.blend.assign(40, 140)
  np.testing.assert_array_equal(rows[:, 0] // 100, datasets)
  for i in (0, 17, 99):
    np.testing.assert_array_equal(rows[i], parts[datasets[i]].sample(int(indices[i])))
  np.testing.assert_array_equal(source.batch(40, 100), rows)
