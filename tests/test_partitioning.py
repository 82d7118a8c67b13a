"""Sharding rules, ZeRO-1, and sharded runs equal to the single-device run."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, small_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import describe_zero, make_layout
from t5x_like.training.step import make_train_step


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
    axes = [
      name
      for ax in a.sharding.spec
      if ax is not None
      for name in (ax if isinstance(ax, tuple) else (ax,))
    ]
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
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params, ref_params
  )


def test_clipping_on_a_tensor_parallel_mesh_is_the_single_devices(single_device_run):
  """tr11's bug: the gradient clipping of tensor ranks > 1 was skipped. Here with clip_grad=0.5,
  below every iteration's pre-clip norm (about 1.0) so that each update is clipped, a data=2 x
  tensor=4 run's losses, norms and params are the single device's, and the clipping mattered
  (the params differ from the unclipped run's, whose norms stay under its clip_grad of 1.0)."""
  clip = {'optimizer': {'clip_grad': 0.5}}
  ref_losses, ref_norms, ref_params = run_steps(small_config(**clip))
  losses, norms, params = run_steps(small_config(mesh=dict(data=2, tensor=4), **clip))
  assert min(ref_norms) > 0.5 and max(single_device_run[1]) < 1.0
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params, ref_params
  )
  unclipped = single_device_run[2]['layers']['mlp']['wi_kernel']
  gap = np.max(np.abs(np.asarray(ref_params['layers']['mlp']['wi_kernel']) - unclipped))
  assert gap > 1e-4


# An all-gather's line in compiled HLO text: `%name = f32[3000,64]{1,0} all-gather(%x), ...`, the
# result's shape (with its layout, or a tuple of shapes) between `=` and the op; on GPU the async
# form `all-gather-start(` carries the shape.
_ALL_GATHER = re.compile(r'= (?P<result>.+?) all-gather(?:-start)?\(')


