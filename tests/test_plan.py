"""`python -m t5x_like.plan`: ahead-of-time compilation of whole configs on virtual devices."""

import collections
import json
import math
import re

import pytest
from conftest import run_cli, small_config
from test_zero3 import instructions, loop_computations


def test_bloom_176b_lowers_and_compiles_on_384_virtual_devices():
  r = run_cli(['-m', 't5x_like.plan', '--config', 'configs/bloom_176b.py', '--json'])
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert report['mesh'] == [8, 12, 4] and report['num_microbatches'] == 128
  assert abs(report['params'] / 1e9 - 176.25) < 0.01
  assert abs(report['pipeline_bubble'] - 11 / 139) < 1e-9  # 1F1B's bubble is GPipe's
  # The ramp-up from 192 to 2048 by 16 (12 to 128 micro-batches): one program per batch size.
  assert report['train_programs'] == 117
  assert 'layers per stage [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 5]' in report['layer_placement']
  # The state (fp32 master params + both Adam moments: 12 bytes/param) per device: 72 layer slots
  # (2 of them padding) split over all 384 devices, and the 250,880-row embedding, which 48 does
  # not divide, split over tensor x data only.
  h = 14336
  layers = 72 * (12 * h * h + 13 * h) * 12 / 384
  embedding = 250880 * h * 12 / (4 * 8)
  assert abs(report['argument_gib'] - (layers + embedding) / 2**30) < 0.01
  assert report['replicated_over_data'] == []  # data 8 divides a dim of every tensor
  # XLA's peak per device: 50.39 GiB in this compile, each data rank adding its own fp32
  # gradient up (pipeline.grad_sync='step'; 37.76 with 'tick', which all-reduces it at each of
  # the 150 ticks; docs/benchmarks.md), with the 1F1B order and the stages reading a gathered
  # bf16 copy of their weights. Megatron-DeepSpeed's BF16 optimizer, which accumulates the same
  # fp32 gradients, measured 65-67 GB for a 195B on this topology. The bound is that figure plus
  # 5%.
  assert report['peak_gib'] < 61.4, report


def test_zero1_splits_the_state_over_a_data_that_divides_no_dim():
  """tiny on data=3: 3 divides neither hidden 256, 4h 1,024 nor the 8,192-row vocabulary, and
  ZeRO-1 still splits the fp32 params and both Adam moments (12 bytes/param) three ways: the
  step's arguments are a third of the state plus the padding and a 4 x 129 batch (2.7 times
  that when those tensors stayed whole on every data rank)."""
  r = run_cli(
    [
      '-m',
      't5x_like.plan',
      '--config',
      'configs/tiny.py',
      '--json',
      '--config.mesh.data=3',
      '--config.mesh.tensor=1',
      '--config.train.global_batch_size=12',
    ]
  )
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert report['replicated_over_data'] == []
  third = 12 * report['params'] / 3
  assert third < report['argument_gib'] * 2**30 < third * 1.01, report


def test_ramp_up_padded_to_the_full_micro_batch_count_is_one_program():
  # tiny's 4 micro-batches of 4 rows, ramped up from 8 samples (2 micro-batches) by 8 over 16
  # samples: 2 iterations of 8 samples, then 118 of 16. Padded to 4 micro-batches: one program,
  # and 2 x 2 of the 120 x 4 micro-batches the step runs are padding.
  args = [
    '-m',
    't5x_like.plan',
    '--config',
    'configs/tiny.py',
    '--json',
    '--config.mesh.data=1',
    '--config.mesh.tensor=1',
    '--config.train.rampup_batch_size=(8, 8, 16)',
  ]
  exact = json.loads(run_cli(args).stdout.strip().splitlines()[-1])
  padded = json.loads(
    run_cli(args + ['--config.train.rampup_microbatch_multiple=4']).stdout.strip().splitlines()[-1]
  )
  assert (exact['train_programs'], padded['train_programs']) == (2, 1)
  assert 'padding_microbatch_share' not in exact
  assert padded['padding_microbatch_share'] == 4 / (4 * 120)


def test_bad_config_is_refused_before_compiling():
  r = run_cli(
    ['-m', 't5x_like.plan', '--config', 'configs/bloom_176b.py', '--config.pipeline.repeats=4']
  )
  assert r.returncode == 2 and 'does not fit 70 layers' in r.stderr


