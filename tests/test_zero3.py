"""mesh.zero_stage=3 (fully sharded) and mesh.zero_group (hybrid sharding): training as one device
does, each layer's weights gathered inside the layer scan and never kept for the backward pass,
and checkpoints that move between ZeRO-1, ZeRO-3 and group sizes with the same next losses."""

import collections
import os
import re

import jax
import numpy as np
import pytest
from conftest import (
  assert_draws_its_own_dropout_masks,
  assert_same_training,
  config_with,
  run_steps,
  small_config,
)

from t5x_like.checkpointing import checkpoints
from t5x_like.config import ConfigError
from t5x_like.inference.loading import load_for_inference
from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import describe_zero, make_layout
from t5x_like.training import step as step_lib
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics


@pytest.fixture(scope='module')
def single_device_run():
  return run_steps(small_config(), num_steps=3)


@pytest.mark.parametrize(
  'mesh, model, pipeline',
  [
    ((8, 1, 1, 0), {}, {}),
    ((2, 1, 4, 0), dict(sequence_parallel=True), {}),
    ((2, 2, 2, 0), dict(remat_policy='full'), {}),
    ((2, 2, 2, 0), dict(remat_policy='full'), dict(schedule='1f1b')),
    ((8, 1, 1, 2), {}, {}),  # hybrid: 4 copies, each split over 2 data ranks
    ((4, 2, 1, 2), dict(remat_policy='save_dots'), {}),
  ],
  ids=['8x1x1', '2x1x4_sp', '2x2x2', '2x2x2_1f1b', '8x1x1_group2', '4x2x1_group2'],
)
def test_zero3_trains_as_one_device(single_device_run, mesh, model, pipeline):
  data, stages, tensor, group = mesh
  cfg = small_config(
    model=model,
    pipeline=pipeline,
    mesh=dict(data=data, pipeline=stages, tensor=tensor, zero_stage=3, zero_group=group),
  ).validate()
  assert_same_training(run_steps(cfg, num_steps=3), single_device_run, cfg)


def test_zero3_splits_8bit_adam_as_zero1_does():
  """adamw_8bit's quantised moments keep their blocks whole under ZeRO-3's split too: the
  losses and gradient norms of one device (as test_optim_8bit compares meshes: a summation order
  that moves a value across a quantisation boundary moves a few params by a code)."""
  sections = dict(optimizer=dict(name='adamw_8bit'), model=dict(hidden_size=256))
  ref_losses, ref_norms, _ = run_steps(small_config(**sections), num_steps=3)
  cfg = small_config(mesh=dict(data=4, tensor=2, zero_stage=3), **sections).validate()
  losses, norms, _ = run_steps(cfg, num_steps=3)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)


@pytest.mark.parametrize(
  'mesh, pipeline',
  [
    (dict(data=4, tensor=2), {}),
    (dict(data=4, pipeline=2), dict(grad_sync='tick')),
    (dict(data=4, pipeline=2), dict(grad_sync='tick', schedule='1f1b')),
  ],
  ids=['4x1x2', '4x2x1_tick', '4x2x1_tick_1f1b'],
)
def test_hybrid_zero1_trains_as_one_device(single_device_run, mesh, pipeline):
  """Hybrid ZeRO-1: the copies' micro-batch loops, or their schedules (each copy's data ranks
  summing at every tick, the copies once a step), train as one device. (Under 1F1B a scatter of
  the embedding's rows into the accumulator split over `data` made XLA's partitioner abort
  there.)"""
  cfg = small_config(mesh=dict(mesh, zero_group=2), pipeline=pipeline).validate()
  assert_same_training(run_steps(cfg, num_steps=3), single_device_run, cfg)


def test_hybrid_per_copy_loop_runs_the_fused_attention_kernels_as_one_device():
  """The Pallas kernels (interpret mode) inside the per-copy micro-batch loop of hybrid ZeRO-3
  on a tensor-parallel mesh: their shard_map nested in the one over `replica` trains as one
  device does (4 heads of 16: the kernels' smallest tile)."""
  model = dict(num_heads=4)
  reference = run_steps(small_config(model=model), num_steps=3)
  cfg = small_config(
    model=dict(model, attention_impl='pallas'),
    mesh=dict(data=4, tensor=2, zero_stage=3, zero_group=2),
  ).validate()
  assert_same_training(run_steps(cfg, num_steps=3), reference, cfg)


