"""Pipeline parallelism: layer placement, layout conversion, parity with one device, ramp-up."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_draws_its_own_dropout_masks,
  program_loops,
  run_steps,
  small_config,
)
from test_trainer import corpus_config
from test_zero3 import device_groups, instructions, loop_computations

from t5x_like.checkpointing import checkpoints
from t5x_like.config import ConfigError, TrainConfig
from t5x_like.mesh import partitioning
from t5x_like.parallel import pipeline
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import schedule, startup
from t5x_like.training import step as step_lib
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics


def assert_trains_as_reference(cfg, results, reference):
  """Losses, grad norms and params (the pipeline's storage order, put back in canonical order) of
  `run_steps(cfg)` equal the single-device run's within fp32 tolerance."""
  losses, norms, params = results
  ref_losses, ref_norms, ref_params = reference
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  canonical = pipeline.to_canonical(pipeline.placement_for(cfg), params)

  def same(a, b):
    # ZeRO's padding (a `data` that divides no dim) stays zero; the rest is the reference's.
    a = np.asarray(a)
    real = tuple(slice(0, n) for n in b.shape)
    np.testing.assert_allclose(a[real], b, rtol=1e-4, atol=2e-5)
    padding = a.copy()
    padding[real] = 0
    assert not padding.any()

  jax.tree.map(same, canonical, ref_params)


def test_bloom_176b_plan_puts_five_layers_on_the_end_stages():
  placement = pipeline.place_layers(70, 12)
  assert placement.chunk == 6 and placement.num_slots == 72
  assert placement.layers_per_stage() == [5] + [6] * 10 + [5]  # as the original run balanced it
  assert 'costing 2.8%' in placement.describe()
  assert sorted(placement.storage_slots[placement.storage_slots >= 0]) == list(range(70))


def test_circular_plan_interleaves_chunks_over_stages():
  placement = pipeline.place_layers(8, 2, repeats=2)
  # Chunk c = r * P + s runs on stage s: stage 0 holds layers 0-1 and 4-5.
  assert placement.slot_layer[0].tolist() == [[0, 1], [4, 5]]
  assert placement.slot_layer[1].tolist() == [[2, 3], [6, 7]]
  assert placement.bubble_fraction(4) == pytest.approx(1 / 9)
  assert pipeline.place_layers(8, 2).bubble_fraction(4) == pytest.approx(1 / 5)


def test_storage_layout_round_trips():
  placement = pipeline.place_layers(5, 2)
  tree = {
    'layers': {'w': np.arange(5 * 3, dtype=np.float32).reshape(5, 3)},
    'word_embeddings': np.ones((4, 3), np.float32),
  }
  stored = pipeline.to_storage(placement, tree)
  assert stored['layers']['w'].shape == (6, 3)
  padding = placement.storage_slots < 0
  assert padding.sum() == 1 and float(np.abs(stored['layers']['w'][padding]).max()) == 0.0
  back = pipeline.to_canonical(placement, stored)
  np.testing.assert_array_equal(back['layers']['w'], tree['layers']['w'])
  np.testing.assert_array_equal(back['word_embeddings'], tree['word_embeddings'])


@pytest.mark.parametrize(
  'changes, message',
  [
    (dict(train=dict(global_batch_size=2)), 'fewer than the 4 pipeline stages'),
    (dict(pipeline=dict(repeats=3)), 'exceeds model.num_layers'),
    (dict(model=dict(num_layers=10), pipeline=dict(repeats=2)), 'does not fit 10 layers'),
    (dict(mesh=dict(pipeline=8)), 'exceeds model.num_layers'),
    (dict(train=dict(rampup_batch_size=(4, 3, 100))), 'multiple of the increment'),
    (dict(train=dict(rampup_batch_size=(2, 2, 100))), 'fewer than the 4 pipeline stages'),
  ],
)
def test_bad_pipeline_settings_are_clear_errors(changes, message):
  base = dict(mesh=dict(pipeline=4), model=dict(num_layers=4), train=dict(global_batch_size=8))
  for section, values in changes.items():
    base.setdefault(section, {}).update(values)
  with pytest.raises(ConfigError) as info:
    startup.check_config(small_config(**base))
  assert message in str(info.value)


def test_megatron_batch_size_rampup():
  t = TrainConfig(global_batch_size=2048, rampup_batch_size=(192, 16, 9_765_625))
  per_increment = 9_765_625 / 116
  assert schedule.global_batch_size_at(t, 0) == 192
  assert schedule.global_batch_size_at(t, int(per_increment) - 1) == 192
  assert schedule.global_batch_size_at(t, int(per_increment) + 1) == 208
  assert schedule.global_batch_size_at(t, 9_765_625) == 2048
  assert schedule.global_batch_size_at(t, 9_765_626) == 2048
  sizes = schedule.ramp_batch_sizes(t)
  assert sizes[:3] == [192, 208, 224] and sizes[-1] == 2048


@pytest.fixture(scope='module')
def references():
  """Single-device runs the pipelined runs must equal (4 and 5 layers, global batch 4)."""
  return {
    layers: run_steps(
      small_config(model=dict(num_layers=layers), train=dict(global_batch_size=4)), num_steps=3
    )
    for layers in (4, 5)
  }


@pytest.mark.parametrize(
  'data, stages, tensor, repeats, layers, remat',
  [
    (1, 2, 1, 1, 4, 'none'),  # M = 2P
    (1, 4, 1, 1, 4, 'save_dots'),  # M = P
    (2, 2, 2, 1, 4, 'full'),  # M = P, composed with data and tensor
    (1, 2, 1, 2, 4, 'none'),  # circular, M = 2P
    (1, 2, 4, 2, 4, 'full'),  # circular with tensor parallelism
    (1, 2, 1, 1, 5, 'none'),  # uneven depth: one padding slot
    # The chunked vocabulary-parallel cross-entropy as the head, under full recomputation (the
    # head then runs under a cond inside the tick's custom VJP).
    (1, 2, 2, 1, 4, 'chunked'),
    # Each stage's 2 layers unrolled (model.unroll_layers), keeping the matmul outputs.
    (1, 2, 1, 1, 4, 'unrolled'),
    # The chunked loss without the tick-level recomputation: the head's checkpoint keeps the
    # loss's log-sum-exp, so its backward pass does not run the vocabulary loop twice.
    (1, 2, 2, 1, 4, 'chunked-save-dots'),
  ],
)
def test_pipelined_run_matches_single_device(
  references, data, stages, tensor, repeats, layers, remat
):
  model = dict(num_layers=layers, remat_policy=remat)
  if remat == 'chunked':
    model.update(remat_policy='full', cross_entropy_impl='chunked', cross_entropy_chunk=256)
  if remat == 'unrolled':
    model.update(remat_policy='save_dots', unroll_layers=True)
  if remat == 'chunked-save-dots':
    model.update(remat_policy='save_dots', cross_entropy_impl='chunked', cross_entropy_chunk=64)
  cfg = small_config(
    model=model,
    train=dict(global_batch_size=4),
    mesh=dict(data=data, pipeline=stages, tensor=tensor),
    pipeline=dict(repeats=repeats),
  )
  losses, norms, params = run_steps(cfg, num_steps=3)
  ref_losses, ref_norms, ref_params = references[layers]
  assert_trains_as_reference(cfg, (losses, norms, params), (ref_losses, ref_norms, ref_params))
  if remat not in ('unrolled', 'chunked-save-dots'):
    return
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  text = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()
  loops = program_loops(text)
  if remat == 'unrolled':
    # No loop over a stage's layers is left: only the ticks' (M + P - 1 = 5 trips, forward and
    # backward); scanned, the stage's 2 layers are loops of 2 trips too.
    assert [trips for _, trips in loops] == [5, 5]
  else:
    # The vocabulary loop (a shard's 1024 / (2 x 2) rows in chunks of 64: 4 trips) in the
    # head's forward and backward passes, and not in the backward pass's recomputation of the
    # head's forward.
    vocabulary = [name for name, trips in loops if trips == 4]
    assert any('transpose(jvp' in name for name in vocabulary)
    assert any('transpose(jvp' not in name for name in vocabulary)
    assert not any('rematted_computation' in name for name in vocabulary)


@pytest.mark.parametrize(
  'data, stages, tensor, repeats, remat',
  [
    (2, 1, 1, 1, 'save_dots'),  # no pipeline: the padding micro-batches are skipped
    (1, 2, 1, 1, 'none'),  # the ticks after the last real micro-batch are skipped
    (1, 2, 2, 1, 'full'),  # the same under the tick-level recomputation
    (1, 2, 1, 2, 'save_dots'),  # circular: the first repeat computes the padding
  ],
)
def test_padding_micro_batches_change_no_loss_gradient_or_update(
  references, data, stages, tensor, repeats, remat
):
  """train.rampup_microbatch_multiple: a step given 2 micro-batches of padding after its 4
  trains exactly as the single-device step on the 4 alone."""
  cfg = small_config(
    model=dict(num_layers=4, remat_policy=remat),
    train=dict(global_batch_size=4, rampup_batch_size=(2, 2, 4), rampup_microbatch_multiple=2),
    mesh=dict(data=data, pipeline=stages, tensor=tensor),
    pipeline=dict(repeats=repeats),
  )
  losses, norms, params = run_steps(cfg, num_steps=3, padding_microbatches=2)
  ref_losses, ref_norms, ref_params = references[4]
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  if stages > 1:
    params = pipeline.to_canonical(pipeline.placement_for(cfg), params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params, ref_params
  )


def test_vocabulary_split_over_tensor_only_as_bloom_176b_matches_single_device():
  """BLOOM-176B's layout: 250,880 rows do not divide over tensor 4 x pipeline 12, so the tied
  embedding is split over `tensor` only and replicated over the stages. The first stage's
  embedding gradient and the last stage's logits gradient must then add up on every stage, the
  tied-embedding reduction whose absence gave the chronicles' restart spike."""
  model = dict(num_layers=4, pad_vocab_size_to=1002)  # 1002 = 2 x 501: tensor 2, not 2 x 2
  cfg = small_config(
    model=model, train=dict(global_batch_size=4), mesh=dict(data=1, pipeline=2, tensor=2)
  )
  layout = make_layout(cfg, partitioning.make_mesh(1, 2, 2))
  embedding_spec = layout.shardings.params['word_embeddings'].spec
  assert embedding_spec == jax.sharding.PartitionSpec('tensor', None)
  losses, norms, params = run_steps(cfg, num_steps=3)
  ref_losses, ref_norms, ref_params = run_steps(
    small_config(model=model, train=dict(global_batch_size=4)), num_steps=3
  )
  assert_trains_as_reference(cfg, (losses, norms, params), (ref_losses, ref_norms, ref_params))


def collectives_across_data(cfg):
  """(layout, {('loop' or 'outside', op): result shapes}) of the compiled train step's
  collectives whose groups span data ranks, by whether they run inside a while loop (the
  schedule's ticks and the layers in them) or not."""
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  hlo = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()
  mesh = layout.mesh
  data_rank = {
    mesh.devices[index].id: index[mesh.axis_names.index('data')]
    for index in np.ndindex(mesh.devices.shape)
  }
  inside = loop_computations(hlo)
  places = collections.defaultdict(list)
  for computation, line in instructions(hlo):
    found = re.search(r'= (.+?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(', line)
    if found and 'replica_groups=' in line:
      if any(len({data_rank[d] for d in group}) > 1 for group in device_groups(line)):
        place = 'loop' if computation in inside else 'outside'
        places[place, found.group(2)] += re.findall(r'[a-z]\d+\[[\d,]*\]', found.group(1))
  return layout, places


@pytest.mark.parametrize('schedule_name', ['gpipe', '1f1b', 'no_pipeline'])
def test_grad_sync_step_crosses_the_data_ranks_once_a_step(schedule_name):
  """pipeline.grad_sync='step': each data rank runs its own schedule (or micro-batch loop) and
  adds its micro-batches' gradients up on its own. Inside the loops only each micro-batch's
  target count (a scalar) crosses the data ranks (without a pipeline nothing at all); after the
  loop each param's gradient is reduce-scattered once, each device its own pipeline and tensor
  block. Under 'tick' (one schedule or loop over all the ranks) XLA all-reduces each layer's
  gradient over them at every tick (with a pipeline) or micro-batch (without)."""
  stages = 1 if schedule_name == 'no_pipeline' else 2
  order = {} if stages == 1 else dict(schedule=schedule_name)
  base = dict(
    model=dict(num_layers=4),
    train=dict(global_batch_size=16, micro_batch_size=2),
    mesh=dict(data=2, pipeline=stages, tensor=1),
  )
  cfg = small_config(**base, pipeline=dict(order, grad_sync='step')).validate()
  layout, places = collectives_across_data(cfg)
  assert set(places['loop', 'all-reduce']) <= {'f32[]'}, places
  assert not places['loop', 'all-gather'] and not places['loop', 'reduce-scatter']
  scattered = collections.Counter(places['outside', 'reduce-scatter'])
  # Each param's gradient: its stage's (pipeline-split) block, halved over `data` on the dim
  # that ZeRO splits over it.
  for param, sharding in zip(
    jax.tree.leaves(layout.logical.params), jax.tree.leaves(layout.shardings.params)
  ):
    shape = f'f32[{",".join(map(str, sharding.shard_shape(param.shape)))}]'
    assert scattered[shape] >= 1, (shape, scattered)
  if schedule_name != 'gpipe':
    tick = small_config(**base, pipeline=dict(order, grad_sync='tick')).validate()
    in_loop = collectives_across_data(tick)[1]['loop', 'all-reduce']
    # A layer's QKV bias gradient at each tick, or in each micro-batch's layer loop.
    assert ('f32[1,8,3,8]' if stages > 1 else 'f32[8,3,8]') in in_loop, in_loop


@pytest.mark.parametrize(
  'mesh, pipeline, train',
  [
    (dict(data=2, pipeline=2, tensor=2), {}, {}),
    (dict(data=2, pipeline=2), dict(repeats=2), {}),
    (dict(data=2, pipeline=2), dict(schedule='1f1b'), {}),
    (dict(data=2, pipeline=2, tensor=2), dict(microbatch_group=2), dict(global_batch_size=8)),
    (dict(data=4, pipeline=2, zero_group=2), {}, dict(global_batch_size=8)),
    (
      dict(data=2, pipeline=2),
      dict(schedule='1f1b'),
      dict(rampup_batch_size=(2, 2, 4), rampup_microbatch_multiple=2),
    ),
    # data 3 divides no dim of the small model: ZeRO pads, and each gradient is summed whole.
    (dict(data=3, pipeline=2), {}, dict(global_batch_size=6)),
    (dict(data=2, tensor=2), {}, {}),
    (dict(data=4, zero_group=2), {}, dict(global_batch_size=8)),
    (dict(data=2), {}, dict(rampup_batch_size=(2, 2, 4), rampup_microbatch_multiple=2)),
    (dict(data=3), {}, dict(global_batch_size=6)),
  ],
  ids=[
    'gpipe_2x2x2',
    'circular_2x2x1',
    '1f1b_2x2x1',
    'groups_2x2x2',
    'hybrid_4x2x1',
    '1f1b_padding',
    'zero_padded_3x2x1',
    'no_pipeline_2x1x2',
    'no_pipeline_hybrid_4x1x1',
    'no_pipeline_padding',
    'no_pipeline_zero_padded_3x1x1',
  ],
)
def test_grad_sync_step_trains_as_one_device(references, reference_batch_8, mesh, pipeline, train):
  """pipeline.grad_sync='step' (each data rank's own schedule or micro-batch loop, its
  gradients summed once a step): the same losses, gradient norms and params as one device, in
  GPipe (and circular) and 1F1B and without a pipeline, with groups of micro-batches, hybrid
  sharding's copies, the ramp-up's padding micro-batches and ZeRO's padding."""
  cfg = small_config(
    model=dict(num_layers=4, remat_policy='full'),
    train=dict(dict(global_batch_size=4), **train),
    mesh=mesh,
    pipeline=dict(pipeline, grad_sync='step'),
  )
  padding = 2 if 'rampup_batch_size' in train else 0
  results = run_steps(cfg, num_steps=3, padding_microbatches=padding)
  batch = cfg.train.global_batch_size
  reference = {4: references[4], 8: reference_batch_8}.get(batch) or run_steps(
    small_config(
      model=dict(num_layers=4, remat_policy='full'), train=dict(global_batch_size=batch)
    ),
    num_steps=3,
  )
  assert_trains_as_reference(cfg, results, reference)


@pytest.mark.parametrize('stages', [1, 2], ids=['no_pipeline', 'pipeline'])
@pytest.mark.parametrize('dropout', [0.0, 0.1])
def test_grad_sync_step_with_dropout_draws_each_ranks_own_masks(dropout, stages):
  """Two data ranks given the same rows: with the masks drawn from one key they would train
  exactly as one rank on those rows (the same local shapes, the same keys). Each rank folds its
  index into the key, so with dropout their masks, and the first gradient norm (2% apart; the
  untrained model's loss moves by less than 1e-4), differ from the one rank's; without dropout
  the two runs are the same."""
  model = dict(num_layers=2, hidden_dropout=dropout, attention_dropout=dropout)
  rows = np.random.default_rng(0).integers(0, 256, (2, 17))  # 2 micro-batches of 1 row
  one = small_config(
    model=model, train=dict(global_batch_size=2, micro_batch_size=1), mesh=dict(pipeline=stages)
  )
  two = small_config(
    model=model,
    train=dict(global_batch_size=4, micro_batch_size=1),
    mesh=dict(data=2, pipeline=stages),
    pipeline=dict(grad_sync='step'),
  )
  assert one.train.seq_len == 16
  one_rank = run_steps(one, num_steps=1, tokens=rows)[1]
  both_ranks = run_steps(two, num_steps=1, tokens=np.repeat(rows, 2, axis=0))[1]
  assert_draws_its_own_dropout_masks(both_ranks, one_rank, dropout)


@pytest.mark.parametrize(
  'stages, zero_stage, group, sync, says',
  [
    (2, 1, 0, 'auto', "summed once a step (pipeline.grad_sync 'step'"),
    (2, 1, 0, 'tick', "all-reduced at every tick (pipeline.grad_sync 'tick')"),
    (2, 3, 0, 'auto', "all-reduced at every tick (pipeline.grad_sync 'tick')"),
    (
      2,
      3,
      2,
      'auto',
      "(pipeline.grad_sync 'tick'), within each of the 2 hybrid copies, whose sums",
    ),
    (1, 1, 0, 'step', "summed once a step (pipeline.grad_sync 'step'"),
    (1, 1, 0, 'auto', 'reduce-scattered into the split accumulator at every micro-batch'),
    (1, 3, 2, 'auto', "every micro-batch (pipeline.grad_sync 'tick'), within each of the 2"),
  ],
)
def test_the_start_up_log_says_when_the_data_ranks_gradients_are_summed(
  stages, zero_stage, group, sync, says
):
  """The pipeline's line says it, and without a pipeline a line of its own."""
  cfg = small_config(
    mesh=dict(data=2 + group, pipeline=stages, zero_stage=zero_stage, zero_group=group),
    pipeline=dict(grad_sync=sync),
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  lines = startup.schedule_lines(cfg, layout)
  described = [line for line in lines if says in line]
  assert described and described[0].startswith('> pipeline:' if stages > 1 else '> gradients:')
  assert ('hybrid copies' in described[0]) == bool(group)


@pytest.mark.parametrize('stages', [1, 2])
def test_grad_sync_step_under_zero3_is_a_config_error(stages):
  with pytest.raises(ConfigError, match=r"pipeline.grad_sync='step' needs mesh.zero_stage=1"):
    small_config(
      mesh=dict(data=2, pipeline=stages, zero_stage=3), pipeline=dict(grad_sync='step')
    ).validate()


@pytest.mark.parametrize('remat_policy', ['save_dots', 'full'])
def test_bf16_pipeline_reads_gathered_bf16_weights_and_matches_single_device(remat_policy):
  """In bf16 the stages compute from the gathered bf16 copy (`step.compute_bits_of`) and send
  each tick's gradient to the fp32 master params (`pipeline.compute_copy`): the same losses and
  gradient norms as the single device, whose micro-batch gradients are bf16 added up in fp32."""
  base = dict(
    model=dict(num_heads=4, dtype='bfloat16', remat_policy=remat_policy),
    train=dict(global_batch_size=16),
  )
  cfg = small_config(**base, mesh=dict(data=2, pipeline=2, tensor=1))
  losses, norms, _ = run_steps(cfg, num_steps=2)
  ref_losses, ref_norms, _ = run_steps(small_config(**base), num_steps=2)
  # Each data rank runs its own rows (pipeline.grad_sync 'step': bf16 matmuls of another shape
  # than the one device's) and sums its own targets' losses: 1.6e-6 apart.
  np.testing.assert_allclose(losses, ref_losses, rtol=3e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=5e-5)


def test_compute_copy_computes_from_the_copy_and_widens_the_gradient_to_the_master():
  master = jnp.asarray([1.0, 2.0, 3.0], jnp.float32)
  bits = pipeline.as_bits(master, jnp.bfloat16)
  assert bits.dtype == jnp.uint16
  value, grad = jax.value_and_grad(
    lambda m: (pipeline.compute_copy(m, bits, jnp.bfloat16) ** 2).sum()
  )(master)
  assert value.dtype == jnp.bfloat16 and float(value) == 14.0
  assert grad.dtype == jnp.float32
  np.testing.assert_array_equal(grad, [2.0, 4.0, 6.0])


def test_full_recomputation_keeps_bf16_inputs_as_bits_and_matches_autodiff():
  """The tick-level recomputation of remat_policy='full' (a custom VJP): the same value and
  gradients as plain autodiff, and bf16 inputs kept for the backward pass as uint16 bits."""

  def tick(w, x, scale, t):
    y = jnp.tanh(x.astype(jnp.float32) @ w) * scale[t]
    return y.astype(x.dtype), (y**2).sum()

  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(4, 16)), jnp.bfloat16)
  scale, t = jnp.asarray([0.5, 2.0], jnp.float32), jnp.int32(1)
  recomputed = pipeline.recompute_in_backward(tick, jnp.bfloat16)
  want, want_vjp = jax.vjp(tick, w, x, scale, t)
  got, got_vjp = jax.vjp(recomputed, w, x, scale, t)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  cotangents = (jnp.ones((4, 8), jnp.bfloat16), jnp.float32(1.5))
  for g, e in zip(got_vjp(cotangents)[:3], want_vjp(cotangents)[:3]):
    assert g.dtype == e.dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), rtol=1e-6)
  kept = [leaf for leaf in jax.tree.leaves(got_vjp) if getattr(leaf, 'shape', None) == x.shape]
  assert [leaf.dtype for leaf in kept] == [jnp.uint16]
  np.testing.assert_array_equal(jax.lax.bitcast_convert_type(kept[0], jnp.bfloat16), x)