def test_plan_takes_the_gin_front_end_as_train_does(monkeypatch, capsys):
  """The same estimate from configs/bloom_176b.gin as from .py (they are one config), with a
  binding as the override; a .gin file given to --config is refused with the flag to use."""
  from conftest import REPO

  from t5x_like.cli import plan

  monkeypatch.chdir(REPO)
  common = ['--estimate', '--gpu', 'a100-80gb', '--json']
  assert (
    plan.main(['--config', 'configs/bloom_176b.py', '--config.train.micro_batch_size=1', *common])
    == 0
  )
  from_py = capsys.readouterr().out
  gin = ['--gin_file', 'configs/bloom_176b.gin', '--gin_bindings', 'train.micro_batch_size = 1']
  assert plan.main([*gin, *common]) == 0
  assert capsys.readouterr().out == from_py and '"micro_batch_size": 1' in from_py
  assert plan.main(['--config', 'configs/bloom_176b.gin', *common]) == 2
  assert 'is a gin file; pass it with --gin_file' in capsys.readouterr().err


def _plan_json(*overrides):
  r = run_cli(
    [
      '-m',
      't5x_like.plan',
      '--config',
      'configs/tiny.py',
      '--json',
      '--config.mesh.data=1',
      '--config.model.dtype=bfloat16',
      '--config.model.remat_policy=full',
      *overrides,
    ]
  )
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def test_memory_breakdown_of_a_pipeline_adds_up_and_names_the_kept_stage_inputs(capsys):
  """tiny on pipeline 2 x tensor 2, 4 micro-batches: the step keeps 4 + 2 - 1 = 5 ticks' stage
  inputs of 4 x 128 x 256 as bf16 bits on each device, and the categories add up to XLA's peak."""
  from t5x_like.cli.plan import print_breakdown

  report = _plan_json('--config.mesh.pipeline=2', '--config.mesh.tensor=2')
  gib = report['memory_breakdown']['gib']
  assert abs(sum(gib.values()) - report['peak_gib']) < 1e-9, report
  assert gib['kept stage inputs'] * 2**30 == 5 * 4 * 128 * 256 * 2
  assert gib['master weights (fp32 params)'] > 0 and gib['Adam moments'] > 0
  assert gib['gradient accumulators'] > 0 and gib['recomputation workspace'] > 0
  assert report['gpu_estimate_peak_gib'] == report['peak_gib'] - report['cpu_overstatement_gib']
  assert 0 <= report['cpu_overstatement_gib'] < report['peak_gib']
  largest = report['memory_breakdown']['largest_temporaries']
  assert len(largest) == 10 and largest[0]['gib'] >= largest[-1]['gib'] > 0
  print_breakdown(report)
  text = capsys.readouterr().out
  assert 'kept stage inputs' in text and 'GPU estimate of the peak' in text


def test_memory_breakdown_without_a_pipeline_keeps_no_stage_inputs():
  """Without recomputation the step keeps activations for the backward pass, none of them a
  pipeline's stage inputs."""
  report = _plan_json('--config.mesh.tensor=1', '--config.model.remat_policy=none')
  gib = report['memory_breakdown']['gib']
  assert abs(sum(gib.values()) - report['peak_gib']) < 1e-9, report
  assert gib['kept stage inputs'] == 0 and gib['kept activations'] > 0
  # 12 bytes/param of state: the fp32 params and both Adam moments.
  assert abs(gib['Adam moments'] - 2 * gib['master weights (fp32 params)']) < 1e-9