# ------------------------------------------------------------------------- the compiled step

LAYERS = 3


def compiled_step(zero_stage: int, zero_group: int = 0, microbatches: int = 1, stages: int = 1):
  """(layout, HLO text) of the train step of a 3-layer model on 8 data ranks (with `stages`
  pipeline stages: 8 / stages data ranks, 'tick' under ZeRO-1 too), compiled."""
  data = 8 // stages
  cfg = small_config(
    model=dict(num_layers=LAYERS if stages == 1 else 2 * stages),
    train=dict(global_batch_size=data * microbatches),
    mesh=dict(data=data, pipeline=stages, zero_stage=zero_stage, zero_group=zero_group),
    pipeline=dict(grad_sync='tick'),
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  return layout, step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()


def compiled_step_text(zero_stage: int, zero_group: int = 0) -> str:
  """The train step of a 3-layer model on 8 data ranks, compiled (its HLO text)."""
  return compiled_step(zero_stage, zero_group)[1]


def instructions(hlo: str):
  """(computation name, instruction line) of every instruction of the HLO text."""
  computation = None
  for line in hlo.splitlines():
    header = re.match(r'^(?:ENTRY )?%([\w.-]+) .*\{$', line)
    if header:
      computation = header.group(1)
    elif computation:
      yield computation, line


def collectives_by_place(hlo: str, op: str) -> dict[str, list[str]]:
  """The result shapes of every `op` (all-gather, ...) of the HLO text, by whether the
  computation it is in is a while loop's body ('loop') or not ('outside')."""
  bodies = set(re.findall(r'body=%([\w.-]+)', hlo))
  places: dict[str, list[str]] = collections.defaultdict(list)
  for computation, line in instructions(hlo):
    found = re.search(rf'= (\S+) {op}\(', line)
    if found:
      places['loop' if computation in bodies else 'outside'].append(found.group(1))
  return places


def while_carried_shapes(hlo: str) -> list[str]:
  """The shapes every while loop of the HLO text carries from one trip to the next (and out)."""
  shapes = []
  for carried in re.findall(r'= \((.*?)\) while\(', hlo):
    shapes += re.findall(r'[a-z0-9]+\[[0-9,]*\]', carried)
  return shapes


# The first layer param of the small model, qkv_kernel [layers, h, heads, 3, d], whole: the
# kernel the compute copy gathers under ZeRO-1 and the scan must not keep under ZeRO-3.
WHOLE_QKV = f'f32[{LAYERS},64,8,3,8]'


@pytest.fixture(scope='module')
def zero1_and_zero3_steps():
  return compiled_step_text(1), compiled_step_text(3)


def test_zero3_gathers_each_layer_inside_the_scan_not_the_whole_stack(zero1_and_zero3_steps):
  """ZeRO-1 gathers each stacked layer param whole ([L, ...]) once, before the layer scan;
  ZeRO-3 gathers one layer's slice ([1, ...]) in the scans' bodies (the forward's, and the
  backward's again), and nothing stacked."""
  zero1, zero3 = (collectives_by_place(hlo, 'all-gather') for hlo in zero1_and_zero3_steps)
  shapes = lambda found: [s.split('{')[0] for s in found]
  stacked = lambda found: [s for s in shapes(found) if s.startswith(f'f32[{LAYERS},')]
  one_layer = lambda found: [s for s in shapes(found) if s.startswith('f32[1,')]
  assert WHOLE_QKV in stacked(zero1['outside'])
  assert not one_layer(zero1['loop'])
  assert not stacked(zero3['outside'] + zero3['loop'])
  assert one_layer(zero3['loop']).count('f32[1,64,8,3,8]') == 2  # forward, backward
  assert len(set(one_layer(zero3['loop']))) >= 6  # the block's kernels, biases and norms


def test_zero3_never_keeps_a_gathered_layer_for_the_backward_pass(zero1_and_zero3_steps):
  """With no recomputation asked for (remat_policy='none'), the layer scan of ZeRO-1 carries
  the whole compute copy; ZeRO-3's carries only the split weights: the backward pass gathers
  each layer again (the matmul outputs are kept instead, as 'save_dots' does)."""
  zero1, zero3 = (while_carried_shapes(hlo) for hlo in zero1_and_zero3_steps)
  assert WHOLE_QKV in zero1
  assert WHOLE_QKV not in zero3
  assert f'f32[{LAYERS},8,8,3,8]' in zero3  # the kernel split over the 8 data ranks


def device_groups(instruction: str) -> list[list[int]]:
  """The device ids of each replica group of a collective of the HLO text, from any of its
  forms: listed ({{0,2},{1,3}}), iota ([4,2]<=[8], [2,4]<=[4,2]T(1,0)) or over named mesh axes
  (mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'})."""
  groups = instruction.split('replica_groups=')[1]
  listed = re.match(r'\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}', groups)
  if listed:
    return [[int(d) for d in g.split(',') if d] for g in re.findall(r'\{([\d,]*)\}', listed[1])]

  def iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(n) for n in dims.split(',')]
    ids = np.arange(np.prod(shape)).reshape(shape)
    return ids.transpose([int(i) for i in perm.split(',')]) if perm else ids

  tiled = re.match(r'\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', groups)
  if tiled:
    return iota(tiled[3], tiled[4]).reshape(int(tiled[1]), int(tiled[2])).tolist()
  named = re.match(
    r'mesh\[([^\]]*)\](?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}', groups
  )
  assert named, instruction
  axes = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", named[1])]
  names, sizes = [a for a, _ in axes], [n for _, n in axes]
  ids = iota(named[2], named[3]) if named[2] else np.arange(np.prod(sizes))
  over = [names.index(a) for a in re.findall(r"'(\w+)'", named[4])]
  rest = [i for i in range(len(names)) if i not in over]
  per_group = int(np.prod([sizes[i] for i in over]))
  return ids.reshape(sizes).transpose(rest + over).reshape(-1, per_group).tolist()