def test_full_recomputation_with_dropout_matches_keeping_every_activation():
  """With dropout on, the tick recomputed in the backward pass must draw the same masks as its
  forward pass: 'full' then trains exactly like 'none' (same rng streams, nothing recomputed)."""
  runs = {}
  for remat in ('none', 'full'):
    cfg = small_config(
      model=dict(num_layers=2, remat_policy=remat, hidden_dropout=0.1, attention_dropout=0.1),
      train=dict(global_batch_size=4),
      mesh=dict(pipeline=2),
    )
    runs[remat] = run_steps(cfg, num_steps=2)
  losses, norms, params = runs['full']
  ref_losses, ref_norms, ref_params = runs['none']
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), params, ref_params
  )


def test_checkpoint_saved_with_two_stages_restores_with_four_one_and_two_repeats(tmp_path):
  saved_cfg = corpus_config(
    model=dict(num_layers=4),
    mesh=dict(data=1, pipeline=2, tensor=1),
    train=dict(steps=2, global_batch_size=8, micro_batch_size=2),
  )
  trainer = Trainer(saved_cfg, str(tmp_path / 'run'))
  trainer.run()
  root = str(tmp_path / 'run' / 'checkpoints')
  want = jax.device_get(trainer.layout.to_canonical(trainer.final_state.params, 'params'))
  assert want['layers']['mlp']['wi_kernel'].shape[0] == 4
  for mesh, repeats in [((1, 4, 1), 1), ((1, 1, 1), 1), ((1, 2, 1), 2), ((2, 1, 2), 1)]:
    cfg = saved_cfg.replace(
      mesh=dict(zip(('data', 'pipeline', 'tensor'), mesh)), pipeline={'repeats': repeats}
    )
    layout = make_layout(cfg, partitioning.make_mesh(*mesh))
    state, progress = checkpoints.restore(root, layout, cfg)
    got = jax.device_get(layout.to_canonical(state.params, 'params'))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    assert progress.iteration == 2