def test_memory_breakdown_names_the_dump_part_it_cannot_read():
  """A dump whose format changed (as jax 0.11.2's did) is one DumpError naming the file and the
  part not found, never categories from half-read files (a GPU estimate silently equal to the CPU
  peak, or None without a reason)."""
  import glob
  import os
  import tarfile

  import jax
  import jax.numpy as jnp
  import pytest

  from t5x_like.planning import memory_report

  def f(x, y):
    a = jnp.tanh(x @ y)
    b = jnp.sin(a @ y)
    return (a * b).sum(), (b @ x).sum()

  lowered = jax.jit(f).lower(jnp.ones((256, 256)), jnp.ones((256, 256)))
  compiled, dump = memory_report.compile_with_buffer_dump(lowered)
  memory = compiled.memory_analysis()
  with dump:
    found = memory_report.breakdown(dump.name, memory)
    assert sum(found['bytes'].values()) == found['peak_bytes']
    edits = (
      ('-live-range.txt', 'Live ranges at', 'Peak live set at', "'  Live ranges at N (peak):'"),
      ('-live-range.txt', 'Live ranges at ', 'Live ranges at #', 'parse_live_ranges'),
      ('-buffer-assignment.txt', ' value: <', ' value <', "' value: <id name @position>"),
      ('-buffer-assignment-values.txt', ' from instruction:', ' defined by:', "' from instruc"),
    )
    for suffix, old, new, named in edits:
      (path,) = glob.glob(f'{dump.name}/*{suffix}')
      with open(path) as fh:
        text = fh.read()
      with open(path, 'w') as fh:
        fh.write(text.replace(old, new))
      with pytest.raises(memory_report.DumpError) as error:
        memory_report.breakdown(dump.name, memory)
      assert named in str(error.value) and suffix.lstrip('-') in str(error.value), error.value
      assert 'the dump holds' in str(error.value), error.value  # its files, for the next reader
      with open(path, 'w') as fh:
        fh.write(text)
    # A file XLA no longer writes (dump.cc writes the values and live ranges under an option):
    # the error names it, the option and the files there are.
    (path,) = glob.glob(f'{dump.name}/*-live-range.txt')
    os.rename(path, path + '.away')
    with pytest.raises(memory_report.DumpError) as error:
      memory_report.breakdown(dump.name, memory)
    assert 'lacks' in str(error.value) and 'xla_dump_buffer_assignment_analysis' in str(error.value)
    assert '-live-range.txt.away' in str(error.value), error.value
    os.rename(path + '.away', path)
    # T5X_LIKE_KEEP_XLA_DUMP keeps the dump's text files (the GPU suite's plan stage sets it).
    archive = f'{dump.name}.kept.tar.gz'
    os.environ['T5X_LIKE_KEEP_XLA_DUMP'] = archive
    try:
      assert memory_report.breakdown(dump.name, memory) == found
    finally:
      del os.environ['T5X_LIKE_KEEP_XLA_DUMP']
    with tarfile.open(archive) as tar:
      names = tar.getnames()
    os.remove(archive)
    assert 'FILES.txt' in names and any(n.endswith('-live-range.txt') for n in names), names
    assert not any(n.endswith(('.ll', '.o')) for n in names), names


def _compact_gte(text):
  """An optimized module's text as XLA prints it since openxla/xla 0b695bff (2026-07-13, "Set
  compact GTE printing on by default when dumping modules to text"; jaxlib 0.11.0 and later):
  HloComputation::Print skips each get-tuple-element but a root, and HloInstruction prints an
  operand that is one as its latest non-GTE ancestor and '#index' per level ('%p0#0#1')."""
  import re

  gte = re.compile(r'^\s*(ROOT )?%(\S+) = \S+ get-tuple-element\(%([\w.\-]+)\), index=(\d+)')
  parents = {m[2]: (m[3], m[4]) for m in map(gte.match, text.splitlines()) if m}

  def operand(m):
    name, path = m.group(1), ''
    while name in parents:
      name, index = parents[name]
      path = f'#{index}{path}'
    return f'%{name}{path}'

  lines = []
  for line in text.splitlines():
    m = gte.match(line)
    if m and not m[1]:
      continue
    # Operands are every %name but the instruction's own (before ' = ') and calls=/body=... ones.
    head, sep, rest = line.partition(' = ')
    rest = re.sub(r'(?<![=])%([\w.\-]+)', operand, rest)
    lines.append(head + sep + rest)
  return '\n'.join(lines) + '\n'


