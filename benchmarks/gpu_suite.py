"""The GPU suite: every figure a GPU-throughput issue needs, from one command on one GPU.

    python benchmarks/gpu_suite.py --json OUT                   # one GPU, about 6 minutes
    python benchmarks/gpu_suite.py --json OUT --only step,loss  # rerun some stages
    python benchmarks/gpu_suite.py --json OUT --smoke           # CPU, tiny shapes (CI)

Run it under a timeout of 8 minutes (480 s): it stops itself within `--budget_s` (default 420 s,
counted from its start), each stage in its own process under a time limit (a stage that fails or
runs out of time reports its error and what it measured so far, and the others still run; a
stage the budget leaves no time for is reported as not run, `incomplete` in OUT), and OUT is
rewritten after every stage, so a run cut short keeps every finished stage. The summary at the
end puts the figures side by side.

Stages, in the order they run, with their time limits and their wall time on an H100 (measured
2026-11-27, where the stage ran with the implementations it runs now; estimated where it did not):

0. The start: JAX's backend asked in a child process (CUDA init), about 8 s.
1. `plan` (in the background from the start, CPU only: JAX_PLATFORMS=cpu, limit 300 s, 7 s):
   `python -m t5x_like.plan --json` of the BLOOM-1.3B step on one virtual CPU device: XLA's
   figure and its GPU estimate (`--breakdown`'s buffer analysis, or the error naming the part of
   XLA's dump it could not read; the dump is kept in OUT's folder as plan_xla_dump.tar.gz); then
   `plan --gpu KIND` of the same step (XLA's GPU compile for this GPU's kind, still on the CPU,
   'auto' attention as this GPU resolves it: mosaic on Hopper), set in the summary beside the
   step row of that attention (XLA's figure in the step's process and the allocator's peak);
   and at the end `plan --estimate` (the cost model) for this GPU kind and the fastest
   attention.
2. `matmul` (limit 60 s, 7 s): the measured bf16 matmul rate (8192^3; the data-sheet peak).
3. `attention` (limit 180 s; about 85 s, estimated from the 164 s that 7 implementations took):
   `benchmarks/attention.py` at head_dim 128, 16 heads, causal ALiBi, bf16, seq 2048, 4096 and
   8192 (16384 tokens per call): pallas, tokamax (the model's `tokamax_attention`: Mosaic GPU,
   ALiBi as a float32 [1, H, 1, S] bias), tokamax-nobias (Mosaic without ALiBi: a target only),
   cudnn; then mosaic (ours, `t5x_like.kernels.mosaic_attention`: Mosaic GPU for Hopper, ALiBi
   in the kernel; a row saying why it cannot run below compute capability 9.0) in a second
   process with NEW_ATTENTION_LIMIT_S (60 s) of the stage's limit, so that a hang costs its own
   rows only. Each is checked against the fp32 reference, then forward, backward and
   forward+backward TFLOP/s and % of peak (10 timed runs). With `--smoke` (CPU) mosaic runs in
   Mosaic GPU's interpret mode, checked against the reference but not timed (about 15 s).
4. `step` (limit 90 s per implementation; 28-38 s each, auto 3 s: about 135 s): the BLOOM-1.3B
   reference train step (configs/bloom_1b3.py with REFERENCE_STEP: the chunked loss, the layers
   scanned; global batch 16 = 4 micro-batches of 4 x 2048) per
   attention implementation, xla, pallas, tokamax, mosaic and auto, each in its own process
   (`step_throughput.py`, 2 warm-up + 5 timed steps): MFU, tokens/s, the first loss against
   xla's, XLA's compiled memory and the allocator's measured peak; then 2 steps under
   `jax.profiler`, the device time by category (matmul, attention, LayerNorm/GeLU/elementwise,
   loss, optimizer, copies/transposes, collectives, other, device idle; `profile_trace.py`);
   mosaic's trace and optimized HLO are kept in OUT's folder (KEEP_PROFILE_OF). `auto`
   resolving to an implementation already measured is reported as that one, not run again.
   With `--smoke` mosaic's step is not run (its row says why: on CPU the whole model would run
   in interpret mode, about a minute a step).
5. `loss` (limit 75 s per variant, about 30 s): the step with the fastest attention (of those
   whose first loss agrees with xla's) and model.cross_entropy_impl 'fused' (2 warm-up + 3
   timed steps; 'chunked', the reference step's, is the step stage's row).
6. `shard176b` (limit 120 s, 40 s): `benchmarks/shard_176b.py`, one tensor-parallel rank's
   share of 4 BLOOM-176B layers as tr11 split them (28 heads of 128, FFN 14336, micro-batch 2 x
   2048, full recomputation), pallas and tokamax: TFLOP/s per GPU by tr11's count beside its 150
   per A100, and with the planner's estimate of the all-reduces one GPU does not do.
7. `tests` (limit 150 s, about 110 s: 30 tests took 108 s; started only with 90 s of the budget
   left): `pytest tests/kernels -k GPU_TESTS` on this device, the tests that run a kernel: the
   Pallas kernels compiled through Triton, cuDNN and tokamax attention against xla, the Mosaic GPU
   kernels, the cross-entropy kernels, each model through them against xla; fp32 references at
   full precision (JAX_DEFAULT_MATMUL_PRECISION=highest). The rest of tests/kernels (lowering
   checks, constraints, configs) runs in the CPU suite. Not run with `--smoke` (CI runs them in
   interpret mode) or `--no-tests`.
8. `tune` (limit 100 s per variant; about 30 s a process with the layers scanned, 75 s
   unrolled on the H200, whose first variant took 78 s of the stage): the step with the fastest
   attention (the step stage's row is the base;
   `--base_attention` names it when the step stage is not in the same call, and the base is then
   measured too) under each of TUNE_VARIANTS, 2 warm-up + 3 timed steps, the first (the config's
   own step) then 2 under `jax.profiler`, its trace and HLO kept in OUT's folder's `tune/`. Each
   row gives its speed-up over the base and its first loss against the base's; a variant that
   does not run (an XLA flag this XLA lacks, activations that do not fit) is reported, a loss
   off the base's fails the stage.

About 410 s to the end of the tests (plan beside them), so under the default budget `tune` is
the stage left out: a second call runs it, `--only tune --base_attention IMPL` with the fastest
attention of the first. Were the GPU slower, the tests (which start only with 90 s left) and then
shard176b would go first. `--step_impls` trims the step stage. Only one stage touches the GPU at
a time (plan's process has no GPU), so each measured peak is its own process's. Exit status 1 if
any stage failed (a test, a kernel's error above its tolerance or its failure to run, a loss that
differs from xla's, a stage out of its time limit).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO, 'benchmarks')
CONFIG = os.path.join(REPO, 'configs', 'bloom_1b3.py')
STAGES = ('plan', 'matmul', 'attention', 'step', 'loss', 'shard176b', 'tests', 'tune')
# Not cudnn (2026-11-27: its attention at 15% of the peak, its step the slowest fused one); its
# attention rows stay, and `--step_impls` runs it.
STEP_IMPLS = ('xla', 'pallas', 'tokamax', 'mosaic', 'auto')
# The step the step and loss stages measure, the one every GPU run of this project measured:
# configs/bloom_1b3.py's model before 2026-11-28, the chunked loss with the layers scanned (its
# unrolled layers take a process 75 s on an H200 against 30, too long for five implementations
# in the suite's budget). The config's own step is `tune`'s first variant.
REFERENCE_MODEL = {'model.cross_entropy_impl': 'chunked', 'model.unroll_layers': False}
REFERENCE_STEP = tuple(f'--config.{key}={value}' for key, value in REFERENCE_MODEL.items())
# Not 'dense' (2026-11-27: 4% slower than 'chunked' and 11 GiB more).
LOSS_VARIANTS = ('chunked', 'fused')
# The `tune` stage: the step with the fastest attention under settings that may speed it up, each
# in its own process: {name: (config overrides, XLA_FLAGS)}, the likeliest first (the stage is
# the last and runs out of budget first). First the fused cross-entropy with the layer scan
# unrolled, configs/bloom_1b3.py as shipped since 2026-11-28 (on an H200 50.8% MFU, 1.22x the
# reference step: docs/benchmarks.md); then the same in micro-batches of 8 instead of 4 (fewer
# weight casts and gradient additions, more activations); then the unrolled layers with the
# chunked loss. (Settled on 2026-11-27: remat_policy='none' does not fit, cuBLASLt changes
# nothing, no Triton GEMMs is 5% slower, cuDNN LayerNorm crashes jaxlib 0.11.2's XLA.)
FUSED_UNROLLED = ('--config.model.cross_entropy_impl=fused', '--config.model.unroll_layers=True')
TUNE_VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
  'fused-unrolled': (FUSED_UNROLLED, ''),
  'fused-unrolled-mbs8': (('--config.train.micro_batch_size=8', *FUSED_UNROLLED), ''),
  'unrolled': (
    ('--config.model.cross_entropy_impl=chunked', '--config.model.unroll_layers=True'),
    '',
  ),
}
# The share of the GPU's memory JAX takes in tune's processes (where the suite's environment
# sets none): micro-batches of 8 with the unrolled layers hold 69 GiB (XLA's H200 compile), over
# the 59.7 GiB of JAX's default 0.75 of an H100 (docs/benchmarks.md); the share moves no kernel.
TUNE_MEM_FRACTION = '0.9'
# --smoke (global batch 4 in micro-batches of 2): the first two variants at its scale.
SMOKE_TUNE_VARIANTS: dict[str, tuple[tuple[str, ...], str]] = {
  'fused-unrolled': TUNE_VARIANTS['fused-unrolled'],
  'fused-unrolled-mbs8': (('--config.train.micro_batch_size=4', *FUSED_UNROLLED), ''),
}
ATTENTION_SEQS = '2048,4096,8192'
# tokamax: the model's tokamax_attention (a direct tokamax call where this checkout has none).
# Not xla (5% of the peak, the slowest to time) nor tokamax-cudnn (below cudnn's own), since
# 2026-11-27: `benchmarks/attention.py --impls` runs them.
ATTENTION_IMPLS = 'pallas,tokamax,tokamax-nobias,cudnn'
# Ours (t5x_like.kernels.mosaic_attention, Mosaic GPU for Hopper), in a second process of its own
# time limit after the others: should a new jax or driver make it hang, it costs its own rows.
NEW_ATTENTION_IMPLS = 'mosaic'
NEW_ATTENTION_LIMIT_S = 60.0
BUDGET_S = 440.0  # under a timeout of 480 s: the plan thread's join, the cost model, the summary
# Attention rows whose failure to run fails the suite (a wrong result always does); the direct
# tokamax calls are comparisons.
CORE_ATTENTION = ('pallas', 'tokamax', 'cudnn', 'mosaic')
# Step implementations whose failure to run fails the suite (a first loss off xla's always does).
CORE_STEP = ('xla', 'pallas', 'cudnn', 'tokamax', 'mosaic', 'auto')
# Not run with --smoke (CPU), each with the reason its row gives.
SMOKE_SKIPS_STEP = {
  # Measured 2026-11-26 on a 2-core CPU: one step of the smoke model took 61 s with
  # remat_policy='none'; with the config's 'save_dots', jax 0.10.2 refuses to trace it
  # (NotImplementedError: interpret mode's ordered callbacks under checkpoint).
  'mosaic': 'not run with --smoke: on CPU the whole model runs in Mosaic GPU interpret mode '
  '(about a minute a step); the attention stage checks its kernels',
}
# Time limits (seconds) of one child process, on a GPU; --smoke uses SMOKE_LIMIT for each.
LIMITS = {
  'plan': 300,
  'matmul': 60,
  'attention': 180,
  'step': 90,  # each implementation
  'loss': 75,  # each variant
  'shard176b': 120,
  'tune': 100,  # each variant (an unrolled step compiles longer)
  'tests': 150,
}
SMOKE_LIMIT = 600
TESTS_NEED_S = 90  # the tests stage starts only with this much of the budget left
STEP_ARGS = [
  '--global_batch', '16', '--warmup', '2', '--steps', '5', '--profile_steps', '2', *REFERENCE_STEP
]  # fmt: skip
SMOKE_STEP_ARGS = ['--smoke', '--global_batch', '4', '--warmup', '1', '--steps', '2']
SMOKE_STEP_ARGS += ['--profile_steps', '1', *REFERENCE_STEP]
# tests/kernels' cases that run a kernel on the device (pytest -k): against the fp32 reference or
# xla, the models through each kernel, what only a GPU decides (cuDNN, Hopper, long sequences).
GPU_TESTS = (
  'match_the_reference or matches_xla or match_dense or gives_the_xla_loss or fp32_loss '
  'or runs_on_a_gpu_only or on_hopper or wrong_alibi_row or bf16_tolerance or breaks_the_tolerance'
)
# Of those, the cases that need 8 devices (multi-device meshes): the CPU suite runs them.
MULTI_DEVICE_TESTS = (
  'not tiny_config and not chunked_cross_entropy_removes and not shard_map and not every_shard'
)
# The step implementation whose profile (trace and optimized HLO) is kept beside OUT (--smoke:
# every profiled one, all in one process).
KEEP_PROFILE_OF = 'mosaic'


_RUNNING: set[int] = set()  # process groups of the children running now


def _stop_children(signum, frame) -> None:
  """On SIGTERM/SIGINT (an outer timeout): the running child's process group goes too, so no
  orphan keeps the GPU."""
  for pgid in list(_RUNNING):
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(pgid, signal.SIGKILL)
  raise SystemExit(128 + signum)


class Clock:
  """The run's time budget."""

  def __init__(self, budget_s: float):
    self.start = time.perf_counter()
    self.budget_s = budget_s

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def left(self) -> float:
    return self.budget_s - self.elapsed()