@pytest.fixture(scope='module')
def ramp_run(tmp_path_factory):
  """A pipelined run through a batch ramp-up: 2 micro-batches, then 4."""
  cfg = corpus_config(
    model=dict(num_layers=2),
    mesh=dict(data=1, pipeline=2, tensor=1),
    train=dict(steps=4, global_batch_size=8, micro_batch_size=2, rampup_batch_size=(4, 4, 8)),
  )
  workdir = tmp_path_factory.mktemp('ramp')
  trainer = Trainer(cfg, str(workdir))
  trainer.run()
  return cfg, workdir, trainer


def test_rampup_changes_the_micro_batch_count_and_compiles_once_per_shape(ramp_run):
  _, tmp_path, trainer = ramp_run
  records = read_metrics(str(tmp_path))
  assert [r['global_batch_size'] for r in records] == [4, 4, 8, 8]
  assert [r['consumed_samples'] for r in records] == [4, 8, 16, 24]
  assert [round(r['pipeline_bubble'], 3) for r in records] == [0.333, 0.333, 0.2, 0.2]
  # One compiled step per (micro-batch count, sequence length).
  assert sorted(trainer.steps.programs) == [
    (2, trainer.cfg.train.seq_len + 1),
    (4, trainer.cfg.train.seq_len + 1),
  ]
  log = open(tmp_path / 'logs' / 'main_log.txt').read()
  assert log.count('compiled the train step') == 2 and 'pipeline bubble: 0.200' in log
  assert '> the train step runs at 2 shapes over the run' in log
  assert 'parameters per stage' in log