def test_memory_breakdown_reads_both_forms_of_the_module_text(tmp_path):
  """jaxlib 0.10.2's module text and the compact-GTE form that XLA prints by default since jaxlib
  0.11.0 give one breakdown: an f32 convert of a loop-carried bf16 tuple element (on CPU, with
  XLA's fusion off so that the convert stays an instruction) is a bf16 value widened either way,
  whether its operand is printed '%get-tuple-element.9' or '%arg_tuple.1#1'."""
  import glob
  import shutil

  import jax
  import jax.numpy as jnp

  from t5x_like.planning import memory_report

  def f(x, w):
    def body(i, carry):
      xb, acc = carry
      y = xb.astype(jnp.float32)
      return (y * 2).astype(jnp.bfloat16), acc + y @ w

    return jax.lax.fori_loop(0, 3, body, (x.astype(jnp.bfloat16), jnp.zeros((64, 64))))

  lowered = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64)))
  options = {'xla_disable_hlo_passes': 'fusion,fusion-wrapper'}
  compiled, dump = memory_report.compile_with_buffer_dump(lowered, options)
  memory = compiled.memory_analysis()
  with dump:
    old = memory_report.breakdown(dump.name, memory)
    compact = str(tmp_path / 'compact')
    shutil.copytree(dump.name, compact)
  (module,) = glob.glob(f'{compact}/*after_optimizations.txt')
  with open(module) as fh:
    text = fh.read()
  assert ' convert(%get-tuple-element.' in text  # the case this test is about
  with open(module, 'w') as fh:
    fh.write(_compact_gte(text))
  with open(module) as fh:
    new_text = fh.read()
  assert 'get-tuple-element' not in new_text and ' convert(%arg_tuple' in new_text
  new = memory_report.breakdown(compact, memory)
  assert new == old
  assert old['cpu_overstatement_bytes'] == 64 * 64 * 4 // 2
  assert any(t['widened_from_bf16'] for t in old['largest_temporaries'])


# ------------------------------------------------------------- --gpu: XLA's GPU compiler, no GPU


def test_bloom_176b_fits_an_a100_80gb_by_xlas_gpu_compile():
  """tr11's topology compiled for 384 A100s of 80 GB (48 nodes of 8) by XLA's GPU compiler on
  this CPU: the same state per GPU as the CPU compile, and XLA's GPU peak (37.8 GiB here) fits
  the 60 GiB JAX takes of one by default. At the peak, in a 1F1B tick's backward, the stage's
  fp32 gradient is held once: no conditional carries it (with one, XLA held it twice, at 54.6),
  and nothing beside it: each layer's backward adds its gradient into it in place (a tick's
  gradient of the stage, returned in bf16 and added after, held 6.9 GiB more, at 44.8). The
  token table's fp32 gradient is held once too: each tick's embedding backward scatters its rows
  into the accumulator (a whole-table gradient per tick held 5 GiB more, at 45.9)."""
  command = ['-m', 't5x_like.plan', '--config', 'configs/bloom_176b.py', '--gpu', 'a100-80gb']
  r = run_cli([*command, '--breakdown', '--json'], env={'XLA_PYTHON_CLIENT_MEM_FRACTION': ''})
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert report['compiled_for'] == 'a100-80gb' and report['mesh'] == [8, 12, 4]
  h = 14336
  layers = 72 * (12 * h * h + 13 * h) * 12 / 384
  embedding = 250880 * h * 12 / (4 * 8)
  assert abs(report['argument_gib'] - (layers + embedding) / 2**30) < 0.01
  assert report['usable_gib'] == 60.0 and report['fits']
  assert 35 < report['peak_gib'] < 40, report
  assert 'memory_breakdown' not in report and report['xla_flops_per_device'] is None
  # The buffers live where the most bytes are, each slice once: the allocation less XLA's packing
  # loss (1.0 GiB here; the point XLA's dump names had 32.8 GiB live).
  found = report['live_at_peak']
  assert 0.95 * report['peak_gib'] < found['live_gib'] <= report['peak_gib']
  # In a tick's backward, as it recomputes the stage's forward.
  assert '/while/body/' in found['peak_op'] and 'jvp(' in found['peak_op']
  # The stage's fp32 gradient, per device 6 layers of a quarter of the heads and FFN: one buffer
  # per kernel (the MLP's two share a shape), and no gradient of the stage in bf16 beside it.
  fp32 = sorted(r['shape'] for r in found['largest'] if r['shape'].startswith('f32[1,1,6,'))
  kernels = ['f32[1,1,6,14336,14336]'] * 2 + ['f32[1,1,6,14336,28,3,128]']
  assert fp32 == [*kernels, 'f32[1,1,6,28,128,14336]'], fp32
  assert not [r for r in found['largest'] if r['shape'].startswith('bf16[1,1,6,')], found
  # The token table's fp32 gradient, a quarter of the vocabulary per device: the accumulator only.
  tables = [r['shape'] for r in found['largest'] if r['shape'].endswith('[62720,14336]')]
  assert tables.count('f32[62720,14336]') == 1 and 'bf16[62720,14336]' not in tables, tables


