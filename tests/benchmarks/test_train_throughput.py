"""benchmarks/train_throughput.py (issue: core trainer, item 14): the script runs end to end and
compares like with like. Its timings are measurements, never asserted here."""

import json
import math
import os
import re
import sys

import pytest
from conftest import REPO, run_cli, users_xla_flags

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import train_throughput  # noqa: E402  (a script, not a package module)


@pytest.fixture(scope='module')
def tiny_two_rounds(tmp_path_factory):
  """One run: tiny, ours f32 against torch f32, 1 timed step each, two interleaved rounds, and
  one traced step of ours."""
  out = tmp_path_factory.mktemp('throughput') / 'result.json'
  proc = run_cli(
    [
      os.path.join('benchmarks', 'train_throughput.py'),
      '--models',
      'tiny',
      '--impls',
      'ours_f32,torch_f32',
      '--steps',
      '1',
      '--rounds',
      '2',
      '--profile',
      '--json',
      str(out),
    ],
    timeout=900,
    # The script measures XLA as users run it, not the suite's faster compiles.
    env={
      'PYTHONPATH': REPO,
      'XLA_FLAGS': users_xla_flags(),
    },
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


def test_reference_is_the_same_model_and_flop_count(tiny_two_rounds):
  result, _ = tiny_two_rounds
  ours, torch_ref = result['results']['tiny']['ours f32'], result['results']['tiny']['torch f32']
  cfg = train_throughput.build_config('tiny')
  from t5x_like.training import accounting

  # transformers' BloomForCausalLM built by the script has exactly our parameter count.
  assert torch_ref['hf_num_params'] == ours['num_params'] == cfg.model.num_params()
  flops = accounting.megatron_flops_per_iteration(
    cfg, cfg.train.global_batch_size, cfg.train.seq_len
  )
  assert ours['flops_per_iteration'] == torch_ref['flops_per_iteration'] == flops
  for r in (ours, torch_ref):
    # Throughput is derived from the median step of the same global batch.
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    assert r['tokens_per_sec'] == pytest.approx(tokens / r['step_s_median'])
    assert r['tflops'] == pytest.approx(flops / r['step_s_median'] / 1e12)
    assert all(math.isfinite(loss) for loss in r['losses'])
    assert len(r['losses']) == train_throughput.WARMUP + 1


def test_ours_is_the_trainer_step_training(tiny_two_rounds):
  result, _ = tiny_two_rounds
  losses = result['results']['tiny']['ours f32']['losses']
  # Warm-up starts at learning rate 0 (the schedule of configs/tiny.py), then the loss falls.
  assert losses[0] == pytest.approx(losses[1])
  assert losses[-1] < losses[0]


def test_rounds_keep_the_fastest_median(tiny_two_rounds):
  result, _ = tiny_two_rounds
  for r in result['results']['tiny'].values():
    medians = r['round_step_s_medians']
    assert len(medians) == 2 and all(m > 0 for m in medians)
    assert r['step_s_median'] == min(medians)


def test_model_shaped_gemm_probes_for_both_frameworks(tiny_two_rounds):
  result, stdout = tiny_two_rounds
  for form in train_throughput.GEMM_FORMS:
    assert result['probes'][f'jax_float32_gemm_{form}_tflops'] > 0
    assert result['probes'][f'torch_float32_gemm_{form}_tflops'] > 0
  # The MFU reference stays the square-matmul probe the goals are defined against.
  square = [
    v
    for probes in (result['probes'], result['probes_end'])
    for k, v in probes.items()
    if re.fullmatch(r'jax_float32_n\d+_tflops', k)
  ]
  assert len(square) == 4 and result['peak_f32_tflops'] == max(square)
  assert "f32 GEMMs at bloom_100m's MLP shape 2048x768x3072" in stdout
  assert 'tiny: ours f32 / torch f32 = ' in stdout


def test_untraced_time_is_the_span_no_interval_covers():
  # Overlapping ops (two threads) count once; the 5 s between 15 and 20 are covered by none.
  assert train_throughput.untraced_time([(20, 30), (0, 10), (5, 15)]) == (30, 5)
  assert train_throughput.untraced_time([(0, 10), (2, 3), (10, 12)]) == (12, 0)
  assert train_throughput.untraced_time([]) == (0.0, 0.0)


def test_profile_books_the_untraced_time(tiny_two_rounds):
  result, stdout = tiny_two_rounds
  prof = result['results']['tiny']['ours f32']['profile']
  assert prof['op_time_s'] > 0 and 0 <= prof['untraced_s'] < prof['ops_span_s']
  assert sum(prof['share'].values()) == pytest.approx(1.0)
  untraced_share = prof['untraced_s'] / (prof['op_time_s'] + prof['untraced_s'])
  assert prof['share'][train_throughput.UNTRACED] == pytest.approx(untraced_share)
  assert 'layer matmuls (qkv, attn out, mlp)' in prof['share']
  assert 'tiny profile (ours f32, one traced step of ' in stdout