def test_rampup_padded_to_the_full_micro_batch_count_compiles_once_and_trains_the_same(
  ramp_run, tmp_path
):
  """train.rampup_microbatch_multiple=4: the ramp-up's 2 micro-batches run as 4, two of them
  padding that the pipeline computes and the loss leaves out: one compiled step instead of two,
  and the losses and gradient norms of the unpadded run."""
  cfg, exact_workdir, _ = ramp_run
  trainer = Trainer(cfg.replace(train={'rampup_microbatch_multiple': 4}), str(tmp_path))
  trainer.run()
  exact, records = read_metrics(str(exact_workdir)), read_metrics(str(tmp_path))
  assert [r['padded_microbatches'] for r in records] == [4, 4, 4, 4]
  for key in ('global_batch_size', 'consumed_samples', 'learning_rate'):
    assert [r[key] for r in records] == [r[key] for r in exact], key
  for key in ('lm_loss', 'grad_norm'):
    assert [r[key] for r in records] == pytest.approx([r[key] for r in exact], rel=2e-5), key
  assert sorted(trainer.steps.programs) == [(4, cfg.train.seq_len + 1)]
  log = open(tmp_path / 'logs' / 'main_log.txt').read()
  assert '> the train step runs at 1 shapes over the run' in log
  # Iterations 1-2 run 2 padding micro-batches each: 4 of the run's 16.
  assert (
    "> ramp-up: micro-batch counts rounded up to multiples of 4, 4 of the run's 16 "
    'micro-batches (25.00%) padding (the pipeline computes them)'
  ) in log