def test_bloom_1b3_fits_its_16_h100s_by_xlas_gpu_compile():
  """configs/bloom_1b3.py on its own mesh (16 GPUs) compiled for H100s by XLA's GPU compiler on
  this CPU fits the 60 GiB JAX takes of one (35.9 GiB here: each rank's whole fp32 gradient, the
  fused loss's tiles and what the unrolled layers keep for their backward among it), and the
  cost model agrees (-0.4%). Until 2026-11-28 it ran data 8 x pipeline 2 in the GPipe order
  under save_dots, which keeps every layer's saved matmul outputs of all 17 ticks: 77.5 GiB,
  while the cost model said 13.5."""
  command = ['-m', 't5x_like.plan', '--config', 'configs/bloom_1b3.py', '--gpu', 'h100-80gb']
  r = run_cli([*command, '--json'], env={'XLA_PYTHON_CLIENT_MEM_FRACTION': ''})
  assert r.returncode == 0, r.stderr[-3000:]
  report = json.loads(r.stdout.strip().splitlines()[-1])
  assert report['compiled_for'] == 'h100-80gb' and report['fits'], report
  assert report['peak_gib'] < 0.7 * report['usable_gib'], report
  from t5x_like.config import load_config_file
  from t5x_like.planning import cost_model

  estimate = cost_model.estimate(load_config_file('configs/bloom_1b3.py'), 'h100-80gb')
  assert estimate['fits'] and abs(estimate['estimated_memory_gib'] / report['peak_gib'] - 1) < 0.06


def shrunk_a100_compile(config: str, grad_sync: str = 'auto', num_layers: int = 0, **train):
  """`plan --gpu a100-80gb --breakdown --json` of configs/`config` on its own mesh, its layers
  shrunk to hidden 256, 4 heads and seq 64 (and `num_layers` where given), without the ramp-up:
  the report."""
  shrunk = {
    'pipeline.grad_sync': grad_sync,
    'model.hidden_size': 256,
    'model.num_heads': 4,
    'train.seq_len': 64,
    'train.rampup_batch_size': '()',
    **({'model.num_layers': num_layers} if num_layers else {}),
    **{f'train.{key}': value for key, value in train.items()},
  }
  flags = [f'--config.{key}={value}' for key, value in shrunk.items()]
  command = ['-m', 't5x_like.plan', '--config', f'configs/{config}', '--gpu', 'a100-80gb']
  r = run_cli([*command, *flags, '--breakdown', '--json'])
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def gpu_gradient_reductions(cfg, kind: str = 'h100-80gb') -> collections.Counter:
  """{('loop' or 'outside', dtype): count} of the reduce-scatters and all-reduces of `cfg`'s
  train step compiled by XLA's GPU compiler for GPUs of `kind` (gpu_target), one per dtype in
  each (a combined collective's results all count), scalars left out."""
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout
  from t5x_like.planning import gpu_target
  from t5x_like.training import step as step_lib

  m = cfg.mesh
  gpus = gpu_target.devices(kind, m.num_devices)
  layout = make_layout(cfg, partitioning.make_mesh(m.data, m.pipeline, m.tensor, gpus))
  lowered = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches)
  hlo = gpu_target.compile_without_cache(lowered, kind)[0].as_text()
  inside = loop_computations(hlo)
  found: collections.Counter = collections.Counter()
  for computation, line in instructions(hlo):
    op = re.search(r'= (.+?) (?:all-reduce|reduce-scatter)(?:-start)?\(', line)
    if op:
      for dtype in set(re.findall(r'([a-z]+\d+)\[\d[\d,]*\]', op.group(1))):
        found['loop' if computation in inside else 'outside', dtype] += 1
  return found