def group_size(instruction: str) -> int:
  """Devices in each replica group of a collective of the HLO text (`device_groups`)."""
  sizes = {len(group) for group in device_groups(instruction)}
  assert len(sizes) == 1, instruction
  return sizes.pop()


# Hybrid sharding's compiled steps: groups of 2 on 8 data ranks (4 copies), 4 micro-batches.
HYBRID_MICROBATCHES = 4


@pytest.fixture(scope='module')
def hybrid_steps():
  """{(ZeRO stage, pipeline stages): (layout, HLO text)} of the hybrid train steps: groups of 2
  data ranks, 4 copies without a pipeline, 2 copies of 2 stages with one."""
  return {
    (stage, stages): compiled_step(stage, 2, HYBRID_MICROBATCHES, stages)
    for stage in (1, 3)
    for stages in (1, 2)
  }


def test_hybrid_groups_gather_inside_a_group(zero1_and_zero3_steps, hybrid_steps):
  """mesh.zero_group=2 on 8 data ranks: each layer gather runs over 2 devices (one group), not
  over all 8 as without groups. (Inside hybrid sharding's per-copy micro-batch loop XLA gathers
  a layer's slice without its unit layer dim: every gather of that step is counted.)"""
  one_layer_gathers = lambda hlo: [
    line for line in hlo.splitlines() if re.search(r'= f32\[1,\S+ all-gather\(', line)
  ]
  grouped = [line for line in hybrid_steps[3, 1][1].splitlines() if ' all-gather(' in line]
  ungrouped = one_layer_gathers(zero1_and_zero3_steps[1])
  assert len(grouped) > 2 * 12 and ungrouped  # the forward and backward scans' 12 layer params
  assert {group_size(line) for line in grouped} == {2}
  assert {group_size(line) for line in ungrouped} == {8}