# ------------------------------------------------------- pipeline.microbatch_group (issue 22)


@pytest.fixture(scope='module')
def reference_batch_8():
  """The single-device run that (2, 2, 2) with 4 micro-batches of 2 rows must equal."""
  return run_steps(
    small_config(model=dict(num_layers=4), train=dict(global_batch_size=8)), num_steps=3
  )


@pytest.mark.parametrize(
  'data, stages, tensor, repeats, remat',
  [
    (1, 2, 1, 1, 'none'),  # M = 2P in two groups of P
    (1, 2, 1, 2, 'save_dots'),  # circular: each group loops twice
    (2, 2, 2, 1, 'full'),  # composed with data and tensor, tick-level recomputation
  ],
)
def test_grouped_pipeline_matches_single_device(
  references, reference_batch_8, data, stages, tensor, repeats, remat
):
  """pipeline.microbatch_group = P: the schedule runs twice per step, over 2 micro-batches each,
  and the step trains exactly as one device on all of them."""
  batch = 4 * data
  cfg = small_config(
    model=dict(num_layers=4, remat_policy=remat),
    train=dict(global_batch_size=batch),
    mesh=dict(data=data, pipeline=stages, tensor=tensor),
    pipeline=dict(repeats=repeats, microbatch_group=stages),
  )
  assert startup.check_config(cfg).num_microbatches == 2 * stages
  losses, norms, params = run_steps(cfg, num_steps=3)
  ref_losses, ref_norms, ref_params = references[4] if data == 1 else reference_batch_8
  assert_trains_as_reference(cfg, (losses, norms, params), (ref_losses, ref_norms, ref_params))