def test_without_a_pipeline_tick_reduces_in_bf16_each_micro_batch_and_step_in_fp32_once():
  """A bf16 step on 2 data ranks without a pipeline, compiled for H100s. Under grad_sync 'tick'
  XLA reduce-scatters each micro-batch's layer gradients in bf16 as the backward's layer loop
  computes them (the LayerNorms' and the lookup's in fp32); under 'step' nothing is reduced
  inside the loops, and every gradient crosses the ranks once, after them, in fp32 (the
  planner's data-parallel terms, cost_model.estimate)."""
  base = dict(
    model=dict(dtype='bfloat16', num_layers=2, attention_impl='xla'),
    train=dict(global_batch_size=8),
    mesh=dict(data=2),
  )
  tick = gpu_gradient_reductions(small_config(**base, pipeline=dict(grad_sync='tick')).validate())
  assert tick['loop', 'bf16'] >= 1 and tick['loop', 'f32'] >= 1, tick
  assert not tick['outside', 'bf16'], tick
  step = gpu_gradient_reductions(small_config(**base, pipeline=dict(grad_sync='step')).validate())
  assert set(step) == {('outside', 'f32')}, step


def test_one_f_one_b_under_tick_holds_the_token_tables_gradient_split_and_twice():
  """tr11's mesh and vocabulary, its layers shrunk (hidden 256, 12 layers, seq 64), under
  pipeline.grad_sync='tick' (one schedule over the data ranks, the accumulator split over them):
  each tick's embedding backward scatters its rows into the split accumulator. When it returned a
  gradient of the whole table, XLA all-reduced it unsplit at every tick (tr11: 13.4 GiB), and
  that buffer was the peak (0.32 GiB here, its 250,880 x 256 rows 0.24). The split accumulator
  is there twice, the tick loop's value and the next: while the step counted zero gradients
  with `g == 0`, XLA merged that comparison's zero fill with the accumulator's initial zeros and
  kept it live through the loop, a third copy (tr11: 1.4 GiB)."""
  report = shrunk_a100_compile(
    'bloom_176b.py', grad_sync='tick', num_layers=12, global_batch_size=192
  )
  assert report['mesh'] == [8, 12, 4] and report['num_microbatches'] == 12
  whole_table = 250880 * 256 * 4 / 2**30
  assert report['peak_gib'] < whole_table, report['peak_gib']
  shapes = [r['shape'] for r in report['live_at_peak']['largest']]
  assert not any(shape.startswith('f32[250880,') for shape in shapes), shapes
  # A quarter of the vocabulary per tensor rank, split over the 8 data ranks.
  held = [r for r in report['live_at_peak']['largest'] if r['shape'] == 'f32[62720,32]']
  assert len([r for r in held if not r['argument']]) == 2, held


def test_one_f_one_b_over_the_whole_mesh_holds_its_kept_stage_inputs_once():
  """tr8_104b (tensor 4 x pipeline 32, one data rank: one schedule over the whole mesh), its
  layers shrunk (hidden 256, seq 64): the 2P - 1 = 63 kept stage inputs are one buffer at the
  peak. While the forward's conditional (which skips the drain ticks) wrote them, XLA copied
  the ring for the branch that passes it through, a second buffer (tr8_104b: 3.9 GiB)."""
  report = shrunk_a100_compile('tr8_104b.py', global_batch_size=64)
  assert report['mesh'] == [1, 32, 4]
  kept = [r for r in report['live_at_peak']['largest'] if r['shape'] == 'bf16[1,63,1,64,256]']
  assert len(kept) == 1, kept


def test_a_gpu_compile_of_two_nodes_says_when_the_step_does_not_fit(monkeypatch):
  """tiny on 2 x 1 x 8 H100s: each GPU holds a quarter of the state (data 4 x tensor 4 split
  it); with the memory JAX may take cut to 1 MiB, the same compile does not fit."""
  from t5x_like.cli import plan as plan_cli
  from t5x_like.config import load_config_file
  from t5x_like.planning import gpu_target

  cfg = load_config_file(
    'configs/tiny.py',
    {'mesh.data': 4, 'mesh.tensor': 4, 'train.global_batch_size': 16, 'train.micro_batch_size': 4},
  )
  assert gpu_target.topology_for(cfg.mesh.num_devices) == '2x1x8'
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', str(2**20 / (79.6 * 2**30)))
  report = plan_cli.plan(cfg, 'h100-80gb')
  assert report['compiled_for'] == 'h100-80gb' and report['mesh'] == [4, 1, 4]
  state = 12 * cfg.model.num_params() / 16  # fp32 params and both moments, split 16 ways
  assert state < report['argument_gib'] * 2**30 < 1.2 * state
  assert report['usable_gib'] * 2**30 == pytest.approx(2**20)
  assert report['peak_gib'] * 2**30 > 2**20 and not report['fits']


