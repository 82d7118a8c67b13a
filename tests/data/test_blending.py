"""Weighted blending: the quota order (every prefix within one sample of the weights, any slice
computed alone), the divisor order that earlier runs keep, and blended sources."""

import heapq
import json
import os

import numpy as np
import pytest
from conftest import small_config

from t5x_like import config
from t5x_like.checkpointing import checkpoints
from t5x_like.config import ConfigError, load_config_file
from t5x_like.data import sources
from t5x_like.data.blending import CHUNK, ORDERS, Blend, BlendedSource, DivisorBlend
from t5x_like.data.dataset import SampleSource
from t5x_like.training import replay, resume

WEIGHTS = {
  'two equal': [1.0, 1.0],
  'two uneven': [0.9, 0.1],
  'three': [0.5, 0.3, 0.2],
  'twenty-nine (tr11-like)': list(np.random.default_rng(0).dirichlet(np.ones(29)) * 5),
}


def tr11_weights():
  """The 28 weights of tr11's training blend, as configs/bloom_176b.py gives them."""
  cfg = load_config_file(
    os.path.join(os.path.dirname(__file__), '..', '..', 'configs', 'bloom_176b.py')
  )
  [(_, entries)] = sources.weighted_split_groups(cfg.data, 'train')
  return [entry.weight for entry in entries]


def assert_every_prefix_within_one_sample(blend, datasets, first=0):
  """|count_d - w_d k| < 1 for every dataset d and every prefix k = first .. first+len(datasets)
  of the stream whose samples first.. are `datasets`. Between two samples of d, w_d k - count_d
  only grows: its extremes lie just before and just after each of d's samples, and at the end."""
  w = blend.weights
  before = blend.counts(first)
  assert np.all(np.abs(before - w * first) < 1), 'the counts before the slice drift'
  by_dataset = np.argsort(datasets, kind='stable')
  owner = datasets[by_dataset]
  per_dataset = np.bincount(datasets, minlength=len(w))
  # j: which sample of its dataset each is (1-based); k: the prefix it completes.
  j = (
    before[owner]
    + np.arange(len(owner))
    - np.repeat(np.cumsum(per_dataset) - per_dataset, per_dataset)
    + 1
  )
  k = first + by_dataset + 1
  drifts = [
    j - w[owner] * k,
    w[owner] * (k - 1) - (j - 1),
    np.abs(before + per_dataset - w * (first + len(datasets))),
  ]
  drift = max(float(np.max(x, initial=0)) for x in drifts)
  assert drift < 1, f'a dataset drifts {drift} samples from its share'


@pytest.mark.parametrize('name', ['50 datasets, Dirichlet(0.3)', "tr11's 28"])
def test_quota_order_every_prefix_within_one_sample(name):
  """The property over 10^6 prefixes, for skewed weights on which the divisor order drifts."""
  weights = (
    np.random.default_rng(1).dirichlet(np.full(50, 0.3))
    if name.startswith('50')
    else tr11_weights()
  )
  blend = Blend(weights)
  datasets, indices = blend.assign(0, 1_000_001)
  assert_every_prefix_within_one_sample(blend, datasets)
  # Megatron's blend counts: each dataset's samples are its own first ones, in order.
  by_dataset = np.argsort(datasets, kind='stable')
  per_dataset = np.bincount(datasets)
  np.testing.assert_array_equal(
    indices[by_dataset],
    np.arange(len(datasets)) - np.repeat(np.cumsum(per_dataset) - per_dataset, per_dataset),
  )
  # The check can tell: the divisor order drifts past one sample within the first 20,000.
  divisor = DivisorBlend(weights)
  with pytest.raises(AssertionError, match='drifts'):
    assert_every_prefix_within_one_sample(divisor, divisor.assign(0, 20_000)[0])


@pytest.mark.parametrize(
  'weights',
  [
    [1.0],
    [1.0, 1.0],
    [0.9, 0.1],
    [1.0] * 7,
    [1, 2, 3, 4, 5],
    [0.3, 1e-9, 1e-6, 1.0],
    list(np.random.default_rng(2).dirichlet(np.full(80, 0.05)) + 1e-12),
  ],
)
def test_quota_order_edge_weights_at_the_start_and_deep_in(weights):
  """Equal shares (exact ties), one dataset, shares far below 1 / CHUNK; near sample 5M too."""
  blend = Blend(weights)
  assert_every_prefix_within_one_sample(blend, blend.assign(0, 2 * CHUNK + 1)[0])
  deep = 600 * CHUNK
  assert_every_prefix_within_one_sample(blend, blend.assign(deep, deep + 2 * CHUNK)[0], deep)