def test_grouped_pipeline_weights_a_partly_padded_group_by_its_real_micro_batches(references):
  """A ramp-up step of 4 real micro-batches padded to 6 (train.rampup_microbatch_multiple=6, a
  ramp from 4 to 6 micro-batches) in groups of 3: the groups hold 3 and 1 real micro-batches,
  and the step's loss and gradients are still the mean over the 4, as on one device."""
  ramp = dict(global_batch_size=6, rampup_batch_size=(4, 2, 8), rampup_microbatch_multiple=6)
  legal = small_config(
    model=dict(num_layers=4), train=ramp, mesh=dict(pipeline=2), pipeline=dict(microbatch_group=3)
  )
  startup.check_config(legal)
  assert schedule.step_microbatches(legal, 4) == 6
  cfg = legal.replace(train=dict(global_batch_size=4))  # run_steps fills 4, pads 2
  losses, norms, params = run_steps(cfg, num_steps=3, padding_microbatches=2)
  ref_losses, ref_norms, ref_params = references[4]
  assert_trains_as_reference(cfg, (losses, norms, params), (ref_losses, ref_norms, ref_params))


@pytest.mark.parametrize(
  'changes, message',
  [
    (dict(pipeline=dict(microbatch_group=1)), 'fewer than the 2 pipeline stages'),
    (
      dict(pipeline=dict(microbatch_group=3)),
      "does not divide the step's micro-batch count(s) [8]",
    ),
    (dict(train=dict(rampup_batch_size=(4, 2, 100))), 'count(s) [6]'),
    (dict(mesh=dict(pipeline=1)), 'and mesh.pipeline is 1'),
  ],
)
def test_bad_microbatch_group_is_one_clear_error(changes, message):
  base = dict(
    mesh=dict(pipeline=2),
    model=dict(num_layers=4),
    train=dict(global_batch_size=8),
    pipeline=dict(microbatch_group=4),
  )
  for section, values in changes.items():
    base.setdefault(section, {}).update(values)
  with pytest.raises(ConfigError) as info:
    startup.check_config(small_config(**base))
  assert message in str(info.value)
  if changes.get('mesh') is None:
    assert 'groups that fit: [2' in str(info.value)