def run_child(
  command: list[str], limit_s: float, env: dict | None = None, echo: bool = True
) -> dict:
  """Runs `command` from the repository root in its own process group, its output echoed as it
  comes (if `echo`), killed (the whole group) after `limit_s`. Returns its exit code (None when
  it ran out of time), wall seconds and the last lines of its output."""
  print('$ ' + ' '.join(command), flush=True)
  start = time.perf_counter()
  lines: list[str] = []
  proc = subprocess.Popen(
    command,
    cwd=REPO,
    env={**os.environ, **(env or {})},
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,
  )

  _RUNNING.add(proc.pid)

  def read() -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
      lines.append(line)
      if echo:
        print(line, end='', flush=True)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    code: int | None = proc.wait(timeout=max(1.0, limit_s))
  except subprocess.TimeoutExpired:
    code = None
    with contextlib.suppress(ProcessLookupError):
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  _RUNNING.discard(proc.pid)
  reader.join(timeout=10)
  wall = time.perf_counter() - start
  if code is None:
    print(f'!!! killed after {limit_s:.0f} s (its time limit)', flush=True)
  output = ''.join(lines)
  return {'code': code, 'wall_s': round(wall, 1), 'tail': output[-3000:], 'output': output}


def read_json(path: str) -> dict | None:
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def failure(run: dict, limit_s: float) -> str:
  """What went wrong with a child run, in one string."""
  if run['code'] is None:
    return f'timed out after {limit_s:.0f} s; output ends: {run["tail"][-800:]}'
  return f'exit {run["code"]}; output ends: {run["tail"][-1500:]}'


