"""benchmarks/gpu_suite.py on CPU (--smoke): every stage runs and reports what it measured; no
timing is asserted. On a GPU the same script runs the kernel tests compiled (docs/tests.md). The
profile's categories are checked on hand-written traces: a GPU's (kernels on stream tracks) and
a CPU's (thunks on host threads, a while loop enclosing its body)."""

import gzip
import json
import os
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import FUSION_EMITTERS_OFF, REPO

from t5x_like.kernels import MosaicBlocks, attention_reference, mosaic_attention

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import attention as attention_benchmark  # noqa: E402  (scripts, not package modules)
import gpu_suite  # noqa: E402
import mosaic_sweep  # noqa: E402
import profile_trace  # noqa: E402


def test_smoke_run_reports_every_stage(tmp_path, capsys, monkeypatch):
  # Its processes compile with XLA's CPU fusion emitters, whose kernels the profile reads.
  monkeypatch.setenv('XLA_FLAGS', os.environ['XLA_FLAGS'].replace(FUSION_EMITTERS_OFF, ''))
  out = tmp_path / 'suite.json'
  assert gpu_suite.main(['--smoke', '--json', str(out)]) == 0
  report = json.loads(out.read_text())
  stages = report['stages']
  assert report['ok'] and report['platform'] == 'cpu'
  # No kernel tests in smoke; every other stage, each timed.
  assert set(stages) == {'plan', 'matmul', 'attention', 'step', 'loss', 'shard176b', 'tune'}
  assert set(report['stage_timing']) == set(stages)

  # Attention: every implementation at the smoke length; the tokamax rows run tokamax's XLA
  # implementation on CPU and say so; the no-bias row is checked without ALiBi.
  rows = {r['impl']: r for r in stages['attention']['results']}
  # mosaic's rows come from a second process after the others'.
  assert list(rows) == [*gpu_suite.ATTENTION_IMPLS.split(','), gpu_suite.NEW_ATTENTION_IMPLS]
  assert 'new_failed' not in stages['attention']
  assert set(rows) <= set(attention_benchmark.IMPLEMENTATIONS)
  assert 'needs a GPU' in rows['cudnn']['skipped']
  for impl in ('pallas', 'tokamax', 'tokamax-nobias'):
    assert rows[impl]['correct'], rows[impl]
    assert rows[impl]['fwd_tflops'] > 0 and rows[impl]['fwd_bwd_pct_peak'] > 0
  assert "tokamax implementation='xla'" in rows['tokamax']['note']
  assert (
    rows['tokamax-nobias']['alibi'] is False and 'target only' in rows['tokamax-nobias']['note']
  )
  # Our Mosaic GPU kernels, forward and backward, in interpret mode: checked against the fp32
  # reference like every row, not timed (an interpreter's time says nothing of the kernel).
  mosaic = rows['mosaic']
  assert (
    mosaic['correct'] and 'interpret mode' in mosaic['note'] and 'not timed' in mosaic['untimed']
  )
  assert set(mosaic['errors']) == {'out', 'dq', 'dk', 'dv'}
  assert max(mosaic['errors'].values()) <= attention_benchmark.TOLERANCE
  assert 'fwd_tflops' not in mosaic

  # The step per implementation, each checked against xla's first loss; auto resolves to xla on
  # CPU and is not measured twice; every measured step has its profile.
  steps = stages['step']['results']
  assert set(steps) == set(gpu_suite.STEP_IMPLS)
  assert steps['pallas']['first_loss_vs_xla'] <= 2e-2
  assert steps['tokamax']['first_loss_vs_xla'] <= 2e-2
  assert steps['xla']['mfu'] > 0 and steps['xla']['xla_peak_bytes'] > 0
  assert steps['xla']['measured_peak_bytes'] is None  # CPU has no allocator statistics
  assert steps['mosaic'] == {'skipped': gpu_suite.SMOKE_SKIPS_STEP['mosaic']}  # interpret: slow
  assert steps['auto'] == {**steps['auto'], 'resolved_to': 'xla', 'same_as': 'xla'}
  for impl in ('xla', 'pallas', 'tokamax'):
    profile = steps[impl]['profile']
    assert profile['events_from'] == 'host' and profile['events'] > 0
    assert set(profile['ms_per_step']) == {*profile_trace.CATEGORIES, profile_trace.IDLE}
    for category in ('matmul', 'attention', 'norm/gelu/elementwise', 'loss', 'optimizer'):
      assert profile['ms_per_step'][category] > 0, (impl, category, profile)
    assert profile['recognised_by']['source'] > profile['recognised_by'].get('nothing', 0)
    # Kept beside the report (the GPU run keeps KEEP_PROFILE_OF's): categorised again, the same.
    kept = tmp_path / f'profile_{impl}'
    trace = profile_trace.load_trace(f'{kept}.trace.json.gz')
    with gzip.open(f'{kept}.hlo.txt.gz', 'rt') as f:
      again = profile_trace.summarise(trace, f.read(), profile['steps'], profile['step_ms'] / 1e3)
    assert again['recognised_by'] == profile['recognised_by']
    assert again['ms_per_step'] == pytest.approx(profile['ms_per_step'])

  # The loss variants with the fastest attention: the config's own from the step stage.
  loss = stages['loss']
  assert list(loss['results']) == ['chunked', 'fused']
  assert loss['attention'] in ('xla', 'pallas', 'tokamax')
  assert loss['results']['chunked']['from'] == 'the step stage'
  assert loss['results']['fused']['cross_entropy_impl'] == 'fused'
  assert loss['results']['fused']['first_loss_vs_first'] <= 2e-2

  # The tune variants with the same attention: the base from the step stage, then one variant
  # of each kind (a config override, XLA flags), each against the base's speed and first loss.
  tuned = stages['tune']
  assert tuned['attention'] == loss['attention']
  assert list(tuned['results']) == ['base', *gpu_suite.SMOKE_TUNE_VARIANTS]
  assert tuned['results']['base']['from'] == 'the step stage'
  # The base is the reference step (the chunked loss, the layers scanned); the first variant
  # configs/bloom_1b3.py's own model (the fused loss, unrolled), the second that at a larger
  # micro-batch.
  base = tuned['results']['base']
  assert base['cross_entropy_impl'] == 'chunked' and not base['unroll_layers']
  unrolled, fused = tuned['results']['fused-unrolled'], tuned['results']['fused-unrolled-mbs8']
  assert unrolled['cross_entropy_impl'] == fused['cross_entropy_impl'] == 'fused'
  assert unrolled['unroll_layers'] and fused['unroll_layers']
  assert '--config.train.micro_batch_size=4' in fused['overrides']
  for variant in (unrolled, fused):
    assert variant['first_loss_vs_base'] <= 2e-2 and variant['speedup_vs_base'] > 0
  # The config's own step is profiled, its trace and HLO kept apart from the step stage's.
  assert 'profile' in unrolled and 'profile' not in fused
  assert unrolled['profile']['ms_per_step']['loss'] > 0
  kept = tmp_path / 'tune' / f'profile_{tuned["attention"]}'
  assert os.path.exists(f'{kept}.trace.json.gz') and os.path.exists(f'{kept}.hlo.txt.gz')

  # BLOOM-176B's shard: three FLOP counts and the planner's all-reduces for two GPU kinds.
  shard = stages['shard176b']['results']
  assert set(shard) == {'xla', 'tokamax'}
  for result in shard.values():
    assert result['finite'] and set(result['tflops']) == {'tr11', 'model', 'executed'}
    assert result['tflops']['tr11'] == pytest.approx(4 / 3 * result['tflops']['model'])
    assert set(result['tp_allreduce']) == {'h100-80gb', 'a100-80gb'}

  # plan: XLA's CPU figure and its GPU estimate (0.10.2's dump parses), the cost model's.
  plan = stages['plan']
  assert plan['peak_gib'] > 0 and plan['gpu_estimate_peak_gib'] is not None
  assert plan['breakdown_error'] is None
  assert plan['estimate']['gpu'] == 'h100-80gb'  # the cost model's stand-in on CPU
  assert plan['estimate']['memory_gib'] > 0
  # plan --gpu: the smoke step compiled for the stand-in H100, 'auto' attention resolved there.
  compiled = plan['gpu_compile']
  assert compiled['gpu'] == 'h100-80gb' and compiled['attention_impl'] == 'mosaic'
  assert 0 < compiled['peak_gib'] < plan['peak_gib']  # the CPU's runs xla attention, in f32
  assert stages['matmul']['measured_tflops'] > 0

  text = capsys.readouterr().out  # the summary
  for line in (
    'step pallas:',
    'step profile',
    'loss fused',
    'tune fused-unrolled-mbs8',
    '176B shard tok',
  ):
    assert line in text
  assert 'attention mosaic seq 64: checked, not timed' in text
  assert 'step mosaic: skipped: not run with --smoke' in text
  assert 'plan --gpu h100-80gb (no GPU used; mosaic attention): XLA peak' in text


