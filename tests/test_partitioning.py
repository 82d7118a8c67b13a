"""Sharding rules, ZeRO-1, and sharded runs equal to the single-device run."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like import partitioning
from t5x_like.trainer import make_train_step
from t5x_like.train_state import make_layout

from conftest import run_steps, small_config


def test_megatron_tensor_parallel_rules():
  cfg = small_config(mesh=dict(data=1, tensor=4))
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 4))
  spec = lambda s: tuple(s.spec) + (None,) * 8
  shard = jax.tree.map(lambda a: a.sharding, layout.abstract.params)
  attn, mlp = shard['layers']['attn'], shard['layers']['mlp']
  assert spec(attn['qkv_kernel'])[:5] == (None, None, 'tensor', None, None)  # output dim (heads)
  assert spec(attn['out_kernel'])[:4] == (None, 'tensor', None, None)  # input dim (heads)
  assert spec(mlp['wi_kernel'])[:3] == (None, None, 'tensor')  # h -> 4h: output dim
  assert spec(mlp['wo_kernel'])[:3] == (None, 'tensor', None)  # 4h -> h: input dim
  assert spec(shard['word_embeddings'])[:2] == ('tensor', None)  # vocabulary
  assert spec(shard['final_ln']['scale'])[:1] == (None,)  # replicated


def test_zero1_splits_master_params_and_adam_moments_over_data():
  cfg = small_config(mesh=dict(data=2, tensor=4))
  layout = make_layout(cfg, partitioning.make_mesh(2, 1, 4))
  params = layout.abstract.params
  for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
    axes = [name for ax in a.sharding.spec if ax is not None
            for name in (ax if isinstance(ax, tuple) else (ax,))]
    names = jax.tree_util.keystr(path)
    if 'layers' in names:
      assert a.sharding.spec[0] is None, names  # the scanned dim is never split
    assert 'data' in axes, f'{names} is not ZeRO-split: {a.sharding.spec}'
  mu = layout.abstract.opt_state[0].mu
  assert mu['word_embeddings'].sharding == params['word_embeddings'].sharding
  assert layout.abstract.opt_state[0].count.sharding.spec == P()
  # The compute copy drops the data split (it is all-gathered in bf16 for the forward pass).
  assert 'data' not in tuple(layout.compute_param_shardings['word_embeddings'].spec)


@pytest.fixture(scope='module')
def single_device_run():
  return run_steps(small_config())


@pytest.mark.parametrize('data, tensor', [(8, 1), (2, 4), (1, 8)])
def test_sharded_run_matches_single_device(single_device_run, data, tensor):
  losses, norms, params = run_steps(small_config(mesh=dict(data=data, tensor=tensor)))
  ref_losses, ref_norms, ref_params = single_device_run
  assert losses[-1] < losses[0]  # it trains
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  # Adam normalises tiny gradients, so fp32 reduction-order noise reaches ~1e-5 of lr-sized steps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params,
               ref_params)


# An all-gather's line in compiled HLO text: `%name = f32[3000,64]{1,0} all-gather(%x), ...`, the
# result's shape (with its layout, or a tuple of shapes) between `=` and the op; on GPU the async
# form `all-gather-start(` carries the shape.
_ALL_GATHER = re.compile(r'= (?P<result>.+?) all-gather(?:-start)?\(')


def gathers_of_dim(hlo_text: str, size: int) -> list[str]:
  """The lines of `hlo_text` whose all-gather produces an array with a dimension of `size`."""
  found = []
  for line in hlo_text.splitlines():
    match = _ALL_GATHER.search(line)
    if match and any(str(size) in shape.split(',')
                     for shape in re.findall(r'\[([\d,]*)\]', match.group('result'))):
      found.append(line.strip())
  return found


def test_the_gather_check_finds_a_gathered_vocabulary():
  """What test_cross_entropy_never_gathers_the_vocabulary looks for, in a program that does it:
  a vocabulary-split embedding gathered whole (and nothing in one that keeps it split)."""
  mesh = partitioning.make_mesh(1, 1, 8)
  split = NamedSharding(mesh, P('tensor', None))
  table = jax.ShapeDtypeStruct((3008, 64), jnp.float32, sharding=split)
  gather = jax.jit(lambda t: t * 2, out_shardings=NamedSharding(mesh, P()))
  found = gathers_of_dim(gather.lower(table).compile().as_text(), 3008)
  assert len(found) == 1 and 'f32[3008,64]' in found[0], found
  keep = jax.jit(lambda t: t * 2, out_shardings=split)
  assert gathers_of_dim(keep.lower(table).compile().as_text(), 3008) == []


def test_cross_entropy_never_gathers_the_vocabulary():
  """On a tensor-split mesh no all-gather produces a full-vocabulary tensor. With data=2 the
  program does gather (ZeRO-1's params, over data), so the check has gathers to look at."""
  cfg = small_config(mesh=dict(data=2, tensor=4), model=dict(vocab_size=3000))
  mesh = partitioning.make_mesh(2, 1, 4)
  layout = make_layout(cfg, mesh)
  batch_sharding = NamedSharding(mesh, P(None, 'data', None))
  step = jax.jit(make_train_step(cfg, layout), in_shardings=(layout.shardings, batch_sharding,
                                                             None, None))
  batch = jax.ShapeDtypeStruct((cfg.num_microbatches, 2, cfg.train.seq_len + 1), jnp.int32,
                               sharding=batch_sharding)
  hlo = step.lower(layout.abstract, batch, jax.ShapeDtypeStruct((), jnp.float32),
                   jax.ShapeDtypeStruct((), jnp.int32)).compile().as_text()
  # ZeRO's gather of the embedding: a tensor rank's quarter of the vocabulary, whole hidden.
  assert any('[768,64]' in g for g in gathers_of_dim(hlo, cfg.padded_vocab_size // 4))
  full_vocab = gathers_of_dim(hlo, cfg.padded_vocab_size)
  assert not full_vocab, full_vocab[:3]


def test_replica_check_finds_a_drifted_layernorm():
  """What tensor-parallel drift looks like: the copies of a replicated array differ."""
  mesh = partitioning.make_mesh(1, 1, 4)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  copies = [jax.device_put(np.full(8, 1.0 + (i == 3) * 1e-3, np.float32), d)
            for i, d in enumerate(mesh.devices.flat)]
  drifted = jax.make_array_from_single_device_arrays((8,), sharding, copies)
  same = jax.device_put(np.ones(8, np.float32), sharding)
  assert partitioning.replica_mismatches({'ln': {'scale': drifted, 'bias': same}}) == [
      "['ln']['scale']"]
