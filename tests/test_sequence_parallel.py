"""model.sequence_parallel: the residual stream, LayerNorms, dropout and the pipeline's kept stage
inputs split over `tensor` along the sequence, training exactly as one device does."""

import json
import re

import jax
import numpy as np
import pytest
from conftest import assert_same_training, run_cli, run_steps, small_config

from t5x_like.config import ConfigError
from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import step as step_lib

# head_dim 16, so the Pallas kernels can run the same model.
MODEL = dict(num_heads=4)


@pytest.fixture(scope='module')
def single_device_run():
  return run_steps(small_config(model=MODEL), num_steps=3)


@pytest.mark.parametrize(
  'data, stages, tensor, model',
  [
    (1, 1, 4, {}),
    # Pipelined, with the tick-level recomputation that keeps the stage inputs.
    (2, 2, 2, dict(remat_policy='full')),
    # The fused attention runs per (batch, heads) shard on the gathered sequence.
    (1, 1, 4, dict(attention_impl='pallas')),
  ],
  ids=['1x1x4', '2x2x2_full', '1x1x4_pallas'],
)
def test_sequence_parallel_run_matches_single_device(
  single_device_run, data, stages, tensor, model
):
  cfg = small_config(
    model=dict(MODEL, sequence_parallel=True, **model),
    mesh=dict(data=data, pipeline=stages, tensor=tensor),
  ).validate()
  assert_same_training(
    run_steps(cfg, num_steps=3), single_device_run, cfg, loose='attention_impl' in model
  )


def test_the_pipeline_backward_reads_the_stage_buffer_without_a_gather():
  """The entering micro-batch's cotangent is read from the [P, rows, S, E] stage buffer by a
  dynamic slice. As the transpose of `.at[0].set` it was a gather, on which jaxlib 0.11.2's SPMD
  partitioner aborts (ExpandDeviceGroupsWithIota) with the sequence split over `tensor` and a
  per-rank pipeline: the 2x2x2 run above, on that jax. Checked on the lowered step's gathers."""
  cfg = small_config(
    model=dict(MODEL, sequence_parallel=True), mesh=dict(data=2, pipeline=2, tensor=2)
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  text = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).as_text()
  operands = re.findall(r'"stablehlo\.gather"\([^)]*\).*?: \(tensor<([^>]*)>', text)
  assert operands  # the layers' weights are still read by gathers under the stages' vmap
  p, s, e = cfg.mesh.pipeline, cfg.train.seq_len, cfg.model.hidden_size
  buffers = [o for o in operands if re.fullmatch(rf'{p}x\d+x{s}x{e}x\w+', o)]
  assert not buffers, buffers


def test_sequence_parallel_dropout_draws_the_masks_of_the_unsplit_run():
  """Dropout on sequence-split activations must draw the same masks as on whole ones (Megatron
  needs an RNG tracker for this; JAX's partitionable threefry gives it by construction)."""
  runs = [
    run_steps(
      small_config(
        model=dict(MODEL, hidden_dropout=0.1, attention_dropout=0.1, sequence_parallel=sp),
        mesh=dict(tensor=4),
      ),
      num_steps=2,
    )
    for sp in (False, True)
  ]
  losses, norms, params = runs[1]
  ref_losses, ref_norms, ref_params = runs[0]
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  np.testing.assert_allclose(norms, ref_norms, rtol=2e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5), params, ref_params
  )


def compiled_step_text(mesh_shape, sequence_parallel: bool, **model) -> str:
  cfg = small_config(
    model=dict(MODEL, sequence_parallel=sequence_parallel, **model),
    train=dict(seq_len=SEQ),
    mesh=dict(zip(('data', 'pipeline', 'tensor'), mesh_shape)),
  ).validate()
  layout = make_layout(cfg, partitioning.make_mesh(*mesh_shape))
  return step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile().as_text()


SEQ, HIDDEN = 24, 64  # 24: a sequence length no other dim of the small model has
# `%reduce.3 = f32[1,6]{1,0} reduce(...), ..., metadata={op_name=".../layers/ln1/reduce_sum"`.
_LAYER_NORM_REDUCE = re.compile(
  r'= f32\[(?P<shape>[\d,]*)\]\S* reduce\(.*op_name="[^"]*/(?:ln1|ln2|embed_ln|final_ln)/'
)


def layer_norm_shapes(hlo: str) -> set[tuple[int, ...]]:
  """Result shapes of the LayerNorms' reductions (row statistics and their backward)."""
  return {
    tuple(int(n) for n in m.group('shape').split(',') if n)
    for m in map(_LAYER_NORM_REDUCE.search, hlo.splitlines())
    if m
  }


def sequence_gathers(hlo: str) -> list[str]:
  """All-gathers that assemble the whole sequence of [.., seq, hidden] activations."""
  gather = re.compile(rf'= f32\[[\d,]*\b{SEQ},{HIDDEN}\]\S* all-gather(?:-start)?\(')
  return [line for line in hlo.splitlines() if gather.search(line)]