def test_plan_gpu_compile_is_set_beside_the_step_of_its_attention():
  gib = 2**30
  steps = {
    'pallas': {'xla_peak_bytes': 40 * gib},
    'auto': {'resolved_to': 'mosaic', 'same_as': 'mosaic'},
    'mosaic': {'xla_peak_bytes': 46.5 * gib, 'measured_peak_bytes': 46.75 * gib},
  }
  compiled = {'gpu': 'h100-80gb', 'attention_impl': 'mosaic', 'peak_gib': 46.5}
  assert gpu_suite.gpu_compile_lines(compiled, steps) == [
    'plan --gpu h100-80gb (no GPU used; mosaic attention): XLA peak 46.500 GiB; the mosaic step '
    "here: XLA 46.500, the allocator's peak 46.750"
  ]
  assert gpu_suite.gpu_compile_lines({'gpu': 'h200', 'failed': 'exit 2'}, steps) == [
    'plan --gpu h200: FAILED exit 2'
  ]


def test_without_a_gpu_the_full_suite_refuses(tmp_path, capsys):
  assert gpu_suite.main(['--json', str(tmp_path / 'suite.json')]) == 2
  assert 'no GPU here' in capsys.readouterr().err
  assert not (tmp_path / 'suite.json').exists()


def test_only_runs_the_stages_named_and_the_budget_skips_what_does_not_fit(tmp_path, capsys):
  args = gpu_suite.parse_args(['--json', 'x', '--only', 'loss,step'])
  assert args.stages == ['step', 'loss']  # in the suite's order
  with pytest.raises(SystemExit):
    gpu_suite.parse_args(['--json', 'x', '--only', 'steps'])
  out = tmp_path / 'suite.json'
  assert gpu_suite.main(['--smoke', '--json', str(out), '--only', 'matmul', '--budget_s', '1']) == 0
  report = json.loads(out.read_text())  # not run is not a failure: the report says incomplete
  assert 'out of the time budget' in report['stages']['matmul']['skipped']
  assert report['incomplete'] == ['matmul']
  assert 'matmul: skipped' in capsys.readouterr().out


def test_mosaic_is_not_runnable_below_hopper_nor_interpreted_at_long_lengths(monkeypatch):
  """On a GPU of compute capability < 9.0 the mosaic row says why it cannot run (no kernel is
  traced); on CPU, lengths above MOSAIC_INTERPRET_MAX_SEQ are skipped (interpret mode would take
  minutes) while shorter ones run."""

  class Ampere:
    platform, device_kind, compute_capability = 'gpu', 'NVIDIA A100-SXM4-80GB', '8.0'

  monkeypatch.setattr(attention_benchmark.jax, 'devices', lambda *a: [Ampere()])
  impl = attention_benchmark.make_impl('mosaic', 'gpu', None, None)
  assert impl.fn is None and 'compute capability 9.x, got 8.0' in impl.reason
  monkeypatch.undo()
  assert attention_benchmark.make_impl('mosaic', 'tpu', None, None).fn is None

  long = attention_benchmark.MOSAIC_INTERPRET_MAX_SEQ + 64
  args = attention_benchmark.parse_args(['--smoke', '--seqs', str(long), '--impls', 'mosaic'])
  (row,) = attention_benchmark.run(args)['results']
  assert row['seq'] == long and 'too slow here beyond seq' in row['skipped']
  assert 'interpret mode' in row['note']