def default_backend() -> tuple[str, str]:
  """(JAX's platform here, its first device's kind), asked in a child process so that this one
  holds no GPU memory."""
  done = subprocess.run(
    [
      sys.executable,
      '-c',
      'import jax; print(jax.default_backend()); print(jax.devices()[0].device_kind)',
    ],
    capture_output=True,
    text=True,
    check=True,
  )
  platform, kind = done.stdout.strip().splitlines()[-2:]
  return platform, kind


def step_config_overrides(smoke: bool) -> dict:
  """The config overrides of the suite's step: step_throughput.py's (its SMOKE model with
  --smoke), on one device, at the suite's global batch, the reference step's model."""
  overrides: dict = dict(REFERENCE_MODEL)
  if smoke:
    sys.path.insert(0, BENCHMARKS)
    import step_throughput

    overrides.update(step_throughput.SMOKE)
  overrides.update(
    {
      'mesh.data': 1,
      'mesh.pipeline': 1,
      'mesh.tensor': 1,
      'train.global_batch_size': 4 if smoke else 16,
    }
  )
  return overrides


def config_flags(overrides: dict) -> list[str]:
  return [f'--config.{key}={value}' for key, value in overrides.items()]


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


def step_throughput_tolerance() -> float:
  sys.path.insert(0, BENCHMARKS)
  import step_throughput

  return step_throughput.LOSS_TOLERANCE


# --- the stages -----------------------------------------------------------------------------


def start_plan(
  smoke: bool, limit_s: float, json_path: str, gpu_kind: str
) -> tuple[threading.Thread, dict]:
  """`plan --json` of the suite's step in the background (CPU only), then `plan --gpu gpu_kind`
  (XLA's GPU compile of it on the CPU, 'auto' attention as the GPU resolves it: what a user
  without a GPU is told); the results land in the returned dict when the thread ends. The text
  files of plan's XLA dump (buffer assignment, values, live ranges, the module) are kept as
  plan_xla_dump.tar.gz beside the suite's JSON (`json_path`, in $OUT on a device machine), so
  that a GPU session brings back the dump its jax wrote."""
  result: dict = {}
  command = [sys.executable, '-m', 't5x_like.plan', '--config', CONFIG, '--json']
  command += config_flags(step_config_overrides(smoke))
  archive = os.path.join(os.path.dirname(os.path.abspath(json_path)), 'plan_xla_dump.tar.gz')
  # written by t5x_like/planning/memory_report.py
  env = {'JAX_PLATFORMS': 'cpu', 'T5X_LIKE_KEEP_XLA_DUMP': archive}
  started = time.perf_counter()

  def work() -> None:
    cpu_plan()
    left = limit_s - (time.perf_counter() - started)
    result['gpu_compile'] = gpu_compile(command, gpu_kind, left)
    if 'failed' in result['gpu_compile']:
      result['ok'] = False

  def cpu_plan() -> None:
    run = run_child(command, limit_s, env=env, echo=False)
    result['wall_s'] = run['wall_s']
    if archive and os.path.exists(archive):
      result['xla_dump'] = archive
    if run['code'] != 0:
      result.update(failed=failure(run, limit_s), ok=False)
      return
    try:
      report = json.loads(run['output'].strip().splitlines()[-1])
    except (ValueError, IndexError):
      result.update(failed=f'no JSON from plan: {run["tail"][-800:]}', ok=False)
      return
    breakdown = report.get('memory_breakdown', {})
    result.update(
      peak_gib=report['peak_gib'],
      gpu_estimate_peak_gib=report.get('gpu_estimate_peak_gib'),
      breakdown_error=breakdown.get('error'),
      breakdown_source=breakdown.get('source'),
      ok=True,
    )

  thread = threading.Thread(target=work, daemon=True)
  thread.start()
  return thread, result


