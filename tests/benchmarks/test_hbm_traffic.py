"""benchmarks/hbm_traffic.py on the optimized HLO of a real GPU compile: the GPU suite's smoke
step (2 layers, hidden 128, FFN 512, a vocabulary of 1,024, 2 micro-batches of 2 x 64 tokens,
pallas attention, save_dots, chunked cross-entropy) compiled for an H100 on a CPU, by

    python benchmarks/hbm_traffic.py --config.model.num_layers=2 --config.model.hidden_size=128 \
      --config.model.num_heads=2 --config.model.vocab_size=1000 \
      --config.model.pad_vocab_size_to=1024 --config.train.seq_len=64 \
      --config.train.micro_batch_size=2 --config.train.global_batch_size=4 \
      --config.model.attention_impl=pallas --save_hlo tests/benchmarks/smoke_step_h100.hlo.txt.gz

with jax 0.11.2 and its CUDA 13 plugin (the GPU image's versions), 2026-11-27. It predates the
update's select (train step: a `lax.cond` then skipped a non-finite update), so it still holds a
conditional, whose accounting (the costlier branch, once) the pipeline's conditionals need too."""

import gzip
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import hbm_traffic  # noqa: E402  (scripts, not package modules)
import profile_trace  # noqa: E402

from t5x_like.config import ConfigError  # noqa: E402
from t5x_like.planning import gpu_target  # noqa: E402

HLO = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'smoke_step_h100.hlo.txt.gz')
LAYERS, MICRO_BATCHES, TOKENS, HIDDEN, FFN, VOCAB = 2, 2, 2 * 64, 128, 512, 1024


@pytest.fixture(scope='module')
def text():
  with gzip.open(HLO, 'rt') as f:
    return f.read()


@pytest.fixture(scope='module')
def launches(text):
  return hbm_traffic.launches(hbm_traffic.parse_module(text))


def op_name(launch) -> str:
  return launch.instruction.attribute(r'op_name="([^"]*)"')


def test_a_kernel_runs_as_often_as_its_loops_and_the_update_branch_once(launches):
  layer = [x for x in launches if '/jvp(Transformer)/while/body/' in op_name(x)]
  assert layer and {x.count for x in layer} == {LAYERS * MICRO_BATCHES}
  micro = [x for x in launches if op_name(x) == 'jit(step)/while/body/eval_jaxpr/add']
  assert micro and {x.count for x in micro} == {MICRO_BATCHES}  # the gradient accumulation
  # The optimizer's conditional: its update branch (the costlier), once; not the skip.
  assert any('cond/branch_1_fun' in op_name(x) and x.count == 1 for x in launches)
  assert not any('cond/branch_0_fun' in op_name(x) for x in launches)


def test_a_slice_reads_its_part_and_an_update_or_scatter_writes_its_part(text, launches):
  def named(suffix):
    return [x for x in launches if op_name(x).endswith(suffix)]

  def nonscalar(x):
    return [(dtype, shape) for dtype, shape in hbm_traffic.arrays(x.instruction.type) if shape]

  def size(array):
    return hbm_traffic.array_bytes(f'{array[0]}[{",".join(map(str, array[1]))}]')

  slices = [
    x
    for x in named('(dynamic_index_in_dim)/dynamic_slice')
    if x.instruction.opcode == 'fusion-start'
  ]
  updates = named('(dynamic_update_index_in_dim)/dynamic_update_slice')
  assert slices and updates
  for x in slices:
    # An asynchronous slice, ((the stack [LAYERS, ...], its index), the slice [1, ...], ...):
    # the slice and the s32 index are read, the slice written.
    stack, piece = nonscalar(x)[:2]
    assert stack[1][0] == LAYERS and piece[1] == (1, *stack[1][1:])
    assert (x.read, x.written) == (size(piece) + 4, size(piece)), x.instruction.name
  for x in updates:
    # Into a stacked [LAYERS, ...] buffer (the type's first array): one layer's part written.
    stack = nonscalar(x)[0]
    assert stack[1][0] == LAYERS and x.written * LAYERS == size(stack), x.instruction.name
  # The step profile's category of these copies, asynchronous ('fusion-start') or not.
  _, ops = profile_trace.parse_hlo(text)
  for x in [*slices, *updates]:
    name = x.instruction.name
    assert profile_trace.categorise(name, {'hlo_op': name}, ops[name])[0] == 'copy/transpose'
  # The token lookup's gradient, a scatter-add into an fp32 [vocabulary, hidden] buffer: its
  # micro-batch's rows written, not the table.
  (lookup,) = named('transpose(jvp(Transformer))/scatter-add')
  assert lookup.written == TOKENS * HIDDEN * 4 < VOCAB * HIDDEN * 4