@pytest.mark.parametrize(
  ('failing', 'wrong', 'new_code', 'ok'),
  [
    ('mosaic', None, 1, False),
    ('pallas', None, 1, False),
    ('tokamax-nobias', None, 1, True),  # a comparison, not a core row
    (None, 'mosaic', 1, False),
    (None, None, None, False),  # mosaic's process ran out of time (a hung kernel)
  ],
)
def test_the_attention_stage_fails_on_core_failures_and_any_wrong_row(
  monkeypatch, tmp_path, failing, wrong, new_code, ok
):
  """mosaic runs in a process of its own after the others, so that a hang (out of its time)
  costs its rows only: the others' rows stand, and the stage fails, as it does on a core row's
  failure to run (CORE_ATTENTION) or any row's wrong result."""
  new = gpu_suite.NEW_ATTENTION_IMPLS.split(',')
  rows = []
  for impl in gpu_suite.ATTENTION_IMPLS.split(',') + new:
    if impl == failing:
      rows.append({'impl': impl, 'seq': 2048, 'failed': 'MosaicError: lowering failed'})
    elif not (new_code is None and impl in new):
      rows.append({'impl': impl, 'seq': 2048, 'correct': impl != wrong, 'errors': {'out': 0.0}})
  limits = {}

  def run_child(command, limit_s, **_):
    name = os.path.basename(command[command.index('--json') + 1])
    limits[name] = limit_s
    code = new_code if name == 'attention_new.json' else 1
    return {'code': code, 'wall_s': 1.0, 'tail': 'timed out', 'output': ''}

  def read_json(path):
    in_new = os.path.basename(path) == 'attention_new.json'
    return {'results': [r for r in rows if (r['impl'] in new) == in_new]}

  monkeypatch.setattr(gpu_suite, 'run_child', run_child)
  monkeypatch.setattr(gpu_suite, 'read_json', read_json)
  stage = gpu_suite.attention(False, str(tmp_path), 180)
  assert limits == {'attention.json': 120, 'attention_new.json': gpu_suite.NEW_ATTENTION_LIMIT_S}
  assert stage['ok'] is ok
  text = '\n'.join(gpu_suite.attention_lines(stage))
  if failing:
    assert f'attention {failing} seq 2048: FAILED MosaicError: lowering failed' in text
  if new_code is None:
    assert 'attention mosaic: its process FAILED' in text
  else:
    assert 'new_failed' not in stage


def test_the_step_stage_fails_on_core_failures_and_the_loss_stage_skips_a_wrong_loss(
  monkeypatch, tmp_path
):
  """A step whose implementation fails to run fails the stage (all of STEP_IMPLS are in
  CORE_STEP); a first loss off xla's fails it whatever the implementation, and the loss stage's
  'fastest attention' is never one whose first loss is off."""
  loss = {'xla': 2.0, 'pallas': 2.0, 'tokamax': 2.0, 'mosaic': 2.0}
  speed = {'xla': 1.5, 'pallas': 1.0, 'tokamax': 1.1, 'mosaic': 0.9}
  failing: set[str] = set()

  def step_child(specs, workdir, limit_s, extra):
    (impl,) = specs
    if impl in failing:
      return {impl: {'failed': 'exit 1; output ends: lowering failed'}}
    if impl == 'cudnn':
      return {impl: {'skipped': 'cuDNN attention needs a GPU'}}
    if impl == 'auto':
      return {impl: {'resolved_to': 'pallas', 'same_as': 'pallas'}}
    return {impl: {'losses': [loss[impl]], 'step_s_median': speed[impl]}}

  monkeypatch.setattr(gpu_suite, 'step_child', step_child)
  clock = gpu_suite.Clock(1000.0)
  run = lambda: gpu_suite.steps(False, str(tmp_path), clock, gpu_suite.STEP_IMPLS)

  assert set(gpu_suite.STEP_IMPLS) <= set(gpu_suite.CORE_STEP)
  failing.add('mosaic')
  stage = run()
  assert not stage['ok'] and 'failed' in stage['results']['mosaic']
  assert gpu_suite.fastest(stage['results']) == 'pallas'
  failing.clear()
  assert run()['ok'] and gpu_suite.fastest(run()['results']) == 'mosaic'
  failing.add('pallas')
  assert not run()['ok']
  failing.clear()
  loss['mosaic'] = 2.5  # 25% off xla's first loss
  stage = run()
  assert not stage['ok'] and stage['results']['mosaic']['first_loss_vs_xla'] > 0.2
  assert gpu_suite.fastest(stage['results']) == 'pallas'