def gpu_compile(plan_command: list[str], gpu_kind: str, limit_s: float) -> dict:
  """`plan_command --gpu gpu_kind` on the CPU: XLA's own memory figure of the step compiled for
  this GPU without it, and the attention 'auto' resolves to there."""
  if limit_s < 5:
    return {'gpu': gpu_kind, 'failed': 'no time left in the plan stage'}
  run = run_child(
    [*plan_command, '--gpu', gpu_kind], limit_s, env={'JAX_PLATFORMS': 'cpu'}, echo=False
  )
  try:
    report = json.loads(run['output'].strip().splitlines()[-1])
    return {
      'gpu': gpu_kind,
      'attention_impl': report['attention_impl'],
      'peak_gib': report['peak_gib'],
      'compile_s': report['compile_s'],
    }
  except (ValueError, IndexError, KeyError):
    return {'gpu': gpu_kind, 'failed': failure(run, limit_s)}


def cost_model_estimate(smoke: bool, device_kind: str, attention_impl: str | None) -> dict:
  """`plan --estimate` (the cost model, no compile) of the suite's step on this GPU kind."""
  kind = cost_model_kind(device_kind)
  overrides = step_config_overrides(smoke)
  if attention_impl:
    overrides['model.attention_impl'] = attention_impl
  command = [sys.executable, '-m', 't5x_like.plan', '--config', CONFIG, '--json']
  command += config_flags(overrides) + ['--estimate', '--gpu', kind]
  run = run_child(command, 30, env={'JAX_PLATFORMS': 'cpu'}, echo=False)
  try:
    estimate = json.loads(run['output'].strip().splitlines()[-1])
    return {
      'gpu': kind,
      'attention_impl': attention_impl,
      'step_s': estimate['estimated_step_s'],
      'tflops_per_gpu': estimate['estimated_tflops_per_gpu'],
      'memory_gib': estimate['estimated_memory_gib'],
    }
  except (ValueError, IndexError, KeyError):
    return {'gpu': kind, 'failed': failure(run, 30)}


def matmul_child(smoke: bool, out: str) -> None:
  """The `matmul` stage's own process: a bf16 matmul probe against the device's peak."""
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
  device = jax.devices()[0]
  with open(out, 'w') as f:
    json.dump(
      {
        'n': n,
        'measured_tflops': 2 * n**3 / best / 1e12,
        'peak_tflops': peak,
        'peak_source': source,
        'device': device.device_kind,
        'platform': device.platform,
        'jax': jax.__version__,
        'ok': True,
      },
      f,
    )


def matmul(smoke: bool, workdir: str, limit_s: float) -> dict:
  out = os.path.join(workdir, 'matmul.json')
  command = [sys.executable, os.path.abspath(__file__), '--child', 'matmul', '--json', out]
  run = run_child(command + (['--smoke'] if smoke else []), limit_s)
  report = read_json(out)
  if report is None:
    return {'failed': failure(run, limit_s), 'ok': False, 'wall_s': run['wall_s']}
  return {**report, 'wall_s': run['wall_s']}


def attention(smoke: bool, workdir: str, limit_s: float) -> dict:
  """The attention benchmark: the measured implementations in one process, then
  NEW_ATTENTION_IMPLS in another (at most NEW_ATTENTION_LIMIT_S of limit_s, kept for it)."""
  new_limit = min(NEW_ATTENTION_LIMIT_S if not smoke else SMOKE_LIMIT, limit_s / 2)
  report = attention_child(smoke, workdir, 'attention', ATTENTION_IMPLS, limit_s - new_limit)
  new = attention_child(smoke, workdir, 'attention_new', NEW_ATTENTION_IMPLS, new_limit)
  report['results'] += new['results']
  report['wall_s'] += new['wall_s']
  if 'failed' in new:  # out of time or crashed: its rows say so, the suite goes on
    report['new_failed'] = new['failed']
  report['ok'] = report['ok'] and new['ok']
  return report


def attention_child(smoke: bool, workdir: str, name: str, impls: str, limit_s: float) -> dict:
  out = os.path.join(workdir, f'{name}.json')
  command = [sys.executable, os.path.join(BENCHMARKS, 'attention.py'), '--json', out]
  command += ['--impls', impls]
  command += ['--smoke', '--seqs', '64'] if smoke else ['--seqs', ATTENTION_SEQS, '--iters', '10']
  run = run_child(command, limit_s)
  report = read_json(out) or {'results': []}
  report['wall_s'] = run['wall_s']
  bad = [
    r
    for r in report['results']
    if r.get('correct') is False or ('failed' in r and r['impl'] in CORE_ATTENTION)
  ]
  report['ok'] = run['code'] in (0, 1) and not bad
  if run['code'] not in (0, 1):  # 1: a row failed or was wrong (reported in the rows)
    report['failed'] = failure(run, limit_s)
  return report


def step_child(
  specs: list[str],
  workdir: str,
  limit_s: float,
  extra: list[str],
  env: dict | None = None,
  tag: str = 'step',
) -> dict:
  """One step_throughput.py process for `specs` (IMPL or IMPL:LOSS), with `env` added to its
  environment; each one's result, or why there is none. `tag` names its JSON file."""
  name = '_'.join(specs).replace(':', '-')
  out = os.path.join(workdir, f'{tag}_{name}.json')
  command = [sys.executable, os.path.join(BENCHMARKS, 'step_throughput.py'), '--config', CONFIG]
  command += ['--attention', ','.join(specs), '--json', out, *extra]
  run = run_child(command, limit_s, env=env)
  report = read_json(out) or {}
  results = {}
  for spec in specs:
    result = dict(report.get('results', {}).get(spec) or {})
    if not result:
      result = {'failed': failure(run, limit_s)}
    elif run['code'] is None and 'step_s_median' in result:  # out of time in the profile
      result['profile_failed'] = result.get('profile_failed') or failure(run, limit_s)
    result['process_wall_s'] = run['wall_s']
    result['device'] = report.get('device')
    results[spec] = result
  return results


