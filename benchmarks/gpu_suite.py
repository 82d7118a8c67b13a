"""The GPU suite: one command, on one GPU, in under 10 minutes; `--smoke` runs it on CPU (CI).

    python benchmarks/gpu_suite.py --json OUT [--smoke] [--no-tests]

Stages, each reported in OUT (and on stdout as it goes):

1. `tests`: `pytest tests/kernels` on this device: the Pallas kernels compiled through Triton (not
   interpreted), cuDNN attention against xla, fp32 references at full precision
   (JAX_DEFAULT_MATMUL_PRECISION=highest: no TF32, as on CPU). The tests that build a multi-device
   mesh need the CPU suite's 8 virtual devices and are left to it. Not run with `--smoke` (CI runs
   them in interpret mode) or `--no-tests`.
2. `step`: a BLOOM-1.3B-shaped train step (configs/bloom_1b3.py, global batch 16, micro-batch 4,
   seq 2048) per attention implementation, each in its own process (`step_throughput.py`): MFU,
   tokens/s, the first loss against xla's, XLA's compiled memory and the allocator's measured peak.
3. `plan`: `python -m t5x_like.plan` for the same step on one virtual CPU device (XLA's CPU
   figure and its GPU estimate), and the cost model's estimate for this GPU kind
   (`t5x_like.cost_model`, what `plan --estimate` prints: step time, TFLOP/s, memory), beside
   what stage 2 measured.
4. `matmul`: the measured bf16 matmul rate (8192^3, random values; the data-sheet peak beside it).
5. `attention`: `benchmarks/attention.py` (seq 2048 and 4096: correctness and TFLOP/s).

The GPU is only touched by the stages' own processes and then by stages 4-5 in this one, so no
process holds memory that another needs. Exit status 1 if any stage failed (a test, a kernel's
error above its tolerance, a loss that differs from xla's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, 'benchmarks')
CONFIG = os.path.join(REPO, 'configs', 'bloom_1b3.py')
IMPLEMENTATIONS = ('xla', 'pallas', 'cudnn')
# tests/kernels' cases that need 8 devices (multi-device meshes): the CPU suite runs them.
MULTI_DEVICE_TESTS = (
  'not tiny_config and not chunked_cross_entropy_removes and not shard_map and not every_shard'
)


def run_logged(command: list[str], env: dict | None = None) -> tuple[int, str]:
  """Runs `command` from the repository root; its output is echoed, its stdout returned."""
  print('$ ' + ' '.join(command), flush=True)
  done = subprocess.run(
    command, cwd=REPO, env={**os.environ, **(env or {})}, text=True, capture_output=True
  )
  print(done.stdout + done.stderr[-3000:], end='', flush=True)
  return done.returncode, done.stdout + ('' if done.returncode == 0 else done.stderr)


def default_backend() -> str:
  """JAX's platform here, asked in a child process so that this one holds no GPU memory yet."""
  done = subprocess.run(
    [sys.executable, '-c', 'import jax; print(jax.default_backend())'],
    capture_output=True,
    text=True,
    check=True,
  )
  return done.stdout.strip().splitlines()[-1]


def kernel_tests() -> dict:
  code, output = run_logged(
    [
      sys.executable,
      '-m',
      'pytest',
      'tests/kernels',
      '-q',
      '-p',
      'no:cacheprovider',
      '-k',
      MULTI_DEVICE_TESTS,
    ],
    env={'JAX_DEFAULT_MATMUL_PRECISION': 'highest', 'JAX_PLATFORMS': 'cuda,cpu'},
  )
  summary = [line for line in output.splitlines() if ' passed' in line or ' failed' in line]
  return {'exit_code': code, 'summary': summary[-1] if summary else output[-500:], 'ok': code == 0}