def test_a_tune_variant_that_does_not_run_is_reported_and_a_wrong_loss_fails(monkeypatch, tmp_path):
  """The tune stage measures its base when the step stage did not run in the same call (the
  attention --base_attention names), passes each variant's config overrides and XLA flags (in
  its environment, with TUNE_MEM_FRACTION), reports a variant that does not run without failing,
  and fails on a first loss off the base's."""
  calls, fractions = [], []
  loss = {'base': 2.0, 'fused-unrolled-mbs8': 2.0, 'a-flag': 2.0}
  variants = {
    'fused-unrolled-mbs8': gpu_suite.TUNE_VARIANTS['fused-unrolled-mbs8'],
    'a-flag': ((), '--xla_gpu_enable_cublaslt=true'),
    'unknown-flag': ((), '--xla_gpu_no_such_flag=true'),
  }

  def step_child(specs, workdir, limit_s, extra, env=None, tag='step'):
    name = tag.removeprefix('tune_')
    calls.append((specs, name, (env or {}).get('XLA_FLAGS', ''), extra))
    fractions.append((env or {}).get('XLA_PYTHON_CLIENT_MEM_FRACTION'))
    if name == 'unknown-flag':
      return {specs[0]: {'failed': 'exit 1; output ends: Unknown flags in XLA_FLAGS'}}
    return {specs[0]: {'losses': [loss[name]], 'step_s_median': 0.5 if name == 'base' else 0.4}}

  monkeypatch.setattr(gpu_suite, 'step_child', step_child)
  monkeypatch.setattr(gpu_suite, 'TUNE_VARIANTS', variants)
  monkeypatch.setenv('XLA_FLAGS', '--xla_dump_to=somewhere')
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  stage = gpu_suite.tune(False, str(tmp_path), gpu_suite.Clock(1000.0), {}, 'mosaic')
  # Micro-batches of 8 need more than JAX's default share of an H100; the user's share wins.
  assert fractions == [gpu_suite.TUNE_MEM_FRACTION] * len(calls)
  assert stage['ok'] and stage['attention'] == 'mosaic'
  assert [name for _, name, _, _ in calls] == ['base', *variants]
  assert all(specs == ['mosaic'] for specs, *_ in calls)
  flags = {name: flags for _, name, flags, _ in calls}
  assert flags['base'] == flags['fused-unrolled-mbs8'] == ''  # the suite's environment, unchanged
  assert flags['a-flag'] == '--xla_dump_to=somewhere --xla_gpu_enable_cublaslt=true'
  assert '--config.train.micro_batch_size=8' in calls[1][3]
  # The base measured here is the step stage's reference step; the variants name their model.
  assert set(gpu_suite.REFERENCE_STEP) <= set(calls[0][3])
  assert not set(gpu_suite.REFERENCE_STEP) & set(calls[1][3])
  assert stage['results']['fused-unrolled-mbs8']['speedup_vs_base'] == pytest.approx(1.25)
  assert 'Unknown flags' in stage['results']['unknown-flag']['failed']
  loss['a-flag'] = 2.5
  calls.clear()
  fractions.clear()
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.8')
  step_rows = {'pallas': {'losses': [2.0], 'step_s_median': 0.5}}
  stage = gpu_suite.tune(False, str(tmp_path), gpu_suite.Clock(1000.0), step_rows, 'mosaic')
  assert not stage['ok'] and stage['results']['a-flag']['first_loss_vs_base'] == 0.25
  assert stage['attention'] == 'pallas' and stage['results']['base']['from'] == 'the step stage'
  assert 'base' not in [name for _, name, _, _ in calls]
  assert fractions == ['0.8'] * len(calls)


def test_the_tests_stage_runs_the_kernel_tests_and_names_each_outcome(monkeypatch):
  """On the GPU: the tests of tests/kernels that run a kernel (GPU_TESTS, less the multi-device
  ones), verbose, at full fp32 precision; every test's outcome in the report, the ones that did
  not pass in the summary."""
  seen = {}
  output = (
    'tests/kernels/test_flash_attention.py::test_forward_and_gradients_match_the_reference[a] '
    'PASSED [ 50%]\n'
    'tests/kernels/test_mosaic_attention.py::test_the_kernels_fail_a_wrong_alibi_row FAILED '
    '[100%]\n1 failed, 1 passed in 9.0s\n'
  )

  def run_child(command, limit_s, env=None, **_):
    seen.update(command=command, env=env)
    return {'code': 1, 'wall_s': 9.0, 'tail': output, 'output': output}

  monkeypatch.setattr(gpu_suite, 'run_child', run_child)
  stage = gpu_suite.kernel_tests(150)
  selection = seen['command'][seen['command'].index('-k') + 1]
  assert gpu_suite.GPU_TESTS in selection and gpu_suite.MULTI_DEVICE_TESTS in selection
  assert '-v' in seen['command'] and seen['env']['JAX_DEFAULT_MATMUL_PRECISION'] == 'highest'
  assert not stage['ok'] and stage['summary'] == '1 failed, 1 passed in 9.0s'
  assert list(stage['outcomes'].values()) == ['PASSED', 'FAILED']
  report = {'date': 'd', 'device': 'gpu', 'platform': 'gpu', 'jax': 'j', 'wall_s': 9, 'ok': False}
  text = gpu_suite.summary({**report, 'stages': {'tests': stage}})
  assert 'FAILED tests/kernels/test_mosaic_attention.py::test_the_kernels_fail_a_wrong' in text
  assert 'PASSED' not in text


# --- the profile's categories on hand-written traces -----------------------------------------