def steps(
  smoke: bool, workdir: str, clock: Clock, impls: tuple[str, ...], keep_dir: str = ''
) -> dict:
  """The step per attention implementation, one process each (--smoke: one for all).
  keep_dir: where KEEP_PROFILE_OF's profile is kept (step_throughput.py --keep_profile)."""
  results: dict = {}
  if smoke:
    results.update(
      {impl: {'skipped': SMOKE_SKIPS_STEP[impl]} for impl in impls if impl in SMOKE_SKIPS_STEP}
    )
    impls = tuple(impl for impl in impls if impl not in SMOKE_SKIPS_STEP)
  groups = ([list(impls)] if impls else []) if smoke else [[impl] for impl in impls]
  for group in groups:
    limit = min(SMOKE_LIMIT if smoke else LIMITS['step'], clock.left())
    if limit < 10:
      results.update({impl: {'failed': 'skipped: out of the time budget'} for impl in group})
      continue
    extra = list(SMOKE_STEP_ARGS if smoke else STEP_ARGS)
    measured = [i for i, r in results.items() if 'step_s_median' in r]
    if 'auto' in group and measured:
      extra += ['--reuse_if_auto_is', ','.join(measured)]
    if keep_dir and (smoke or group == [KEEP_PROFILE_OF]):
      extra += ['--keep_profile', keep_dir]
    results.update(step_child(group, workdir, limit, extra))
  device = next((r['device'] for r in results.values() if r.get('device')), None)
  ok = True
  reference = results.get('xla', {}).get('losses')
  tolerance = step_throughput_tolerance()
  for impl, result in results.items():
    if 'same_as' in result:
      continue
    if 'failed' in result and impl in CORE_STEP:
      ok = False
    if reference and 'losses' in result and impl != 'xla':
      result['first_loss_vs_xla'] = abs(result['losses'][0] - reference[0]) / abs(reference[0])
      ok &= result['first_loss_vs_xla'] <= tolerance
  return {'config': CONFIG, 'device': device, 'results': results, 'ok': ok}


def fastest(step_results: dict) -> str | None:
  """The fastest step measured whose first loss agrees with xla's (where compared)."""
  tolerance = step_throughput_tolerance()
  timed = {
    i: r['step_s_median']
    for i, r in step_results.items()
    if 'step_s_median' in r and r.get('first_loss_vs_xla', 0.0) <= tolerance
  }
  return min(timed, key=timed.__getitem__) if timed else None


def losses(smoke: bool, workdir: str, clock: Clock, step_results: dict, default_impl: str) -> dict:
  """The step with the fastest attention and each cross-entropy implementation (one process
  each; --smoke: one for all); the step stage's row stands for the config's own."""
  impl = fastest(step_results) or default_impl
  base = step_results.get(impl, {})
  results: dict = {}
  todo = []
  for variant in LOSS_VARIANTS:
    if variant == base.get('cross_entropy_impl'):
      results[variant] = {**base, 'from': 'the step stage'}
    else:
      todo.append(variant)
  extra = [
    *(
      ['--smoke', '--global_batch', '4', '--warmup', '1', '--steps', '1']
      if smoke
      else ['--global_batch', '16', '--warmup', '2', '--steps', '3']
    ),
    *REFERENCE_STEP,  # its loss replaced by each variant's (IMPL:LOSS)
  ]
  groups = [todo] if smoke else [[variant] for variant in todo]
  for group in groups:
    limit = min(SMOKE_LIMIT if smoke else LIMITS['loss'], clock.left())
    if limit < 10:
      results.update({v: {'failed': 'skipped: out of the time budget'} for v in group})
      continue
    found = step_child([f'{impl}:{v}' for v in group], workdir, limit, extra)
    results.update({v: found[f'{impl}:{v}'] for v in group})
  ok = all('failed' not in r for r in results.values())
  reference = next((r['losses'][0] for r in results.values() if r.get('losses')), None)
  tolerance = step_throughput_tolerance()
  for result in results.values():
    if reference and result.get('losses'):
      result['first_loss_vs_first'] = abs(result['losses'][0] - reference) / abs(reference)
      ok &= result['first_loss_vs_first'] <= tolerance
  results = {v: results[v] for v in LOSS_VARIANTS if v in results}
  return {'attention': impl, 'results': results, 'ok': ok}


def tune(
  smoke: bool,
  workdir: str,
  clock: Clock,
  step_results: dict,
  default_impl: str,
  keep_dir: str = '',
) -> dict:
  """The step with the fastest attention under each of TUNE_VARIANTS, one process each, against
  the step stage's row of that attention (the base; measured here when the step stage did not
  run). A variant that does not run (a flag this XLA does not know, activations that do not
  fit) is reported, not a failure; one whose first loss is off the base's fails the stage. The
  first variant (configs/bloom_1b3.py's own step) is profiled too, its trace and HLO kept under
  `keep_dir`/tune (step_throughput.py --keep_profile). Its processes take TUNE_MEM_FRACTION of
  the GPU's memory unless the suite's environment says otherwise."""
  impl = fastest(step_results) or default_impl
  extra = (
    ['--smoke', '--global_batch', '4', '--warmup', '1', '--steps', '1']
    if smoke
    else ['--global_batch', '16', '--warmup', '2', '--steps', '3']
  )
  results: dict = {}
  base = step_results.get(impl, {})
  todo: dict[str, tuple[tuple[str, ...], str]] = {}
  if 'step_s_median' in base:
    results['base'] = {**base, 'from': 'the step stage'}
  else:
    todo['base'] = (REFERENCE_STEP, '')
  variants = SMOKE_TUNE_VARIANTS if smoke else TUNE_VARIANTS
  todo.update(variants)
  profiled = next(iter(variants))
  for name, (overrides, flags) in todo.items():
    limit = min(SMOKE_LIMIT if smoke else LIMITS['tune'], clock.left())
    if limit < 10:
      results[name] = {'failed': 'skipped: out of the time budget'}
      continue
    env = {
      'XLA_PYTHON_CLIENT_MEM_FRACTION': os.environ.get(
        'XLA_PYTHON_CLIENT_MEM_FRACTION', TUNE_MEM_FRACTION
      )
    }
    if flags:
      env['XLA_FLAGS'] = ' '.join(f for f in (os.environ.get('XLA_FLAGS', ''), flags) if f)
    profile = []
    if name == profiled:
      profile = ['--profile_steps', '1' if smoke else '2']
      if keep_dir:
        os.makedirs(os.path.join(keep_dir, 'tune'), exist_ok=True)
        profile += ['--keep_profile', os.path.join(keep_dir, 'tune')]
    found = step_child(
      [impl], workdir, limit, [*extra, *overrides, *profile], env=env, tag=f'tune_{name}'
    )
    results[name] = {**found[impl], 'overrides': list(overrides), 'xla_flags': flags}
  ok = True
  reference = results.get('base', {})
  tolerance = step_throughput_tolerance()
  for name, result in results.items():
    if name == 'base' or not reference.get('losses') or not result.get('losses'):
      continue
    result['first_loss_vs_base'] = abs(result['losses'][0] - reference['losses'][0]) / abs(
      reference['losses'][0]
    )
    ok &= result['first_loss_vs_base'] <= tolerance
    result['speedup_vs_base'] = reference['step_s_median'] / result['step_s_median']
  return {'attention': impl, 'results': results, 'ok': ok}