def train_steps(smoke: bool, workdir: str) -> dict:
  """One process per implementation, so that each measured peak is that implementation's."""
  results, overrides, device = {}, None, None
  for impl in IMPLEMENTATIONS:
    out = os.path.join(workdir, f'step_{impl}.json')
    command = [
      sys.executable,
      os.path.join(BENCHMARKS, 'step_throughput.py'),
      '--config',
      CONFIG,
      '--attention',
      impl,
      '--json',
      out,
    ]
    command += (
      ['--smoke', '--global_batch', '4', '--steps', '2']
      if smoke
      else ['--global_batch', '16', '--steps', '10']
    )
    code, output = run_logged(command)
    if code != 0 or not os.path.exists(out):
      results[impl] = {'failed': output[-1000:]}
      continue
    with open(out) as f:
      report = json.load(f)
    overrides, device = report['overrides'], report['device']
    results[impl] = report['results'][impl]
  ok = all('failed' not in r for r in results.values())
  reference = results.get('xla', {}).get('losses')
  for impl, result in results.items():
    if reference and 'losses' in result and impl != 'xla':
      result['first_loss_vs_xla'] = abs(result['losses'][0] - reference[0]) / abs(reference[0])
      ok &= result['first_loss_vs_xla'] <= step_throughput_tolerance()
  return {'config': CONFIG, 'overrides': overrides, 'device': device, 'results': results, 'ok': ok}


def step_throughput_tolerance() -> float:
  sys.path.insert(0, BENCHMARKS)
  import step_throughput

  return step_throughput.LOSS_TOLERANCE


def cost_model_kind(device_kind: str) -> str:
  """The cost model's name for a device (an H100's figures stand in on CPU, --smoke)."""
  for marker, kind in (
    ('H200', 'h200'),
    ('H100', 'h100-80gb'),
    ('A100-SXM4-80GB', 'a100-80gb'),
    ('A100 80GB', 'a100-80gb'),
    ('A100', 'a100-40gb'),
  ):
    if marker in device_kind:
      return kind
  return 'h100-80gb'


def plan_memory(overrides: dict, device_kind: str) -> dict:
  """`plan` for the step that stage 2 ran, compiled for one virtual CPU device, and the cost
  model's estimate of it."""
  from t5x_like.config import load_config_file
  from t5x_like.planning import cost_model
  from t5x_like.training import startup

  kind = cost_model_kind(device_kind)
  estimate = cost_model.estimate(startup.check_config(load_config_file(CONFIG, overrides)), kind)
  result = {
    'estimate': {
      'gpu': kind,
      'step_s': estimate['estimated_step_s'],
      'tflops_per_gpu': estimate['estimated_tflops_per_gpu'],
      'memory_gib': estimate['estimated_memory_gib'],
    }
  }
  command = [sys.executable, '-m', 't5x_like.plan', '--config', CONFIG, '--json']
  command += [
    f'--config.{key}={value!r}' if isinstance(value, str) else f'--config.{key}={value}'
    for key, value in overrides.items()
  ]
  code, output = run_logged(command, env={'JAX_PLATFORMS': 'cpu'})
  if code != 0:
    return {**result, 'failed': output[-1000:], 'ok': False}
  report = json.loads(output.strip().splitlines()[-1])
  return {
    **result,
    'peak_gib': report['peak_gib'],
    'gpu_estimate_peak_gib': report.get('gpu_estimate_peak_gib'),
    'ok': True,
  }


def matmul_peak(smoke: bool) -> dict:
  import jax
  import jax.numpy as jnp

  from t5x_like.training import accounting

  n = 256 if smoke else 8192
  keys = jax.random.split(jax.random.PRNGKey(0))
  a, b = (jax.random.normal(key, (n, n), jnp.bfloat16) for key in keys)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()
  best = float('inf')
  for _ in range(10):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  peak, source = accounting.device_peak_tflops('bfloat16')
  return {
    'n': n,
    'measured_tflops': 2 * n**3 / best / 1e12,
    'peak_tflops': peak,
    'peak_source': source,
    'ok': True,
  }