HLO = """HloModule jit_step, is_scheduled=true

FileNames
1 "/repo/kernels/flash_attention.py"
2 "/repo/t5x_like/model/transformer.py"
3 "/repo/kernels/cross_entropy.py"
4 "/venv/optax/_src/transform.py"
5 "/repo/t5x_like/training/step.py"

FunctionNames
1 "flash_attention"
2 "attention_qkv"
3 "layer_norm"
4 "vocab_parallel_cross_entropy"
5 "scale_by_adam"
6 "accumulate_grads"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}
2 {file_name_id=2 function_name_id=2 line=20 end_line=20 column=1 end_column=2}
3 {file_name_id=2 function_name_id=3 line=30 end_line=30 column=1 end_column=2}
4 {file_name_id=3 function_name_id=4 line=40 end_line=40 column=1 end_column=2}
5 {file_name_id=4 function_name_id=5 line=50 end_line=50 column=1 end_column=2}
6 {file_name_id=5 function_name_id=6 line=60 end_line=60 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}
5 {file_location_id=5 parent_frame_id=5}
6 {file_location_id=6 parent_frame_id=6}

%fused_norm (p0.norm: f32[8,16]) -> bf16[8,16] {
  %p0.norm = f32[8,16]{1,0} parameter(0)
  %m.norm = f32[8,16]{1,0} multiply(%p0.norm, %p0.norm)
  ROOT %c.norm = bf16[8,16]{1,0} convert(%m.norm)
}

%fused_loss (p0.loss: f32[8,16]) -> f32[8] {
  %p0.loss = f32[8,16]{1,0} parameter(0)
  %e.loss = f32[8,16]{1,0} exponential(%p0.loss)
  ROOT %r.loss = f32[8]{0} reduce(%e.loss, %p0.loss), dimensions={1}, to_apply=%add
}

%fused_copy (p0.copy: bf16[8,16]) -> bf16[16,8] {
  %p0.copy = bf16[8,16]{1,0} parameter(0)
  ROOT %t.copy = bf16[16,8]{1,0} transpose(%p0.copy), dimensions={1,0}
}

%fused_adam (p0.adam: f32[16]) -> f32[16] {
  %p0.adam = f32[16]{0} parameter(0)
  %s.adam = f32[16]{0} sqrt(%p0.adam)
  ROOT %d.adam = f32[16]{0} divide(%p0.adam, %s.adam)
}

%fused_dus (p0.dus: bf16[4,8], p1.dus: bf16[1,8], p2.dus: s32[]) -> bf16[4,8] {
  %p0.dus = bf16[4,8]{1,0} parameter(0)
  %p1.dus = bf16[1,8]{1,0} parameter(1)
  %p2.dus = s32[] parameter(2)
  %z.dus = s32[] constant(0)
  %i.dus = s32[] subtract(%p2.dus, %z.dus)
  ROOT %u.dus = bf16[4,8]{1,0} dynamic-update-slice(%p0.dus, %p1.dus, %i.dus, %z.dus)
}

%body (b.body: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %b.body = (s32[], f32[8,16]) parameter(0)
  %x.body = f32[8,16]{1,0} get-tuple-element(%b.body), index=1
  %custom-call.1 = bf16[8,16]{1,0} custom-call(%x.body), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/while/body/jvp(Transformer)/layers/attn/pallas_call" stack_frame_id=1}
  %custom-call.2 = bf16[8,16]{1,0} custom-call(%x.body, %x.body), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/while/body/jvp(Transformer)/layers/attn/bse,encd->bsncd/dot_general" stack_frame_id=2}
  %loop_norm_fusion = bf16[8,16]{1,0} fusion(%x.body), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/while/body/jvp(Transformer)/layers/ln1/mul" stack_frame_id=3}
  %loss_fusion = f32[8]{0} fusion(%x.body), kind=kInput, calls=%fused_loss, metadata={op_name="jit(step)/while/body/jvp()/reduce_sum" stack_frame_id=4}
  %transpose_fusion = bf16[16,8]{1,0} fusion(%custom-call.1), kind=kLoop, calls=%fused_copy
  %all-reduce.3 = f32[8,16]{1,0} all-reduce(%x.body), replica_groups={}, to_apply=%add
  ROOT %t.body = (s32[], f32[8,16]) tuple(%b.body, %x.body)
}

ENTRY %main (a: f32[16], x: f32[8,16], w: bf16[4,8], u: bf16[1,8], i: s32[]) -> f32[16] {
  %a = f32[16]{0} parameter(0)
  %x = f32[8,16]{1,0} parameter(1)
  %w = bf16[4,8]{1,0} parameter(2)
  %u = bf16[1,8]{1,0} parameter(3)
  %i = s32[] parameter(4)
  %while.1 = (s32[], f32[8,16]) while(%x), condition=%cond, body=%body, metadata={op_name="jit(step)/while" stack_frame_id=6}
  %dynamic-update-slice_fusion = bf16[4,8]{1,0} fusion(%w, %u, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/while/body/transpose(jvp(Transformer))" stack_frame_id=6}
  ROOT %adam_fusion = f32[16]{0} fusion(%a), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(step)/mul" stack_frame_id=5}
}
"""  # noqa: E501 (HLO's lines are long)

# (kernel name, hlo_op, duration in us, expected category)
KERNELS = (
  ('flash_attention_forward', 'custom-call.1', 40.0, 'attention'),
  ('sm90_xmma_gemm_bf16bf16_bf16f32', 'custom-call.2', 100.0, 'matmul'),
  ('loop_norm_fusion', 'loop_norm_fusion', 10.0, 'norm/gelu/elementwise'),
  ('loss_fusion', 'loss_fusion', 5.0, 'loss'),
  ('transpose_fusion', 'transpose_fusion', 4.0, 'copy/transpose'),
  ('ncclDevKernel_AllReduce_Sum_f32_RING_LL', 'all-reduce.3', 8.0, 'collective'),
  ('adam_fusion', 'adam_fusion', 3.0, 'optimizer'),
  ('dynamic_update_slice_fusion', 'dynamic-update-slice_fusion', 2.0, 'copy/transpose'),
  ('mystery_kernel', 'not_in_the_module', 1.0, 'other'),
)