def summed_residuals_used_whole(hlo: str) -> list[str]:
  """Users of an all-reduced [.., seq, hidden] partial sum (attention-out, 4h->h) that produce
  a whole-sequence array. Under sequence parallelism the sum is reduce-scattered: XLA's GPU
  pipeline emits `reduce-scatter`, its CPU pipeline an all-reduce whose every user slices out
  the rank's part of the sequence."""
  sums = re.findall(rf'(%all-reduce[\w.-]*) = f32\[[\d,]*\b{SEQ},{HIDDEN}\]', hlo)
  assert sums or 'reduce-scatter' in hlo, 'the program sums no residual-stream partial sums'
  whole = re.compile(rf'= \S*\[[\d,]*\b{SEQ},{HIDDEN}\]')
  users = []
  for name in sums:
    used = re.compile(re.escape(name) + r'[,)]')
    users += [
      line.strip()
      for line in hlo.splitlines()
      if used.search(line) and not line.lstrip().startswith(name + ' ') and whole.search(line)
    ]
  return users


@pytest.mark.parametrize(
  'mesh_shape, model',
  [
    ((1, 1, 4), {}),
    ((2, 2, 2), dict(remat_policy='full')),
  ],
  ids=['1x1x4', '2x2x2_full'],
)
def test_compiled_step_splits_layer_norms_and_kept_stage_inputs_over_tensor(mesh_shape, model):
  """In the compiled program the LayerNorms run on seq / tensor positions, the sequence is
  gathered before the QKV and h->4h matmuls and reduce-scattered after attention-out and 4h->h,
  and the pipeline keeps its stage inputs [ticks, stages, rows, seq / tensor, h] per device and
  passes seq / tensor positions from stage to stage.
  The same checks on the program without the flag find the whole sequence everywhere."""
  tensor = mesh_shape[2]
  split = SEQ // tensor
  on, off = (compiled_step_text(mesh_shape, sp, **model) for sp in (True, False))
  assert any(SEQ in s for s in layer_norm_shapes(off))
  assert not any(SEQ in s for s in layer_norm_shapes(on))
  assert any(split in s for s in layer_norm_shapes(on))
  assert not sequence_gathers(off) and sequence_gathers(on)
  if mesh_shape[1] == 1:  # in the pipeline the stages' vmap hides the users behind a transpose
    assert summed_residuals_used_whole(off)
    assert not summed_residuals_used_whole(on), summed_residuals_used_whole(on)[:3]
  else:
    ticks = 8 // mesh_shape[0] + mesh_shape[1] - 1  # micro-batches + stages - 1
    kept = lambda hlo: set(re.findall(rf'f32\[{ticks},1,1,(\d+),{HIDDEN}\]', hlo))
    assert kept(off) == {str(SEQ)} and kept(on) == {str(split)}
    # What moves from stage to stage (the roll of the stage outputs): split too.
    permuted = lambda hlo: re.findall(
      rf'= f32\[[\d,]*\b(\d+),{HIDDEN}\]\S* collective-permute(?:-start)?\(', hlo
    )
    assert str(SEQ) in permuted(off) and set(permuted(on)) == {str(split)}


def test_sequence_length_that_tensor_does_not_divide_is_one_clear_error():
  cfg = small_config(
    model=dict(MODEL, sequence_parallel=True), train=dict(seq_len=18), mesh=dict(tensor=4)
  )
  with pytest.raises(
    ConfigError,
    match=r'train.seq_len \(18\) must be divisible by mesh.tensor '
    r'\(4\).*sequence_parallel=False',
  ):
    cfg.validate()
  small_config(train=dict(seq_len=18), mesh=dict(tensor=4)).validate()  # fine without it


def test_plan_breakdown_names_the_sequence_split_stage_inputs():
  """tiny on pipeline 2 x tensor 2, 4 micro-batches: 5 ticks' stage inputs of 4 rows x 128 / 2
  positions x 256 as bf16 bits per device, under their own category, not 'kept activations'."""
  r = run_cli(
    [
      '-m',
      't5x_like.plan',
      '--config',
      'configs/tiny.py',
      '--json',
      '--config.mesh.data=1',
      '--config.mesh.pipeline=2',
      '--config.mesh.tensor=2',
      '--config.model.dtype=bfloat16',
      '--config.model.remat_policy=full',
      '--config.model.sequence_parallel=True',
    ]
  )
  assert r.returncode == 0, r.stderr[-3000:]
  gib = json.loads(r.stdout.strip().splitlines()[-1])['memory_breakdown']['gib']
  assert gib['kept stage inputs'] * 2**30 == 5 * 4 * (128 // 2) * 256 * 2, gib