def attention(smoke: bool) -> dict:
  sys.path.insert(0, BENCHMARKS)
  import attention as attention_benchmark

  argv = ['--smoke'] if smoke else ['--seqs', '2048,4096', '--impls', 'pallas,cudnn,xla']
  report = attention_benchmark.run(attention_benchmark.parse_args(argv))
  report['ok'] = not attention_benchmark.failures(report)
  return report


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--json', required=True, help='write the whole report here')
  parser.add_argument(
    '--smoke',
    action='store_true',
    help='small shapes, no kernel tests: checks every stage runs (CPU)',
  )
  parser.add_argument('--no-tests', action='store_true', help='skip stage 1')
  args = parser.parse_args(argv)
  if not args.smoke and default_backend() != 'gpu':
    print(
      f'error: no GPU here (JAX runs on {default_backend()}); the suite measures a GPU. '
      'Use --smoke to check the script on CPU.',
      file=sys.stderr,
    )
    return 2
  start = time.perf_counter()
  report = {
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'smoke': args.smoke,
    'stages': {},
  }
  stages = report['stages']
  if not (args.smoke or args.no_tests):
    stages['tests'] = kernel_tests()
  with tempfile.TemporaryDirectory() as workdir:
    stages['step'] = train_steps(args.smoke, workdir)
  if stages['step']['overrides'] is not None:
    stages['plan'] = plan_memory(stages['step']['overrides'], stages['step']['device'])
  stages['matmul'] = matmul_peak(args.smoke)
  stages['attention'] = attention(args.smoke)
  import jax

  device = jax.devices()[0]
  report.update(
    device=device.device_kind,
    platform=device.platform,
    jax=jax.__version__,
    wall_s=round(time.perf_counter() - start, 1),
  )
  report['ok'] = all(stage['ok'] for stage in stages.values())
  with open(args.json, 'w') as f:
    json.dump(report, f, indent=1)
  print(summary(report), flush=True)
  return 0 if report['ok'] else 1


def summary(report: dict) -> str:
  gib = 2**30
  stages = report['stages']
  lines = [
    f'# GPU suite {report["date"]}: {report["device"]} ({report["platform"]}), jax '
    f'{report["jax"]}, {report["wall_s"]} s, {"ok" if report["ok"] else "FAILED"}'
  ]
  if 'tests' in stages:
    lines.append(f'tests/kernels: {stages["tests"]["summary"]}')
  matmul = stages['matmul']
  lines.append(
    f'bf16 matmul {matmul["n"]}^3: {matmul["measured_tflops"]:.3g} TFLOP/s measured '
    f'({matmul["peak_tflops"]:.3g}: {matmul["peak_source"]})'
  )
  plan = stages.get('plan', {})
  for impl, r in stages['step']['results'].items():
    if 'mfu' not in r:
      lines.append(f'step {impl}: {r.get("skipped") or "FAILED " + r.get("failed", "")[-300:]}')
      continue
    measured = (
      f', measured peak {r["measured_peak_bytes"] / gib:.1f} GiB'
      if r.get('measured_peak_bytes')
      else ''
    )
    lines.append(
      f'step {impl}: {r["step_s_median"] * 1e3:.0f} ms, {r["model_tflops"]:.3g} '
      f'TFLOP/s, MFU {100 * r["mfu"]:.1f}%, loss {r["losses"][0]:.4f}, XLA peak '
      f'{r["xla_peak_bytes"] / gib:.1f} GiB{measured}'
    )
  if plan.get('ok'):
    # The GPU estimate needs plan's buffer breakdown, which some JAX versions' dumps defeat.
    estimate = plan['gpu_estimate_peak_gib']
    lines.append(
      f'plan (CPU compile): peak {plan["peak_gib"]:.1f} GiB, GPU estimate '
      + ('unavailable' if estimate is None else f'{estimate:.1f} GiB')
    )
  if 'estimate' in plan:
    model = plan['estimate']
    lines.append(
      f"cost model ({model['gpu']}, xla's step): {model['step_s'] * 1e3:.0f} ms, "
      f'{model["tflops_per_gpu"]:.3g} TFLOP/s, {model["memory_gib"]:.1f} GiB'
    )
  for row in stages['attention']['results']:
    if 'fwd_tflops' in row:
      lines.append(
        f'attention {row["impl"]} seq {row["seq"]}: fwd {row["fwd_tflops"]:.3g} '
        f'fwd+bwd {row["fwd_bwd_tflops"]:.3g} TFLOP/s, correct {row["correct"]}'
      )
    else:
      lines.append(
        f'attention {row["impl"]} seq {row["seq"]}: {row.get("skipped") or row.get("failed")}'
      )
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