def gathers_of_dim(hlo_text: str, size: int) -> list[str]:
  """The lines of `hlo_text` whose all-gather produces an array with a dimension of `size`."""
  found = []
  for line in hlo_text.splitlines():
    match = _ALL_GATHER.search(line)
    if match and any(
      str(size) in shape.split(',') for shape in re.findall(r'\[([\d,]*)\]', match.group('result'))
    ):
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
  step = jax.jit(
    make_train_step(cfg, layout), in_shardings=(layout.shardings, batch_sharding, None, None)
  )
  batch = jax.ShapeDtypeStruct(
    (cfg.num_microbatches, 2, cfg.train.seq_len + 1), jnp.int32, sharding=batch_sharding
  )
  hlo = (
    step.lower(
      layout.abstract,
      batch,
      jax.ShapeDtypeStruct((), jnp.float32),
      jax.ShapeDtypeStruct((), jnp.int32),
    )
    .compile()
    .as_text()
  )
  # ZeRO's gather of the embedding: a tensor rank's quarter of the vocabulary, whole hidden.
  assert any('[768,64]' in g for g in gathers_of_dim(hlo, cfg.padded_vocab_size // 4))
  full_vocab = gathers_of_dim(hlo, cfg.padded_vocab_size)
  assert not full_vocab, full_vocab[:3]


def test_replica_check_finds_a_drifted_layernorm():
  """What tensor-parallel drift looks like: the copies of a replicated array differ."""
  mesh = partitioning.make_mesh(1, 1, 4)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  copies = [
    jax.device_put(np.full(8, 1.0 + (i == 3) * 1e-3, np.float32), d)
    for i, d in enumerate(mesh.devices.flat)
  ]
  drifted = jax.make_array_from_single_device_arrays((8,), sharding, copies)
  same = jax.device_put(np.ones(8, np.float32), sharding)
  assert partitioning.replica_mismatches({'ln': {'scale': drifted, 'bias': same}}) == [
    "['ln']['scale']"
  ]


@pytest.fixture(scope='module')
def single_device_run_of_6():
  return run_steps(small_config(train=dict(global_batch_size=6)))


@pytest.mark.parametrize('tensor', [1, 2])
def test_zero1_pads_where_data_divides_nothing_and_matches_single_device(
  single_device_run_of_6, tensor
):
  """mesh.data=3 divides none of hidden 64, 4h 256 and the 1,024-row vocabulary: ZeRO-1 still
  splits every tensor over `data` (padded with zeros to a multiple of 3 inside the state), and
  training gives the single-device run's losses, norms and params; the padding stays zero."""
  cfg = small_config(mesh=dict(data=3, tensor=tensor), train=dict(global_batch_size=6))
  layout = make_layout(cfg, partitioning.make_mesh(3, 1, tensor))
  # The h->4h bias [layers, 4h] has no dim to pad: 4h is tensor-split (and 6 does not divide it).
  assert layout.replicated_over_data() == ([] if tensor == 1 else ["['layers']['mlp']['wi_bias']"])
  # 4h->h: the rules split 4h over tensor when there is one, so the hidden dim is the one padded.
  wo = layout.abstract.params['layers']['mlp']['wo_kernel']
  assert (wo.shape, wo.sharding.spec) == (
    ((2, 258, 64), P(None, 'data', None))
    if tensor == 1
    else ((2, 256, 66), P(None, 'tensor', 'data'))
  )
  losses, norms, params = run_steps(cfg)
  ref_losses, ref_norms, ref_params = single_device_run_of_6
  assert losses[-1] < losses[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  true_part = lambda a, want: a[tuple(slice(0, n) for n in want.shape)]
  padding_values = []
  for a, want in zip(jax.tree.leaves(params), jax.tree.leaves(layout.logical.params)):
    is_padding = np.ones(a.shape, bool)
    is_padding[tuple(slice(0, n) for n in want.shape)] = False
    padding_values.append(a[is_padding])
  padding_values = np.concatenate(padding_values)
  assert padding_values.size and not padding_values.any()  # padding there, and all zeros
  unpadded = jax.tree.map(true_part, params, layout.logical.params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), unpadded, ref_params
  )


@pytest.mark.parametrize(
  'model, pairs',
  [
    ({}, [((3, 2, 1), (1, 1, 1)), ((1, 1, 1), (3, 1, 2))]),
    # Hidden 54 over data 4: the checkpoint copy of [layers, 54] is split over 2 of the 4.
    (dict(hidden_size=54, num_heads=6), [((4, 1, 2), (1, 1, 1)), ((1, 1, 1), (4, 1, 1))]),
  ],
  ids=['data3', 'data4_hidden54'],
)
def test_zero1_padded_state_checkpoints_in_true_shapes_onto_any_mesh(tmp_path, model, pairs):
  """A state saved from a padded (and stage-ordered) layout holds the true shapes on disk and
  restores bitwise onto one device, and the other way round onto a padded layout."""
  from t5x_like.checkpointing import checkpoints
  from t5x_like.parallel.train_state import Progress, TrainState

  def mesh_layout(data, pipe, tensor):
    cfg = small_config(
      mesh=dict(data=data, pipeline=pipe, tensor=tensor),
      model=model,
      train=dict(global_batch_size=6 if data == 3 else 8),
    ).validate()
    return cfg, make_layout(cfg, partitioning.make_mesh(data, pipe, tensor))

  rng = np.random.default_rng(0)
  random_like = lambda a: (
    np.full(a.shape, 5, a.dtype)
    if jnp.issubdtype(a.dtype, jnp.integer)
    else rng.standard_normal(a.shape).astype(a.dtype)
  )
  canonical = jax.tree.map(random_like, mesh_layout(1, 1, 1)[1].canonical)

  def save(data, pipe, tensor):
    cfg, layout = mesh_layout(data, pipe, tensor)
    placed = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), canonical, layout.canonical)
    state = TrainState(
      layout.from_canonical(placed.params, 'params'),
      layout.from_canonical(placed.opt_state, 'opt_state'),
    )
    root = str(tmp_path / f'{data}x{pipe}x{tensor}')
    checkpointer = checkpoints.Checkpointer(root, 1, 1, layout)
    progress = Progress(iteration=5)
    checkpointer.save(
      state,
      progress,
      cfg,
      checkpoints.make_meta(
        cfg, progress, cfg.train.seed, {'iteration': 0, 'skipped_iterations': 0}
      ),
    )
    checkpointer.close()
    return root, layout

  for saved_on, restored_on in pairs:
    root, save_layout = save(*saved_on)
    cfg, layout = mesh_layout(*restored_on)
    assert save_layout.is_padded or layout.is_padded
    if 'hidden_size' in model:  # the checkpoint copy: split over part of data, not whole
      ln = (save_layout if saved_on[0] == 4 else layout).canonical.params['layers']['ln1']['scale']
      assert ln.sharding.shard_shape(ln.shape) == (2, 27)
    state, _ = checkpoints.restore(root, layout, cfg)
    # Restored straight into the padded storage shapes and their shardings.
    assert all(
      jax.tree.leaves(
        jax.tree.map(
          lambda a, want: a.shape == want.shape and a.sharding == want.sharding,
          state,
          layout.abstract,
        )
      )
    )
    for which in ('params', 'opt_state'):
      jax.tree.map(
        np.testing.assert_array_equal,
        jax.device_get(layout.to_canonical(getattr(state, which), which)),
        getattr(canonical, which),
      )  # bitwise


def test_zero1_start_up_line_names_what_stays_replicated_over_data():
  cfg = small_config(mesh=dict(data=3, tensor=2), train=dict(global_batch_size=6))
  line = describe_zero(make_layout(cfg, partitioning.make_mesh(3, 1, 2)))
  assert 'split over data=3' in line
  assert line.endswith("replicated over data: ['layers']['mlp']['wi_bias']")
  assert "['word_embeddings']" in line  # padded: 1,024 rows / tensor 2 = 512, not a multiple of 3
  line = describe_zero(make_layout(small_config(), partitioning.make_mesh(1, 1, 1)))
  assert line == '> ZeRO-1: mesh.data is 1, nothing to split'


def test_never_save_keeps_the_named_values_out_of_any_policy():
  """`never_save(names, policy)` saves no value named in `names`, whatever `policy` (or, with
  none, everything else) saves; jax 0.10.2's save_anything_except_these_names saved them all."""
  from jax.ad_checkpoint import checkpoint_name

  def named(name):
    (eqn,) = jax.make_jaxpr(lambda x: checkpoint_name(x, name))(1.0).eqns
    return eqn.primitive, eqn.params

  keep_both = jax.checkpoint_policies.save_only_these_names('weights', 'activations')
  for policy in (None, keep_both):
    saveable = partitioning.never_save(['weights'], policy)
    primitive, params = named('weights')
    assert not saveable(primitive, **params)
    primitive, params = named('activations')
    assert saveable(primitive, **params)