def shard176b(smoke: bool, workdir: str, limit_s: float) -> dict:
  out = os.path.join(workdir, 'shard176b.json')
  command = [sys.executable, os.path.join(BENCHMARKS, 'shard_176b.py'), '--json', out]
  run = run_child(command + (['--smoke'] if smoke else []), limit_s)
  report = read_json(out) or {'results': {}}
  report['wall_s'] = run['wall_s']
  results = report['results']
  report['ok'] = bool(results) and all(
    'failed' not in r and r.get('finite', True) for r in results.values()
  )
  if run['code'] not in (0, 1) or not results:
    report['failed'] = failure(run, limit_s)
    report['ok'] = False
  return report


def kernel_tests(limit_s: float) -> dict:
  # -n 0: one process (setup.cfg's two xdist workers would each take the GPU's memory).
  command = [sys.executable, '-m', 'pytest', 'tests/kernels', '-v', '--tb=short', '-n', '0']
  command += ['-p', 'no:cacheprovider']
  command += ['-k', f'({GPU_TESTS}) and ({MULTI_DEVICE_TESTS})']
  run = run_child(
    command, limit_s, env={'JAX_DEFAULT_MATMUL_PRECISION': 'highest', 'JAX_PLATFORMS': 'cuda,cpu'}
  )
  summary = [line for line in run['tail'].splitlines() if ' passed' in line or ' failed' in line]
  outcomes = re.findall(r'^(tests/\S+) (PASSED|FAILED|ERROR)', run['output'], re.MULTILINE)
  result = {
    'exit_code': run['code'],
    'summary': summary[-1] if summary else run['tail'][-500:],
    'outcomes': {test: outcome for test, outcome in outcomes},
    'ok': run['code'] == 0,
    'wall_s': run['wall_s'],
  }
  if run['code'] is None:
    result['failed'] = failure(run, limit_s)
  return result