def gpu_trace(steps: int = 2) -> tuple[dict, float]:
  """Two steps of KERNELS on a GPU's stream track, 10 us apart; returns (trace, step us)."""
  events = [
    {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
    {'ph': 'M', 'pid': 7, 'name': 'process_name', 'args': {'name': '/device:GPU:0'}},
    {'ph': 'M', 'pid': 7, 'tid': 13, 'name': 'thread_name', 'args': {'name': 'Stream #13(Kernel)'}},
    {'ph': 'M', 'pid': 7, 'tid': 99, 'name': 'thread_name', 'args': {'name': 'CUPTI overhead'}},
    # Host events are not device time, whatever they carry.
    {'ph': 'X', 'pid': 1, 'tid': 5, 'ts': 0, 'dur': 1e6, 'name': 'ExecuteOnStream',
     'args': {'hlo_op': 'custom-call.2', 'hlo_module': 'jit_step'}},
    {'ph': 'X', 'pid': 7, 'tid': 99, 'ts': 0, 'dur': 1e6, 'name': 'overhead', 'args': {}},
  ]  # fmt: skip
  ts = 0.0
  for _ in range(steps):
    for kernel, op, dur, _category in KERNELS:
      events.append(
        {
          'ph': 'X',
          'pid': 7,
          'tid': 13,
          'ts': ts,
          'dur': dur,
          'name': kernel,
          'args': {'hlo_op': op, 'hlo_module': 'jit_step', 'correlation_id': '1'},
        }
      )
      ts += dur + 10.0
  # Another module's kernel (e.g. the learning rate's) is not the step's.
  events.append(
    {'ph': 'X', 'pid': 7, 'tid': 13, 'ts': ts, 'dur': 50.0, 'name': 'convert',
     'args': {'hlo_op': 'custom-call.2', 'hlo_module': 'jit_convert_element_type'}}
  )  # fmt: skip
  return {'traceEvents': events}, ts / steps


def test_the_gpu_trace_is_split_by_category():
  trace, step_us = gpu_trace()
  profile = profile_trace.summarise(trace, HLO, steps=2, step_s=step_us / 1e6)
  assert profile['events_from'] == 'device' and profile['module'] == 'jit_step'
  assert profile['events'] == 2 * len(KERNELS)
  expected = dict.fromkeys(profile_trace.CATEGORIES, 0.0)
  for _kernel, _op, dur, category in KERNELS:
    expected[category] += dur / 1e3
  for category, ms in expected.items():
    assert profile['ms_per_step'][category] == pytest.approx(ms), category
  busy = sum(dur for _k, _o, dur, _c in KERNELS) / 1e3
  assert profile['ms_per_step'][profile_trace.IDLE] == pytest.approx(step_us / 1e3 - busy)
  assert sum(profile['pct_of_step'].values()) == pytest.approx(100.0)
  assert profile['top_ops']['matmul'][0][0] == 'custom-call.2'
  assert 'matmul' in profile_trace.table(profile)
  # What could not be matched is named, for the next reader of a GPU run.
  assert profile['matched_events'] == 2 * (len(KERNELS) - 1)
  assert profile['unmatched_examples'] == {
    'mystery_kernel': {
      'hlo_op': 'not_in_the_module',
      'hlo_module': 'jit_step',
      'correlation_id': '1',
    }
  }
  assert profile['bare_examples'] == {'transpose_fusion': 'fusion'}  # no metadata above
  # An HLO printed without metadata: its instructions match, and are named as bare.
  bare = profile_trace.summarise(trace, re.sub(r', metadata=\{[^}]*\}', '', HLO), 2, None)
  assert bare['matched_events'] == profile['matched_events']
  assert bare['bare_examples']['loop_norm_fusion'] == 'fusion'


def test_kernels_in_a_command_buffer_are_matched_by_their_kernel_names():
  # XLA:GPU runs most of a step as CUDA graphs: each kernel's `hlo_op` then names the command
  # buffer (as on the H200 on 2026-11-28: 'command_buffer_91'), and only the kernel's name, the
  # instruction's with '.' and '-' made '_', says which instruction it is.
  trace, step_us = gpu_trace()
  as_thunks = profile_trace.summarise(trace, HLO, steps=2, step_s=step_us / 1e6)
  for event in trace['traceEvents']:
    if event.get('pid') == 7 and 'hlo_op' in event.get('args', {}):
      event['args']['hlo_op'] = 'command_buffer_3'
  in_graphs = profile_trace.summarise(trace, HLO, steps=2, step_s=step_us / 1e6)
  assert in_graphs['ms_per_step'] == pytest.approx(as_thunks['ms_per_step'])
  # The fusions match by name; the kernels named after no instruction (cuBLAS's, NCCL's, the
  # attention kernel's) do not, and their names decide as before.
  fusions = {'loop_norm_fusion', 'loss_fusion', 'transpose_fusion', 'adam_fusion'}
  assert in_graphs['matched_events'] == 2 * (len(fusions) + 1)  # + dynamic-update-slice_fusion
  assert in_graphs['recognised_by']['source'] == as_thunks['recognised_by']['source'] - 2 * 2
  # Two instructions whose kernel names would be the same are matched by neither.
  _, ops = profile_trace.parse_hlo(HLO)
  by_kernel = profile_trace.kernel_names(ops)
  assert by_kernel['dynamic_update_slice_fusion'].name == 'dynamic-update-slice_fusion'
  assert by_kernel['all_reduce_3'].name == 'all-reduce.3'
  ops['all_reduce.3'] = ops['all-reduce.3']
  assert 'all_reduce_3' not in profile_trace.kernel_names(ops)


def test_without_source_frames_the_op_names_decide():
  """An HLO text without the StackFrames tables (another XLA's printer): the Flax module path in
  the op names still says attention, LayerNorm and loss; a projection's einsum is a matmul."""
  hlo = HLO.replace('stack_frame_id=', 'frame=')
  module, ops = profile_trace.parse_hlo(hlo)
  assert module == 'jit_step' and all(op.source is None for op in ops.values())
  expected = {
    'custom-call.1': 'attention',  # under layers/attn, and a Triton kernel named flash_attention
    'custom-call.2': 'matmul',  # layers/attn's QKV projection einsum: no q-by-k product
    'loop_norm_fusion': 'norm/gelu/elementwise',  # layers/ln1
    'loss_fusion': 'loss',  # the loss function's jvp()
    'adam_fusion': 'optimizer',  # outside the differentiated function and the loop
    'all-reduce.3': 'collective',
  }
  kernels = {op: kernel for kernel, op, _d, _c in KERNELS}
  for name, category in expected.items():
    assert profile_trace.categorise(kernels[name], {}, ops[name])[0] == category, name
  # Only an op name: a layer's elementwise work inside the differentiated forward of the loop
  # that adds its gradients in place (step.add_microbatch_grads, a jvp() of its own) is not the
  # loss's; that forward's own reduction is.
  in_place = 'jit(step)/while/body/closed_call/jvp()/while/body/closed_call'
  layer = {'op_name': f'{in_place}/layers/mlp/mul'}
  assert profile_trace.categorise('loop_multiply_fusion', layer, None)[0] != 'loss'
  loss = {'op_name': 'jit(step)/while/body/closed_call/jvp()/reduce_sum'}
  assert profile_trace.categorise('input_reduce_fusion', loss, None)[0] == 'loss'
  # No HLO at all: the kernel names alone.
  assert profile_trace.categorise('ampere_bf16_s16816gemm', {}, None)[0] == 'matmul'
  assert profile_trace.categorise('cudnn_sdpa_flash_fprop', {}, None)[0] == 'attention'
  assert profile_trace.categorise('MemcpyD2D', {}, None)[0] == 'copy/transpose'
  assert profile_trace.categorise('ncclKernel_AllGather', {}, None)[0] == 'collective'


def test_the_cpu_trace_counts_thunks_not_the_loops_around_them():
  """XLA:CPU: thunk events on host threads; a while's event encloses its body's (on other
  threads) and is left out, as are events naming no hlo_op."""
  ev = lambda tid, ts, dur, name, op: {
    'ph': 'X', 'pid': 1, 'tid': tid, 'ts': ts, 'dur': dur, 'name': name,
    'args': {'hlo_op': op, 'hlo_module': 'jit_step'} if op else {},
  }  # fmt: skip
  trace = {
    'traceEvents': [
      {'ph': 'M', 'pid': 1, 'name': 'process_name', 'args': {'name': '/host:CPU'}},
      ev(1, 0, 100, 'while.1', 'while.1'),
      ev(2, 5, 30, 'custom-call.2', 'custom-call.2'),
      ev(3, 10, 20, 'custom-call.1', 'custom-call.1'),  # concurrently, on another thread
      ev(2, 40, 10, 'loss_fusion', 'loss_fusion'),
      ev(2, 50, 1, 'end: loss_fusion', None),
      ev(2, 90, 10, 'adam_fusion', 'adam_fusion'),
    ]
  }
  profile = profile_trace.summarise(trace, HLO, steps=1, step_s=None)
  assert profile['events_from'] == 'host' and profile['events'] == 4
  ms = profile['ms_per_step']
  got = [ms[c] for c in ('matmul', 'attention', 'loss', 'optimizer')]
  assert got == pytest.approx([0.03, 0.02, 0.01, 0.01])
  assert profile['step_ms'] == pytest.approx(0.095)  # the span of the counted events, 5-100
  # Busy 5-35 (the two threads overlap), 40-50 and 90-100: 50 us of the 95.
  assert ms[profile_trace.IDLE] == pytest.approx(0.045)


def test_a_real_cpu_profile_reads_the_same_from_its_json_and_its_xspace(tmp_path):
  """jax.profiler's two files of one trace: the Chrome-trace JSON and the XSpace protobuf (the
  fallback, read by jax's ProfileData) give the same events and split."""
  import glob

  import jax
  import jax.numpy as jnp

  step = jax.jit(lambda x, w: jnp.tanh(x @ w).sum())
  x = jnp.ones((64, 64))
  compiled = step.lower(x, x).compile()
  compiled(x, x).block_until_ready()
  profile = profile_trace.profile_steps(
    lambda i: compiled(x, x).block_until_ready(), 2, compiled.as_text(), str(tmp_path)
  )
  assert profile['events_from'] == 'host' and profile['events'] >= 2
  (xspace,) = glob.glob(f'{tmp_path}/plugins/profile/*/*.xplane.pb')
  again = profile_trace.summarise(
    profile_trace.load_trace(xspace), compiled.as_text(), 2, profile['step_ms'] / 1e3
  )
  assert again['events'] == profile['events']
  assert again['ms_per_step'] == pytest.approx(profile['ms_per_step'], abs=1e-3)


def test_the_mosaic_sweep_candidates_are_valid_tiles_and_reach_the_kernel():
  """Every candidate of benchmarks/mosaic_sweep.py is MosaicBlocks without a problem and its
  kernels lower for CUDA, within Hopper's shared memory (a typo or a ring too large would cost
  GPU time); 'default' is the defaults. --mosaic_blocks is what attention.py's mosaic row runs
  with (here in interpret mode, one warpgroup of 64-row tiles)."""
  assert mosaic_sweep.blocks_of('default') == MosaicBlocks()
  x = jax.ShapeDtypeStruct((1, 512, 1, 128), jnp.bfloat16)
  for name in mosaic_sweep.CANDIDATES:
    blocks = mosaic_sweep.blocks_of(name)
    assert blocks.problems() == [], name

    def loss(q, k, v, blocks=blocks):
      return mosaic_attention(q, k, v, alibi_slopes=np.ones(1, np.float32), blocks=blocks).sum()

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=('cuda',))
  with pytest.raises(SystemExit, match='unknown candidate'):
    mosaic_sweep.parse_args(['--only', 'own_turn'])
  with pytest.raises(SystemExit, match='--mosaic_blocks needs 18 integers'):
    attention_benchmark.parse_mosaic_blocks('64,128')

  one_warpgroup = '64,64,64,64,64,64,1,2,40,0,0,0,0,0,0,0,0,0'
  args = attention_benchmark.parse_args(
    ['--smoke', '--seqs', '64', '--impls', 'mosaic', '--mosaic_blocks', one_warpgroup]
  )
  report = attention_benchmark.run(args)
  assert report['mosaic_blocks'] == {**MosaicBlocks().__dict__, 'block_kv': 64, 'compute_wgs': 1}
  (row,) = report['results']
  assert row['correct'], row
  # Tiles the kernel refuses: the row's error is the kernel's, so the option reached it.
  args.mosaic_blocks = '64,96,64,64,64,64,1,2,40,0,0,0,0,0,0,0,0,0'
  (row,) = attention_benchmark.run(args)['results']
  assert 'MosaicBlocks.block_kv=96 must be a multiple of 64' in row['failed'], row