@pytest.mark.parametrize(
  'gpu, attention_impl, runs',
  [('h100-80gb', 'mosaic', 'mosaic'), ('h200', 'auto', 'mosaic'), ('a100-40gb', 'auto', 'pallas')],
)
def test_a_gpu_compile_checks_and_resolves_attention_for_its_gpus(
  capsys, gpu, attention_impl, runs
):
  """The config is checked for the GPUs compiled for, not this CPU (where the Mosaic kernels run
  in interpret mode and refuse save_dots), and 'auto' is resolved by their family's order."""
  from t5x_like.cli import plan as plan_cli

  args = ['--config', 'configs/tiny.py', '--gpu', gpu, '--json', '--config.model.num_heads=2']
  args += ['--config.model.dtype=bfloat16']
  args += [
    f'--config.model.attention_impl={attention_impl}',
    '--config.model.remat_policy=save_dots',
  ]
  assert plan_cli.main(args) == 0, capsys.readouterr().err[-2000:]
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report['compiled_for'] == gpu and report['attention_impl'] == runs
  assert report['xla_options'] == {}


def test_live_bytes_count_shared_bytes_once():
  """Where the most bytes are live: values sharing bytes of an allocation (a loop's value and
  its body's parameter) count them once, live ranges include both ends, and each allocation's
  bytes add up."""
  from t5x_like.planning import memory_report

  values = [
    (0, 0, 100, 0, 3),  # allocation 0, bytes 0-100, positions 0-3
    (0, 0, 100, 2, 5),  # the same bytes, positions 2-5: counted once
    (0, 50, 100, 4, 4),  # overlaps bytes 50-100 of the above at 4: 50 more
    (0, 200, 10, 5, 6),
    (1, 0, 7, 3, 3),  # another allocation at the same offsets
  ]
  live = memory_report.live_bytes_by_position(values, 8)
  assert live.tolist() == [100, 100, 100, 107, 150, 110, 10, 0]
  # Counted a few positions at a time (bounded memory), the same.
  for cells in (1, 7, 16):
    assert (
      memory_report.live_bytes_by_position(values, 8, max_cells=cells).tolist() == live.tolist()
    )


def test_a_gpu_compiles_breakdown_lists_xlas_buffers_at_its_peak(capsys):
  """--gpu --breakdown: the buffers live at the GPU program's peak, largest first, each with what
  defines it: the state's arguments by their tree path, the rest by op name or XLA's opcode."""
  from t5x_like.cli import plan as plan_cli

  args = ['--config', 'configs/tiny.py', '--gpu', 'h100-80gb', '--breakdown']
  assert plan_cli.main([*args, '--json']) == 0, capsys.readouterr().err[-2000:]
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  found = report['live_at_peak']
  assert 'memory_breakdown' not in report and found['peak_instruction']
  sizes = [r['gib'] for r in found['largest']]
  assert sizes == sorted(sizes, reverse=True) and len(sizes) == 15
  assert sum(sizes) <= found['live_gib'] <= report['peak_gib']
  for r in found['largest']:  # each buffer is its shape's bytes, and defined by something
    dtype, dims = r['shape'].rstrip(']').split('[')
    elements = math.prod(int(d) for d in dims.split(',') if d)
    assert r['gib'] * 2**30 == elements * {'f32': 4, 'bf16': 2, 's32': 4, 'u16': 2}[dtype]
    assert r['defined_by']
  # tiny (fp32, remat 'none') peaks in its backward pass, the forward's stacked residuals (the
  # layer scan's outputs) all still live beside the logits' gradient.
  assert 'transpose(jvp(Transformer))' in found['peak_op']
  residuals = [r for r in found['largest'] if r['defined_by'].endswith('jvp(Transformer)/while')]
  assert len(residuals) >= 9 and all(r['shape'] == 'f32[4,4,128,512]' for r in residuals)
  assert plan_cli.main(args) == 0
  assert "XLA's peak" in capsys.readouterr().out