def test_the_matmul_flops_are_the_models(text):
  summary = hbm_traffic.summarise(text, hbm_gb_s=3350.0, matmul_tflops=671.0)
  rows = summary['categories']
  # Each layer's QKV, output and MLP matmuls: forward, and the backward's two (save_dots keeps
  # the forward's outputs), per layer and micro-batch. Attention's own are inside its kernels.
  per_forward = 2 * TOKENS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN)
  assert rows['matmul']['tflop'] * 1e12 == pytest.approx(3 * per_forward * LAYERS * MICRO_BATCHES)
  # The loss's logits, their two gradients (XLA keeps a lone chunk's logits for the backward).
  logits = 2 * TOKENS * HIDDEN * VOCAB
  assert rows['loss']['tflop'] * 1e12 == pytest.approx(3 * logits * MICRO_BATCHES)
  assert summary['matmul_ms'] == pytest.approx(sum(r['tflop'] for r in rows.values()) / 671.0 * 1e3)
  assert summary['memory_ms'] == pytest.approx(summary['memory_gb'] / 3350.0 * 1e3)
  assert summary['memory_gb'] == pytest.approx(sum(r['memory_gb'] for r in rows.values()))
  assert rows['attention']['launches'] == 3 * LAYERS * MICRO_BATCHES  # forward, dq, dkv
  assert rows['attention']['memory_gb'] == 0  # custom calls: not timed here
  assert 'copy/transpose' in hbm_traffic.table(summary)


def test_a_loop_fusion_reads_all_it_reduces_and_only_what_it_gathers(text, launches):
  """In the smoke step, the partial sums of matmuls split along their contraction: XLA emits
  these small reductions as loop fusions, which read all they reduce. The fused loss's label
  logit: a select over the [tokens, vocabulary] logits, then a gather of one entry per token, in
  one loop fusion that reads only those, compiled for an H100 (jax 0.11.2) from

      def label_logit(logits, labels):  # f32 [256, 1024], s32 [256]
        masked = jnp.where(jnp.arange(logits.shape[1]) < 1000, logits, -1e30)
        return jnp.take_along_axis(masked, labels[:, None], axis=1)[:, 0] * 2.0
  """
  module = hbm_traffic.parse_module(text)
  partial_sums = [
    x
    for x in launches
    if x.instruction.opcode == 'fusion'
    and x.instruction.attribute(r'kind=(\w+)') == 'kLoop'
    and [
      i.opcode
      for i in module.computations[x.instruction.attribute(r'calls=%([\w.\-]+)')]
      if i.opcode == 'reduce'
    ]
    and len(x.instruction.operands) == 1
  ]
  assert partial_sums
  for x in partial_sums:
    assert x.read == hbm_traffic.array_bytes(module.by_name[x.instruction.operands[0]].type)
    assert x.read > x.written
  with open(os.path.join(os.path.dirname(HLO), 'label_gather_h100.hlo.txt')) as f:
    module = hbm_traffic.parse_module(f.read())
  (fusion,) = hbm_traffic.launches(module)
  assert fusion.instruction.attribute(r'kind=(\w+)') == 'kLoop'
  # The 256 gathered logits and the 256 labels, not the 1 MiB of logits.
  assert (fusion.read, fusion.written) == (256 * 4 + 256 * 4, 256 * 4)