def test_quota_order_any_slice_is_computed_alone():
  """A fresh Blend (as in another process, or a `data batch` of any iteration) gives any slice,
  within a chunk or across boundaries, as the whole order has it; counts agree."""
  weights = np.random.default_rng(3).dirichlet(np.full(50, 0.3))
  whole, whole_indices = Blend(weights).assign(0, 40 * CHUNK)
  for start, size in [
    (0, 1),
    (CHUNK - 3, 7),
    (2 * CHUNK + 5, 1),
    (1234, 2 * CHUNK),
    (39 * CHUNK - 10, 10 + CHUNK),
    (17, 0),
  ]:
    datasets, indices = Blend(weights).assign(start, start + size)
    np.testing.assert_array_equal(datasets, whole[start : start + size])
    np.testing.assert_array_equal(indices, whole_indices[start : start + size])
  blend = Blend(weights)
  for n in (0, 1, CHUNK, CHUNK + 1, 40 * CHUNK - 1):
    np.testing.assert_array_equal(blend.counts(n), np.bincount(whole[:n], minlength=50))


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
def test_divisor_order_any_slice_equals_the_same_slice_of_the_whole_order(name):
  weights = WEIGHTS[name]
  reference = merged_order(weights, 3000)
  blend = DivisorBlend(weights)
  datasets, indices = blend.assign(0, 3000)
  np.testing.assert_array_equal(datasets, reference[:, 0])
  np.testing.assert_array_equal(indices, reference[:, 1])
  for start, size in [(0, 1), (1, 7), (1234, 256), (2999, 1), (2500, 500), (17, 0)]:
    d, k = blend.assign(start, start + size)
    np.testing.assert_array_equal(d, reference[start : start + size, 0])
    np.testing.assert_array_equal(k, reference[start : start + size, 1])
  for n in (0, 1, 2, 999, 3000):
    np.testing.assert_array_equal(
      blend.counts(n), np.bincount(reference[:n, 0].astype(int), minlength=len(weights))
    )


@pytest.mark.parametrize('name', list(WEIGHTS))
def test_divisor_order_every_prefix_follows_the_weights_within_about_one_sample(name):
  """The order of runs started before the quota order: within about one sample (measured here
  over 20,000 prefixes, and far into a 200M-sample run)."""
  blend = DivisorBlend(WEIGHTS[name])
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


@pytest.mark.parametrize('order', [Blend, DivisorBlend])
def test_bad_weights(order):
  for weights in ([], [1.0, 0.0], [1.0, -2.0], [float('nan')]):
    with pytest.raises(ValueError, match='positive and finite'):
      order(weights)


def test_blended_source_takes_each_row_from_its_dataset():
  seq = 4
  # Dataset d holds only ids in [100 d, 100 d + 100): every row says where it came from.
  parts = [
    SampleSource(np.arange(100 * d, 100 * d + 100, dtype=np.uint16), seq, seed=3, stream=(0, d))
    for d in range(3)
  ]
  source = BlendedSource(parts, [0.5, 0.3, 0.2])
  rows = source.rows(40, 140)
  assert rows.shape == (100, seq + 1) and rows.dtype == np.int32
  datasets, indices = source.blend.assign(40, 140)
  np.testing.assert_array_equal(rows[:, 0] // 100, datasets)
  for i in (0, 17, 99):
    np.testing.assert_array_equal(rows[i], parts[datasets[i]].sample(int(indices[i])))
  np.testing.assert_array_equal(source.batch(40, 100), rows)


def test_blended_source_order_is_the_configs():
  parts = [
    SampleSource(np.arange(100 * d, 100 * d + 100, dtype=np.uint16), 4, seed=3, stream=(0, d))
    for d in range(2)
  ]
  assert isinstance(BlendedSource(parts, [0.5, 0.5]).blend, Blend)
  assert isinstance(BlendedSource(parts, [0.5, 0.5], order='divisor').blend, DivisorBlend)
  assert config.allowed_values('data.blend_order') == tuple(ORDERS)
  with pytest.raises(ConfigError, match="data.blend_order must be 'quota' or 'divisor', got 'web"):
    small_config(data=dict(blend_order='webster')).validate()


def test_a_run_keeps_the_blend_order_it_started_with(tmp_path):
  """A config recorded before data.blend_order existed reads as the divisor order, in `data
  batch` (config.json, config_history.jsonl) and on resume (the checkpoint's config); a resumed
  run trains on with its checkpoint's order, whatever its config says."""
  older = small_config().to_dict()
  del older['data']['blend_order']
  assert (
    config.Config.from_dict(config.with_values_before_keys(older)).data.blend_order == 'divisor'
  )
  with open(tmp_path / 'config.json', 'w') as f:
    json.dump(older, f)
  assert replay.run_config(str(tmp_path))[0].data.blend_order == 'divisor'

  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import Progress, make_layout

  cfg = small_config()
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  root = str(tmp_path / 'checkpoints')
  checkpointer = checkpoints.Checkpointer(root, 1, max_to_keep=3, layout=layout)
  progress = Progress(iteration=1, consumed_samples=8, consumed_tokens=128)
  meta = checkpoints.make_meta(
    cfg, progress, cfg.train.seed, {'iteration': 0, 'skipped_iterations': 0}
  )
  assert checkpointer.save(layout.init(0), progress, cfg, meta)
  checkpointer.close()
  assert resume.resolve(cfg, str(tmp_path)).config.data.blend_order == 'quota'
  item = tmp_path / 'checkpoints' / '1' / 'config' / 'metadata'
  saved = json.loads(item.read_text())
  del saved['data']['blend_order']  # as a checkpoint of the divisor order's version has it
  item.write_text(json.dumps(saved))
  plan = resume.resolve(cfg, str(tmp_path))
  assert plan.config.data.blend_order == 'divisor'
  assert (
    "> data order: blend order 'divisor' of the checkpoint (data.blend_order='quota' "
    'applies to new runs)'
  ) in plan.notes