def test_a_gpu_compile_without_a_triton_gemm_tiling_falls_back_to_cublas(capsys):
  """head_dim 224 (BLOOM-176B's NHEADS 64 of the chronicles): with no GPU to autotune on, XLA
  finds no Triton tiling for its projections' GEMMs; the step compiles with cuBLAS GEMMs."""
  from t5x_like.cli import plan as plan_cli

  args = ['--config', 'configs/tiny.py', '--gpu', 'a100-80gb', '--json']
  args += ['--config.model.hidden_size=448', '--config.model.num_heads=2']
  assert plan_cli.main(args) == 0, capsys.readouterr().err[-2000:]
  report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert report['xla_options'] == {'xla_gpu_enable_triton_gemm': False} and report['peak_gib'] > 0


def test_a_gpu_compile_needs_no_jax_platforms_setting():
  """`plan --gpu` in a shell without JAX_PLATFORMS, on a machine with jax's CUDA plugin and no
  GPU or cuDNN (this one, CI's, a login node): it compiles. It used to start the plugin's
  backend, whose failure left the plugin without GPU topologies, and then told the user to
  install the plugin they had."""
  args = ['-m', 't5x_like.plan', '--config', 'configs/tiny.py', '--gpu', 'h100-80gb', '--json']
  r = run_cli(args, env={'JAX_PLATFORMS': ''})
  assert r.returncode == 0, r.stderr[-3000:]
  assert json.loads(r.stdout.strip().splitlines()[-1])['compiled_for'] == 'h100-80gb'


def test_any_other_gpu_compiler_failure_is_one_error():
  import jax

  from t5x_like.config import ConfigError
  from t5x_like.planning import gpu_target

  class Lowered:
    def compile(self, compiler_options=None):
      raise jax.errors.JaxRuntimeError('INTERNAL: RET_CHECK failure\n  at some_pass.cc:12')

  with pytest.raises(ConfigError) as info:
    gpu_target.compile_without_cache(Lowered(), 'h200')
  assert str(info.value) == (
    f"XLA's GPU compiler (jax {jax.__version__}) failed to compile the step for h200: "
    'INTERNAL: RET_CHECK failure'
  )


def test_a_gpu_compile_refuses_an_attention_its_gpus_cannot_run(capsys):
  from t5x_like.cli import plan as plan_cli

  args = ['--config', 'configs/tiny.py', '--gpu', 'a100-80gb', '--config.model.num_heads=2']
  assert plan_cli.main([*args, '--config.model.attention_impl=mosaic']) == 2
  assert 'need compute capability 9.x, got 8.0' in capsys.readouterr().err


@pytest.mark.parametrize(
  'args, message',
  [
    (['--gpu', 'v100'], "--gpu 'v100': no such GPU kind to compile for; one of: a100-40gb"),
    (
      [
        '--gpu',
        'h200',
        '--config.mesh.data=3',
        '--config.mesh.tensor=4',
        '--config.train.global_batch_size=12',
      ],
      '12 GPUs: a mesh of more than 8 is compiled for whole nodes of 8',
    ),
  ],
)
def test_bad_gpu_compile_requests_are_one_error(args, message):
  r = run_cli(['-m', 't5x_like.plan', '--config', 'configs/tiny.py', *args])
  assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
  assert 'Traceback' not in r.stderr


def test_a_memory_share_jax_cannot_use_is_refused_before_the_gpu_compile(monkeypatch):
  from t5x_like.cli import plan as plan_cli
  from t5x_like.config import ConfigError, load_config_file

  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', 'abc')
  compiles = []
  monkeypatch.setattr(plan_cli.gpu_target, 'compile_without_cache', lambda *a: compiles.append(a))
  with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='abc' is not a number"):
    plan_cli.plan(load_config_file('configs/tiny.py'), 'h200')
  assert compiles == []


def test_a_machine_without_the_cuda_plugin_is_told_what_to_install(monkeypatch):
  import jax
  from jax.experimental import topologies

  from t5x_like.config import ConfigError
  from t5x_like.planning import gpu_target

  def no_plugin(*args, **kwargs):
    raise RuntimeError('Unknown backend cuda')  # what jax says without the plugin

  monkeypatch.setattr(topologies, 'get_topology_desc', no_plugin)
  with pytest.raises(ConfigError) as info:
    gpu_target.devices('h100-80gb', 8)
  assert 'cannot compile for h100-80gb on this machine (RuntimeError: Unknown backend cuda)' in str(
    info.value
  )
  assert f'pip install jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt==' in str(info.value)