def test_grouped_bubble_counts_each_groups_fill_and_drain():
  placement = pipeline.place_layers(8, 4)
  assert placement.bubble_fraction(8) == pytest.approx(3 / 11)
  assert placement.bubble_fraction(8, microbatch_group=4) == pytest.approx(3 / 7)
  assert pipeline.place_layers(8, 2, repeats=2).bubble_fraction(8, 2) == pytest.approx(1 / 5)


def test_grouped_step_keeps_fewer_stage_inputs():
  """64 micro-batches in groups of 2 keep 3 ticks of stage inputs instead of 65: XLA's compiled
  temporaries shrink by about the difference (the stage inputs dominate them here)."""
  from t5x_like.training.step import lower_train_step

  temp = {}
  for group in (0, 2):
    cfg = startup.check_config(
      small_config(
        model=dict(num_layers=2, remat_policy='full'),
        train=dict(global_batch_size=64, seq_len=128),
        mesh=dict(pipeline=2),
        pipeline=dict(microbatch_group=group),
      )
    )
    layout = make_layout(cfg, partitioning.make_mesh(1, 2, 1))
    compiled = lower_train_step(cfg, layout, cfg.num_microbatches).compile()
    temp[group] = compiled.memory_analysis().temp_size_in_bytes
  # One stage per device: (65 - 3) ticks x 128 x 64 fp32 = 1.94 MiB fewer kept stage inputs,
  # less the groups' gradient accumulator.
  saved_stage_inputs = (65 - 3) * 128 * 64 * 4
  assert temp[0] - temp[2] > saved_stage_inputs / 2, temp


@pytest.mark.parametrize(
  'data, stages, tensor, layers, model',
  [
    (1, 2, 1, 4, dict(remat_policy='none')),  # M = 2P
    (1, 4, 1, 4, dict(remat_policy='save_dots')),  # M = P
    # Composed with data and tensor: each data rank its own schedule, the vocabulary over
    # tensor x pipeline, and the fused cross-entropy (its gradient in the forward pass, used at
    # once by the head's backward in the same tick).
    (2, 2, 2, 4, dict(remat_policy='full', cross_entropy_impl='fused', cross_entropy_chunk=32)),
    (1, 2, 1, 5, dict(remat_policy='none')),  # uneven depth: one padding slot
    (
      1,
      2,
      2,
      4,
      dict(
        remat_policy='full',
        cross_entropy_impl='chunked',
        cross_entropy_chunk=256,
        sequence_parallel=True,
        num_heads=4,
      ),
    ),
  ],
)
def test_one_f_one_b_run_matches_single_device(references, data, stages, tensor, layers, model):
  """pipeline.schedule='1f1b': the hand-written backward (one scan, each tick a forward half,
  the head's forward and backward, and a backward half) trains exactly as the single device."""
  cfg = small_config(
    model=dict(num_layers=layers, **model),
    train=dict(global_batch_size=4),
    mesh=dict(data=data, pipeline=stages, tensor=tensor),
    pipeline=dict(schedule='1f1b'),
  )
  reference = references[layers]
  if 'num_heads' in model:
    reference = run_steps(
      small_config(model=dict(num_layers=layers, num_heads=4), train=dict(global_batch_size=4)),
      num_steps=3,
    )
  assert_trains_as_reference(cfg, run_steps(cfg, num_steps=3), reference)