def test_the_smoke_step_compiled_for_an_h100_has_the_models_flops_and_updates_in_place():
  """The compile itself, as the docstring's command runs it (the test extras install the CUDA
  plugin; this jax's version): XLA's GPU program of the smoke step, counted as the kept one."""
  overrides = {
    'model.num_layers': LAYERS,
    'model.hidden_size': HIDDEN,
    'model.num_heads': 2,
    'model.vocab_size': 1000,
    'model.pad_vocab_size_to': VOCAB,
    'train.seq_len': TOKENS // 2,
    'train.micro_batch_size': 2,
    'train.global_batch_size': 4,
    'model.attention_impl': 'pallas',
    # The layers scanned, as the in-place accumulation below is read from the loop's carry.
    'model.unroll_layers': False,
    'model.cross_entropy_impl': 'chunked',
  }
  config = os.path.join(REPO, 'configs', 'bloom_1b3.py')
  text, peak = hbm_traffic.compile_for('h100-80gb', config, overrides)
  assert 'custom_call_target="__gpu$xla.gpu.triton"' in text  # the pallas kernels, for a GPU
  assert 0 < peak < 2**30
  rows = hbm_traffic.summarise(text, hbm_gb_s=3350.0, matmul_tflops=671.0)['categories']
  per_forward = 2 * TOKENS * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN)
  assert rows['matmul']['tflop'] * 1e12 == pytest.approx(3 * per_forward * LAYERS * MICRO_BATCHES)
  assert rows['loss']['tflop'] * 1e12 == pytest.approx(
    3 * 2 * TOKENS * HIDDEN * VOCAB * MICRO_BATCHES
  )
  assert rows['attention']['launches'] == 3 * LAYERS * MICRO_BATCHES
  # The optimizer updates the donated state in place: no conditional, and no copy of a state
  # tensor (a lax.cond around the update made XLA copy each one into the branch and out).
  module = hbm_traffic.parse_module(text)
  entry = module.computations[module.entry]
  state = {i.type.split('{')[0] for i in entry if i.opcode == 'parameter' and 'f32[' in i.type}
  copies = [
    i.name
    for i in entry
    if i.opcode == 'copy'
    and i.type.split('{')[0] in state
    and not all(o.startswith('constant') for o in i.operands)
  ]
  assert copies == []
  assert not any(i.opcode == 'conditional' for c in module.computations.values() for i in c)
  # One GPU adds each layer's gradient into its slice of the stacked fp32 accumulator in place
  # (training/step.py's add_microbatch_grads): each such kernel, per layer and micro-batch,
  # reads the slice and the gradient it adds, and writes the slice; not the whole stack.
  stacked = [f'f32[{LAYERS},{HIDDEN},{FFN}]', f'f32[{LAYERS},{FFN},{HIDDEN}]']
  adds = [
    x
    for x in hbm_traffic.launches(module)
    if x.instruction.type.split('{')[0] in stacked and op_name(x).startswith('jit(step)/while/')
  ]
  assert len(adds) == 2 and {x.count for x in adds} == {LAYERS * MICRO_BATCHES}
  layer_slice = HIDDEN * FFN * 4
  for x in adds:
    accumulator, *added = x.instruction.operands
    assert module.type_of(accumulator).split('{')[0] in stacked
    assert x.written == layer_slice
    added_bytes = [hbm_traffic.array_bytes(module.type_of(o)) for o in added]
    # The gradient whole (the matmul's, or its split-K partial sums), its indices by their slice.
    assert max(added_bytes) <= x.read - layer_slice <= sum(added_bytes)


def test_meshes_of_more_than_8_gpus_fill_nodes_of_8():
  assert [gpu_target.topology_for(n) for n in (1, 8, 16, 384)] == [
    '1x1x1',
    '1x1x8',
    '2x1x8',
    '48x1x8',
  ]
  with pytest.raises(ConfigError, match='whole nodes of 8'):
    gpu_target.topology_for(12)