# --- the run --------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--json', required=True, help='write the whole report here')
  parser.add_argument(
    '--smoke',
    action='store_true',
    help='small shapes, no kernel tests: checks every stage runs (CPU)',
  )
  parser.add_argument('--no-tests', action='store_true', help='skip the tests stage')
  parser.add_argument(
    '--only', default='', help=f'comma-separated stages to run (of {", ".join(STAGES)})'
  )
  parser.add_argument(
    '--step_impls',
    default=','.join(STEP_IMPLS),
    help='the attention implementations of the step stage',
  )
  parser.add_argument(
    '--base_attention',
    default='pallas',
    help='the attention of the loss and tune stages when the step stage does not run in the '
    'same call (else the fastest it measured)',
  )
  parser.add_argument(
    '--budget_s',
    type=float,
    default=BUDGET_S,
    help=f'the run stops by this many seconds (default {BUDGET_S:.0f}; --smoke: 3600)',
  )
  parser.add_argument('--child', default='', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  only = [s for s in args.only.split(',') if s]
  unknown = [s for s in only if s not in STAGES]
  if unknown:
    parser.error(f'unknown stage(s) {unknown}; the stages are {", ".join(STAGES)}')
  args.stages = [s for s in STAGES if (not only or s in only)]
  if args.smoke or args.no_tests:
    args.stages = [s for s in args.stages if s != 'tests']
  if args.smoke and args.budget_s == BUDGET_S:
    args.budget_s = 3600.0
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  if args.child == 'matmul':
    matmul_child(args.smoke, args.json)
    return 0
  previous = {}
  if threading.current_thread() is threading.main_thread():
    previous = {s: signal.signal(s, _stop_children) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    return run_suite(args)
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def run_suite(args: argparse.Namespace) -> int:
  clock = Clock(args.budget_s)
  # --smoke (CPU): the H100 stands in for the GPU kind (the cost model and plan's GPU compile).
  platform, device_kind = ('cpu', 'cpu') if args.smoke else default_backend()
  if platform != 'gpu' and not args.smoke:
    print(
      f'error: no GPU here (JAX runs on {platform}); the suite measures a GPU. '
      'Use --smoke to check the script on CPU.',
      file=sys.stderr,
    )
    return 2
  report: dict = {
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'smoke': args.smoke,
    'budget_s': args.budget_s,
    'stages': {},
  }
  stages = report['stages']
  timing: dict = {}
  report['stage_timing'] = timing

  def save() -> None:
    report['wall_s'] = round(clock.elapsed(), 1)
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1)

  def limit(stage: str) -> float:
    return min(SMOKE_LIMIT if args.smoke else LIMITS[stage], clock.left())

  def finish(stage: str, result: dict, started: float) -> None:
    stages[stage] = result
    timing[stage] = {
      'wall_s': round(time.perf_counter() - started, 1),
      'limit_s': None if stage in ('step', 'loss', 'tune') else LIMITS[stage],
    }
    save()

  with tempfile.TemporaryDirectory(prefix='gpu_suite_') as workdir:
    plan_thread: threading.Thread | None = None
    plan_result: dict = {}
    plan_started = time.perf_counter()
    if 'plan' in args.stages:
      plan_thread, plan_result = start_plan(
        args.smoke, limit('plan'), args.json, cost_model_kind(device_kind)
      )
    for stage in args.stages:
      if stage == 'plan':
        continue
      started = time.perf_counter()
      if clock.left() < (TESTS_NEED_S if stage == 'tests' else 15):
        # Not a failure: reported as not run, the suite's report 'incomplete'.
        skipped = f'out of the time budget (rerun with --only {stage})'
        finish(stage, {'skipped': skipped, 'ok': None}, started)
        continue
      print(f'\n=== {stage} ({clock.elapsed():.0f} s into the run) ===', flush=True)
      if stage == 'matmul':
        finish(stage, matmul(args.smoke, workdir, limit(stage)), started)
      elif stage == 'attention':
        finish(stage, attention(args.smoke, workdir, limit(stage)), started)
      elif stage == 'step':
        impls = tuple(s for s in args.step_impls.split(',') if s)
        keep_dir = os.path.dirname(os.path.abspath(args.json))
        finish(stage, steps(args.smoke, workdir, clock, impls, keep_dir), started)
      elif stage == 'loss':
        step_results = stages.get('step', {}).get('results', {})
        default = 'xla' if args.smoke else args.base_attention
        finish(stage, losses(args.smoke, workdir, clock, step_results, default), started)
      elif stage == 'shard176b':
        finish(stage, shard176b(args.smoke, workdir, limit(stage)), started)
      elif stage == 'tune':
        step_results = stages.get('step', {}).get('results', {})
        default = 'xla' if args.smoke else args.base_attention
        keep_dir = os.path.dirname(os.path.abspath(args.json))
        finish(stage, tune(args.smoke, workdir, clock, step_results, default, keep_dir), started)
      elif stage == 'tests':
        finish(stage, kernel_tests(limit(stage)), started)
    device = next(
      (s['device'] for s in (stages.get('matmul', {}), stages.get('step', {})) if s.get('device')),
      'unknown',
    )
    if plan_thread is not None:
      print(f'\n=== plan ({clock.elapsed():.0f} s into the run) ===', flush=True)
      plan_thread.join(timeout=max(5.0, clock.left() + 10))
      if plan_thread.is_alive():
        plan_result.update(failed='still running at the end of the time budget', ok=False)
      impl = fastest(stages.get('step', {}).get('results', {}))
      plan_result['estimate'] = cost_model_estimate(args.smoke, device, impl)
      finish('plan', plan_result, plan_started)
  report.update(
    device=device,
    platform=stages.get('matmul', {}).get('platform', 'unknown'),
    jax=stages.get('matmul', {}).get('jax', 'unknown'),
  )
  report['ok'] = all(stage.get('ok') is not False for stage in stages.values())
  report['incomplete'] = [name for name, stage in stages.items() if stage.get('ok') is None]
  save()
  print('\n' + summary(report), flush=True)
  return 0 if report['ok'] else 1


# --- the summary ----------------------------------------------------------------------------


def _pct(value: float | None) -> str:
  return 'n/a' if value is None else f'{value:.1f}%'


def attention_lines(stage: dict) -> list[str]:
  lines = []
  rows = stage.get('results', [])
  for row in rows:
    note = f' [{row["note"]}]' if row.get('note') else ''
    if 'fwd_tflops' in row:
      errors = row.get('errors', {})
      lines.append(
        f'attention {row["impl"]} seq {row["seq"]}: fwd {row["fwd_tflops"]:.3g} '
        f'({_pct(row.get("fwd_pct_peak"))}) fwd+bwd {row["fwd_bwd_tflops"]:.3g} '
        f'({_pct(row.get("fwd_bwd_pct_peak"))}) bwd '
        + ('n/a' if row.get('bwd_tflops') is None else f'{row["bwd_tflops"]:.3g}')
        + f' TFLOP/s, correct {row["correct"]} (max error '
        f'{max(errors.values()) if errors else float("nan"):.1e}){note}'
      )
    elif 'untimed' in row:  # checked against the reference, not timed (an interpreter)
      errors = row['errors']
      lines.append(
        f'attention {row["impl"]} seq {row["seq"]}: {row["untimed"]}, correct {row["correct"]} '
        f'(max error {max(errors.values()):.1e}){note}'
      )
    else:
      lines.append(
        f'attention {row["impl"]} seq {row["seq"]}: '
        f'{row.get("skipped") or "FAILED " + str(row.get("failed"))}{note}'
      )
  if stage.get('new_failed'):
    lines.append(f'attention {NEW_ATTENTION_IMPLS}: its process FAILED {stage["new_failed"]}')
  seqs = sorted({r['seq'] for r in rows})
  impls = list(dict.fromkeys(r['impl'] for r in rows))
  if seqs and impls:
    lines.append('fwd+bwd TFLOP/s (% of peak) by seq:')
    lines.append(f'  {"impl":<15}' + ''.join(f'{s:>17}' for s in seqs))
    for impl in impls:
      cells = []
      for seq in seqs:
        empty: dict = {}
        row = next((r for r in rows if r['impl'] == impl and r['seq'] == seq), empty)
        if 'fwd_bwd_tflops' in row:
          cells.append(f'{row["fwd_bwd_tflops"]:.4g} ({_pct(row.get("fwd_bwd_pct_peak"))})')
        elif 'untimed' in row:
          cells.append('not timed')
        else:
          cells.append('skipped' if 'skipped' in row else 'FAILED' if row else '-')
      lines.append(f'  {impl:<15}' + ''.join(f'{c:>17}' for c in cells))
  if stage.get('failed'):
    lines.append(f'attention stage: {stage["failed"][-300:]}')
  return lines


def step_line(label: str, r: dict, impl: str) -> str:
  gib = 2**30
  if 'same_as' in r:
    return f'{label}: runs {r["same_as"]} (resolved here; the same program as that row)'
  if 'mfu' not in r:
    if 'skipped' in r:
      return f'{label}: skipped: {r["skipped"]}'
    return f'{label}: FAILED {str(r.get("failed", ""))[-300:]}'
  measured = (
    f', measured peak {r["measured_peak_bytes"] / gib:.1f} GiB'
    if r.get('measured_peak_bytes')
    else ''
  )
  runs = r.get('resolved_to')
  extra = f' (runs {runs})' if runs and runs != impl else ''
  vs = f', vs xla {r["first_loss_vs_xla"]:.1e}' if 'first_loss_vs_xla' in r else ''
  if 'first_loss_vs_first' in r:
    vs = f', vs the first variant {r["first_loss_vs_first"]:.1e}'
  if 'first_loss_vs_base' in r:
    vs = f', {r["speedup_vs_base"]:.3f}x the base, loss vs the base {r["first_loss_vs_base"]:.1e}'
  return (
    f'{label}: {r["step_s_median"] * 1e3:.0f} ms, {r["tokens_per_s"]:,.0f} tokens/s, '
    f'{r["model_tflops"]:.3g} TFLOP/s, MFU {100 * r["mfu"]:.1f}%, loss {r["losses"][0]:.4f}'
    f'{vs}, XLA peak {r["xla_peak_bytes"] / gib:.1f} GiB{measured}{extra}'
  )


def profile_lines(results: dict) -> list[str]:
  import profile_trace

  profiled = {impl: r['profile'] for impl, r in results.items() if 'profile' in r}
  lines = []
  if profiled:
    lines.append('step profile, ms per step (% of step):')
    lines.append(f'  {"category":<24}' + ''.join(f'{impl:>18}' for impl in profiled))
    for category in (*profile_trace.CATEGORIES, profile_trace.IDLE):
      lines.append(
        f'  {category:<24}'
        + ''.join(
          f'{p["ms_per_step"][category]:>9.1f} ({p["pct_of_step"][category]:4.1f}%)'
          for p in profiled.values()
        )
      )
    lines.append(
      f'  {"step (wall)":<24}'
      + ''.join(f'{p["step_ms"]:>9.1f} (100.0%)' for p in profiled.values())
    )
    for impl, p in profiled.items():
      lines.append(
        f'  {impl}: {p["events"]} {p["events_from"]} events '
        f'({p.get("matched_events", "?")} naming an instruction), recognised by '
        + ', '.join(f'{k} {v}' for k, v in sorted(p['recognised_by'].items()))
      )
  for impl, r in results.items():
    if 'profile_failed' in r:
      lines.append(f'step profile {impl}: FAILED {r["profile_failed"][-300:]}')
  return lines


def gpu_compile_lines(compiled: dict, step_results: dict) -> list[str]:
  """plan --gpu's figure beside the step row of the same attention: XLA's peak in the step's own
  process and the allocator's."""
  if 'failed' in compiled:
    return [f'plan --gpu {compiled["gpu"]}: FAILED {compiled["failed"][-300:]}']
  if 'peak_gib' not in compiled:
    return []
  impl = compiled['attention_impl']
  line = (
    f'plan --gpu {compiled["gpu"]} (no GPU used; {impl} attention): XLA peak '
    f'{compiled["peak_gib"]:.3f} GiB'
  )
  row = next(
    (
      r
      for name, r in step_results.items()
      if 'xla_peak_bytes' in r and (r.get('resolved_to') or name) == impl
    ),
    None,
  )
  if row is not None:
    gib = 2**30
    line += f'; the {impl} step here: XLA {row["xla_peak_bytes"] / gib:.3f}'
    if row.get('measured_peak_bytes'):
      line += f", the allocator's peak {row['measured_peak_bytes'] / gib:.3f}"
  return [line]


def summary(report: dict) -> str:
  sys.path.insert(0, BENCHMARKS)
  stages = report['stages']
  lines = [
    f'# GPU suite {report["date"]}: {report["device"]} ({report["platform"]}), jax '
    f'{report["jax"]}, {report["wall_s"]} s, {"ok" if report["ok"] else "FAILED"}'
    + (f', not run: {", ".join(report["incomplete"])}' if report.get('incomplete') else '')
  ]
  for name, stage in stages.items():
    if 'skipped' in stage:
      lines.append(f'{name}: skipped: {stage["skipped"]}')
  if 'tests' in stages and 'summary' in stages['tests']:
    lines.append(f'tests/kernels: {stages["tests"]["summary"]}')
    outcomes = stages['tests'].get('outcomes', {})
    lines += [f'  {outcome} {test}' for test, outcome in outcomes.items() if outcome != 'PASSED']
  matmul = stages.get('matmul', {})
  if 'measured_tflops' in matmul:
    lines.append(
      f'bf16 matmul {matmul["n"]}^3: {matmul["measured_tflops"]:.3g} TFLOP/s measured '
      f'({matmul["peak_tflops"]:.3g}: {matmul["peak_source"]})'
    )
  elif 'failed' in matmul:
    lines.append(f'matmul: FAILED {matmul["failed"][-300:]}')
  lines += attention_lines(stages.get('attention', {}))
  step = stages.get('step', {})
  for impl, r in step.get('results', {}).items():
    lines.append(step_line(f'step {impl}', r, impl))
  lines += profile_lines(step.get('results', {}))
  loss = stages.get('loss', {})
  for variant, r in loss.get('results', {}).items():
    lines.append(step_line(f'loss {variant} ({loss["attention"]} attention)', r, loss['attention']))
  tuned = stages.get('tune', {})
  for variant, r in tuned.get('results', {}).items():
    setting = ' '.join([*r.get('overrides', []), r.get('xla_flags', '')]).strip()
    label = f'tune {variant} ({tuned["attention"]} attention{"; " + setting if setting else ""})'
    lines.append(step_line(label, r, tuned['attention']))
  lines += profile_lines(
    {f'tune {variant}': r for variant, r in tuned.get('results', {}).items() if 'from' not in r}
  )
  shard = stages.get('shard176b', {})
  if shard.get('results'):
    import shard_176b  # (BENCHMARKS is on sys.path: summary's caller put it there)

    lines.append('176B shard (1 of 4 TP ranks of tr11, full recompute; tr11: 150 per A100, 48%):')
  for impl, r in shard.get('results', {}).items():
    if 'tflops' not in r:
      lines.append(f'176B shard {impl}: FAILED {str(r.get("failed"))[-300:]}')
      continue
    lines.append('176B shard ' + shard_176b.describe(r).lstrip())
  if shard.get('failed'):
    lines.append(f'176B shard stage: {shard["failed"][-300:]}')
  plan = stages.get('plan', {})
  if plan.get('ok'):
    estimate = plan.get('gpu_estimate_peak_gib')
    source = f' (from {plan["breakdown_source"]})' if plan.get('breakdown_source') else ''
    lines.append(
      f'plan (CPU compile): peak {plan["peak_gib"]:.1f} GiB, GPU estimate '
      + (
        f'unavailable: {plan.get("breakdown_error")}'
        if estimate is None
        else f'{estimate:.1f} GiB{source}'
      )
    )
  elif plan.get('failed'):
    lines.append(f'plan: FAILED {plan["failed"][-300:]}')
  lines += gpu_compile_lines(plan.get('gpu_compile', {}), stages.get('step', {}).get('results', {}))
  model = plan.get('estimate', {})
  if 'step_s' in model:
    lines.append(
      f'cost model ({model["gpu"]}, {model.get("attention_impl") or "the config"} attention): '
      f'{model["step_s"] * 1e3:.0f} ms, {model["tflops_per_gpu"]:.3g} TFLOP/s, '
      f'{model["memory_gib"]:.1f} GiB'
    )
  elif 'failed' in model:
    lines.append(f'cost model: FAILED {model["failed"][-300:]}')
  lines.append(
    'stage timing: '
    + ', '.join(f'{name} {t["wall_s"]:.0f} s' for name, t in report.get('stage_timing', {}).items())
  )
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