def loop_computations(hlo: str) -> set[str]:
  """The computations of the HLO text that run inside a while loop: the loops' bodies and
  conditions and everything they call."""
  calls: dict[str, set[str]] = collections.defaultdict(set)
  for computation, line in instructions(hlo):
    calls[computation].update(re.findall(r'%([\w.-]+)', line.split('metadata=')[0]))
  inside, todo = set(), re.findall(r'(?:body|condition)=%([\w.-]+)', hlo)
  while todo:
    name = todo.pop()
    if name not in inside:
      inside.add(name)
      todo += [c for c in calls.get(name, ()) if c in calls]
  return inside


def cross_copy_collectives(hlo: str, layout) -> dict[str, list[str]]:
  """The result shapes of the collectives whose groups span copies of the state (devices of
  more than one `replica` index), by whether they run inside a while loop ('loop') or not."""
  copy_of = {
    device.id: copy for copy, devices in enumerate(layout.mesh.devices) for device in devices.flat
  }
  inside = loop_computations(hlo)
  places: dict[str, list[str]] = collections.defaultdict(list)
  for computation, line in instructions(hlo):
    found = re.search(
      r'= (.+?) (?:all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)'
      r'(?:-start)?\(',
      line,
    )
    if found and 'replica_groups=' in line:
      if any(len({copy_of[d] for d in group}) > 1 for group in device_groups(line)):
        places['loop' if computation in inside else 'outside'].append(found.group(1))
  return places


@pytest.mark.parametrize('zero_stage', [1, 3])
@pytest.mark.parametrize('stages', [1, 2], ids=['micro_batch_loop', 'pipeline'])
def test_hybrid_reduces_across_copies_once_a_step(hybrid_steps, zero_stage, stages):
  """mesh.zero_group: the micro-batch loop (or each copy's pipeline schedule, its data ranks'
  gradients summed at every tick) reduces each gradient within a group only (each copy
  accumulates its own); after the loop one all-reduce over the copies sums each accumulator
  shard of the gradient tree exactly once (beside the step's loss and the copies' target counts,
  scalars and [micro-batches] vectors), not once per micro-batch or tick. Inside a schedule only
  each micro-batch's target count (a scalar) crosses the copies."""
  layout, hlo = hybrid_steps[zero_stage, stages]
  places = cross_copy_collectives(hlo, layout)
  assert set(places['loop']) <= {'f32[]'}, places['loop']
  found = collections.Counter(
    shape for result in places['outside'] for shape in re.findall(r'[a-z]\d+\[[\d,]*\]', result)
  )
  shard = lambda p: f'f32[{",".join(map(str, p.sharding.shard_shape(p.shape)))}]'
  expected = collections.Counter(shard(p) for p in jax.tree.leaves(layout.logical.params))
  assert {shape: found[shape] for shape in expected} == expected
  elements = lambda shape: int(np.prod([int(n) for n in re.findall(r'\d+', shape.split('[')[1])]))
  assert all(elements(shape) <= HYBRID_MICROBATCHES for shape in found - expected), found