def test_one_f_one_b_with_padding_micro_batches_and_dropout_matches_gpipe():
  """The ramp-up's padding micro-batches add no loss or gradient under 1F1B, and its dropout
  masks are GPipe's: each micro-batch's recomputed forward draws the masks of its forward."""
  runs = {}
  for order in ('gpipe', '1f1b'):
    cfg = small_config(
      model=dict(num_layers=4, hidden_dropout=0.1, attention_dropout=0.1),
      train=dict(global_batch_size=4, rampup_batch_size=(2, 2, 4), rampup_microbatch_multiple=2),
      mesh=dict(pipeline=2),
      pipeline=dict(schedule=order),
    )
    runs[order] = run_steps(cfg, num_steps=3, padding_microbatches=2)
  np.testing.assert_allclose(runs['1f1b'][0], runs['gpipe'][0], rtol=2e-6)
  np.testing.assert_allclose(runs['1f1b'][1], runs['gpipe'][1], rtol=2e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5),
    runs['1f1b'][2],
    runs['gpipe'][2],
  )


def kept_stage_input_stacks(hlo: str, rows: int, seq: int, hidden: int) -> set[tuple[int, ...]]:
  """Shapes of the compiled step's [.., kept, .., rows, seq, hidden] loop-carried stacks of stage
  inputs (rank 5: the stage dim, the kept dim, one micro-batch's activations)."""
  shape = re.compile(rf'\b(?:f32|bf16|u16)\[(\d+),(\d+),{rows},{seq},{hidden}\]')
  return {tuple(int(d) for d in m.groups()) for m in shape.finditer(hlo)}


def test_one_f_one_b_keeps_2p_minus_1_stage_inputs_whatever_the_micro_batch_count():
  """GPipe keeps one stage input per tick (M + P - 1 of them); 1F1B a ring of 2P - 1 per stage,
  whatever M: read from the compiled program's buffers."""
  from t5x_like.training.step import lower_train_step

  stacks = {}
  for order in ('gpipe', '1f1b'):
    cfg = startup.check_config(
      small_config(
        model=dict(num_layers=4, remat_policy='full'),
        train=dict(global_batch_size=32, seq_len=24),
        mesh=dict(pipeline=2),
        pipeline=dict(schedule=order),
      )
    )
    layout = make_layout(cfg, partitioning.make_mesh(1, 2, 1))
    hlo = lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()
    stacks[order] = kept_stage_input_stacks(hlo, 1, 24, 64)
  assert (33, 1) in stacks['gpipe']  # M + P - 1 = 33 ticks, one stage per device
  assert stacks['1f1b'] and all(33 not in shape for shape in stacks['1f1b']), stacks
  assert (1, 3) in stacks['1f1b'], stacks  # one stage per device, 2P - 1 = 3 slots


@pytest.mark.parametrize(
  'changes, message',
  [
    (dict(pipeline=dict(schedule='1f1b', repeats=2)), "'1f1b' runs one repeat"),
    (dict(pipeline=dict(schedule='1f1b', microbatch_group=2)), 'microbatch_group=0'),
  ],
)
def test_bad_one_f_one_b_settings_are_clear_errors(changes, message):
  cfg = small_config(model=dict(num_layers=4), mesh=dict(pipeline=2), **changes)
  with pytest.raises(ConfigError) as info:
    startup.check_config(cfg)
  assert message in str(info.value)


def recomputed_matmuls(schedule_name: str, remat_policy: str) -> collections.Counter:
  """The layer matmuls (einsum specs) that the compiled pipelined step's backward runs again
  inside a layer's recomputation (`rematted_computation` in their op names)."""
  cfg = small_config(
    model=dict(num_layers=4, remat_policy=remat_policy),
    train=dict(global_batch_size=4),
    mesh=dict(pipeline=2),
    pipeline=dict(schedule=schedule_name),
  )
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  hlo = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()
  names = re.findall(
    r'op_name="[^"]*rematted_computation/layers/\w+/([a-z,\->]+)/dot_general"', hlo
  )
  return collections.Counter(names)


@pytest.mark.parametrize(
  'schedule_name, remat_policy', [('1f1b', 'full'), ('gpipe', 'full'), ('1f1b', 'save_dots')]
)
def test_a_stages_backward_recomputes_no_matmul_that_save_dots_keeps(schedule_name, remat_policy):
  """The stages run vmapped over `pipeline`, which gives every matmul a batch dimension, so
  save_dots' rule (matmuls without batch dimensions) alone kept none of a layer's: each layer's
  backward ran QKV, the attention's output projection and h -> 4h again after the stage's
  forward had been recomputed (under 'full' 1F1B 2/3 of a forward's layer matmuls more per
  micro-batch; tr11: 14%). They are kept by name; only the scores' and the context's matmuls
  (batched over heads) are recomputed, as without a pipeline."""
  recomputed = recomputed_matmuls(schedule_name, remat_policy)
  assert recomputed, 'no recomputed matmul found: the op names have changed'
  kept = {'bse,encd->bsncd', 'bsnd,nde->bse', 'bse,ef->bsf', 'bsf,fe->bse'}
  assert not kept & set(recomputed), recomputed