def test_the_sweep_compares_each_round_against_the_default_timed_in_it():
  """Rounds interleave the candidates, the order rotated each round, and a speed-up is the
  default's time over the candidate's in the same round: on a clock that slows 1.5x a round, a
  kernel 10% faster is faster in every round (where comparing the rounds' medians across
  candidates would depend on who ran when), one that alternates is within the spread."""
  calls = []
  rounds = 4

  def timer(name, seconds):
    def time_it():
      calls.append(name)
      drift = 1.5 ** ((len(calls) - 1) // 3)  # the machine slows from round to round
      return seconds(len([c for c in calls if c == name])) * drift

    return time_it

  timers = {
    'default': timer('default', lambda n: 1.0),
    'quick': timer('quick', lambda n: 0.9),
    'noisy': timer('noisy', lambda n: 0.95 if n % 2 else 1.05),
  }
  result = mosaic_sweep.interleaved_rounds(timers, rounds, 'default')
  assert calls[:3] == ['default', 'quick', 'noisy'] and calls[3:6] == ['quick', 'noisy', 'default']
  assert len(calls) == 3 * rounds
  assert result['quick']['speedups'] == pytest.approx([1 / 0.9] * rounds)
  assert result['quick']['verdict'] == 'faster'
  assert result['noisy']['verdict'] == 'within'
  assert result['default']['verdict'] == 'baseline'
  assert mosaic_sweep.verdict([0.97, 0.99]) == 'slower'

  def row(candidate, seq, fwd, fwd_bwd):
    return {
      'candidate': candidate,
      'seq': seq,
      'fwd': {'verdict': fwd},
      'fwd_bwd': {'verdict': fwd_bwd},
    }

  rows = [row('a', 2048, 'within', 'faster'), row('a', 4096, 'faster', 'faster')]
  assert mosaic_sweep.adoptable(rows, 'a', [2048, 4096])
  assert not mosaic_sweep.adoptable(rows, 'a', [2048, 4096, 8192])  # a length not measured
  rows.append(row('b', 2048, 'slower', 'faster'))
  rows.append(row('b', 4096, 'faster', 'faster'))
  assert not mosaic_sweep.adoptable(rows, 'b', [2048, 4096])  # its forward slower at 2048


def test_a_candidate_whose_compile_fails_only_in_a_thread_is_compiled_again_alone(monkeypatch):
  """The threads' compile is for speed: a program that fails to compile in one is compiled in
  the calling thread before its candidate is reported failed."""
  make = attention_benchmark.fwd_and_bwd

  def only_in_the_main_thread(fn):
    if threading.current_thread() is not threading.main_thread():
      raise RuntimeError('compiled in a worker thread')
    return make(fn)

  monkeypatch.setattr(attention_benchmark, 'fwd_and_bwd', only_in_the_main_thread)
  shape = (2, 64, 2, 64)
  candidates = {'default': MosaicBlocks(), 'kv96': MosaicBlocks(block_kv=96)}
  programs = mosaic_sweep.compiled_programs(candidates, np.ones(2, np.float32), shape, True, 2)
  assert all(isinstance(program, jax.stages.Compiled) for program in programs['default'])
  assert 'must be a multiple of 64' in str(programs['kv96'])


def test_the_sweep_smoke_run_checks_every_candidate_and_reports_a_broken_one(monkeypatch):
  """--smoke on CPU: each candidate in interpret mode against the fp32 reference, not timed; a
  candidate that cannot run is reported with the kernel's error, and the run fails."""
  report = mosaic_sweep.run(mosaic_sweep.parse_args(['--smoke', '--seqs', '64']))
  rows = {row['candidate']: row for row in report['rows']}
  assert set(rows) == set(mosaic_sweep.SMOKE_CANDIDATES)
  # Each length's programs compiled ahead of time in a thread per CPU at once, and timed.
  assert report['compile_workers'] == os.cpu_count() and set(report['compile_s']) == {64}
  assert all(row['correct'] and 'fwd' not in row for row in rows.values()), rows
  assert mosaic_sweep.failures(report) == []

  monkeypatch.setitem(mosaic_sweep.CANDIDATES, 'kv96', {'block_kv': 96})
  report = mosaic_sweep.run(mosaic_sweep.parse_args(['--smoke', '--seqs', '64', '--only', 'kv96']))
  (broken,) = mosaic_sweep.failures(report)
  assert broken['candidate'] == 'kv96'
  assert 'MosaicBlocks.block_kv=96 must be a multiple of 64' in broken['failed']


def test_the_sweep_times_and_ranks_the_candidates_where_a_gpu_would(monkeypatch, capsys):
  """The sweep's GPU path on this CPU, the kernels replaced by the reference (so every candidate
  runs the same program): each correct candidate is timed in every round, forward and
  forward+backward, with its TFLOP/s and speed-up over the default in the table and the JSON,
  and the adoption rule is applied at every length."""

  class Device:
    platform, device_kind = 'gpu', 'NVIDIA H200'

  def reference(q, k, v, *, alibi_slopes, blocks, interpret):
    assert not interpret and isinstance(blocks, MosaicBlocks)
    return attention_reference(q, k, v, alibi_slopes=alibi_slopes, causal=True)

  monkeypatch.setattr(mosaic_sweep.jax, 'devices', lambda: [Device()])
  monkeypatch.setattr(mosaic_sweep.accounting, 'device_peak_tflops', lambda dtype: (989.0, 'x'))
  monkeypatch.setattr(mosaic_sweep.attention_benchmark, 'cuda_runtime', lambda: 'CUDA none')
  monkeypatch.setattr(mosaic_sweep, 'mosaic_attention', reference)
  args = mosaic_sweep.parse_args(
    ['--seqs', '64,128', '--only', 'paired_turns', '--rounds', '3', '--iters', '1']
  )
  args.tokens, args.heads, args.head_dim = 128, 2, 64
  report = mosaic_sweep.run(args)
  rows = report['rows']
  assert [(r['candidate'], r['seq']) for r in rows] == [
    ('default', 64),
    ('paired_turns', 64),
    ('default', 128),
    ('paired_turns', 128),
  ]
  for row in rows:
    assert row['correct']
    for kind in ('fwd', 'fwd_bwd'):
      figures = row[kind]
      assert len(figures['seconds']) == len(figures['speedups']) == 3
      assert figures['tflops'] > 0 and figures['verdict'] in (*mosaic_sweep.VERDICTS, 'baseline')
  assert report['adoptable'] in ([], ['paired_turns'])
  printed = capsys.readouterr().out
  assert 'seq 128 x batch 1' in printed and 'adoptable' in printed


def test_attention_timing_divides_back_to_back_calls_waited_for_once(monkeypatch):
  """A sample of `back_to_back` calls is waited for once and counted per call: on a fake clock
  that each call advances by one second (and each wait by a tenth, the host's sync), five calls
  back to back give 1.02 s a call, a single call 1.1 s; the warm-up calls are not timed."""
  clock = {'now': 0.0, 'calls': 0, 'waits': 0}

  def call():
    clock['now'] += 1.0
    clock['calls'] += 1
    return clock['calls']

  def wait(value):
    clock['now'] += 0.1
    clock['waits'] += 1
    return value

  monkeypatch.setattr(attention_benchmark.time, 'perf_counter', lambda: clock['now'])
  monkeypatch.setattr(attention_benchmark.jax, 'block_until_ready', wait)
  per_call = attention_benchmark.median_seconds(call, (), iters=3, warmup=2, back_to_back=5)
  assert per_call == pytest.approx(1.02)
  assert (clock['calls'], clock['waits']) == (2 + 3 * 5, 2 + 3)
  assert attention_benchmark.median_seconds(call, (), iters=3, warmup=0) == pytest.approx(1.1)