def test_hybrid_pipeline_compiles_without_a_full_rematerialization(capfd):
  """Hybrid ZeRO-1 with a pipeline under 'tick' (each copy's own schedule): XLA's partitioner
  moves no value through a replicated copy. One schedule over all the copies made it replicate
  an activation of the embedding's backward and split it again ('Involuntary full
  rematerialization' on stderr, three times)."""
  cfg = small_config(
    model=dict(num_layers=4, remat_policy='full'),
    train=dict(global_batch_size=8),
    mesh=dict(data=4, pipeline=2, zero_group=2),
    pipeline=dict(grad_sync='tick'),
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile()
  assert 'Involuntary full rematerialization' not in capfd.readouterr().err


@pytest.mark.parametrize('dropout', [0.0, 0.1])
def test_hybrid_copies_with_dropout_draw_their_own_masks(dropout):
  """Two copies (data 4 in groups of 2) given the same rows: with the masks drawn from one key
  they would train exactly as one copy (data 2) on those rows, the same local shapes and keys.
  Each copy folds its index into the key, so with dropout their masks, and the first loss,
  differ from the one copy's; without dropout the two runs are the same. Either way the copies
  sum their gradients once a step (`step.per_rank_loss_and_grads`)."""
  model = dict(hidden_dropout=dropout, attention_dropout=dropout)
  rows = np.random.default_rng(0).integers(0, 1000, (4, 17))  # 2 micro-batches of 2 rows
  one = small_config(model=model, train=dict(global_batch_size=4), mesh=dict(data=2))
  two = small_config(
    model=model, train=dict(global_batch_size=8), mesh=dict(data=4, zero_group=2)
  ).validate()
  layout = make_layout(two, partitioning.mesh_of(two.mesh))
  assert step_lib.own_gradient_axes(two, layout) == ('replica',)
  one_copy = run_steps(one, num_steps=1, tokens=rows)[0]
  # Each micro-batch's 4 rows: copy 0 takes the first 2, copy 1 the last 2.
  both = run_steps(
    two, num_steps=1, tokens=np.concatenate([rows[:2], rows[:2], rows[2:], rows[2:]])
  )[0]
  assert_draws_its_own_dropout_masks(both, one_copy, dropout)


# ----------------------------------------------------------------------------- config, log


def test_zero_group_must_divide_data():
  with pytest.raises(ConfigError, match=r'mesh.zero_group \(3\) must divide mesh.data \(4\)'):
    small_config(mesh=dict(data=4, zero_group=3)).validate()


def test_start_up_line_names_the_stage_and_the_groups():
  cfg = small_config(mesh=dict(data=8, zero_stage=3, zero_group=2)).validate()
  line = describe_zero(make_layout(cfg, partitioning.mesh_of(cfg.mesh)))
  assert line.startswith('> ZeRO-3: fp32 params, Adam moments and the compute copy (each layer ')
  assert 'split over data groups of 2 (4 copies)' in line


# ------------------------------------------------------------------------------- checkpoints


def corpus_config(**mesh):
  """The embedded corpus, 4 iterations, checkpoints at 2 and 4, on a mesh of 4 devices."""
  return config_with(
    {
      'model': dict(num_layers=2, hidden_size=32, num_heads=4, vocab_size=8192, init_std=0.02),
      'train': dict(steps=4, global_batch_size=8, micro_batch_size=1, seq_len=16, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=4, decay_samples=400),
      'mesh': dict(dict(data=4, pipeline=1, tensor=1), **mesh),
      'checkpoint': dict(save_interval=2),
    },
    {},
  )


def losses_after_resume(workdir: str, first: dict, then: dict) -> list[float]:
  """Iterations 1-2 on mesh `first`, saved; 3-4 resumed from that checkpoint on mesh `then`."""
  Trainer(corpus_config(**first).replace(train={'steps': 2}), workdir).run()
  assert checkpoints.available_steps(os.path.join(workdir, 'checkpoints')) == [2]
  Trainer(corpus_config(**then), workdir).run()
  return [r['lm_loss'] for r in read_metrics(workdir)]


@pytest.fixture(scope='module')
def uninterrupted_zero1(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('zero1'))
  Trainer(corpus_config(), workdir).run()
  return [r['lm_loss'] for r in read_metrics(workdir)]


@pytest.mark.parametrize(
  'first, then',
  [
    ({}, dict(zero_stage=3)),
    (dict(zero_stage=3), dict(zero_stage=1, zero_group=2)),
    (dict(zero_stage=3, zero_group=2), dict(zero_stage=3)),
  ],
  ids=['zero1_to_zero3', 'zero3_to_hybrid_zero1', 'hybrid_zero3_to_zero3'],
)
def test_a_checkpoint_resumes_under_another_stage_or_group(
  uninterrupted_zero1, tmp_path, first, then
):
  """Checkpoints hold the canonical layout: a run resumes across ZeRO stages and group sizes
  with the losses of the run that never stopped, and the inference tools load its checkpoint
  (on their own mesh, whatever stage and group it was saved with)."""
  workdir = str(tmp_path / 'run')
  resumed = losses_after_resume(workdir, first, then)
  assert len(resumed) == 4
  assert resumed == pytest.approx(uninterrupted_zero1, rel=2e-6)
  cfg, params = load_for_inference(os.path.join(workdir, 'checkpoints'))
  assert (cfg.mesh.zero_stage, cfg.mesh.zero_group) == (1, 0)
  assert params['word_embeddings'].shape[1] == 32
