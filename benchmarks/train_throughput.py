"""Steady-state training throughput on CPU: t5x_like (JAX) against a PyTorch/transformers reference.

    python benchmarks/train_throughput.py [--models tiny,bloom_100m] [--steps N] [--json OUT]
        [--impls ours_f32,torch_f32,ours_bf16,torch_bf16] [--threads N] [--rounds N] [--breakdown]

For each model it measures, each in its own subprocess (so neither framework's thread pool competes
with the other's):

* ours (JAX), model.dtype float32 and bfloat16: the real train step (`step.lower_train_step`,
  what `Trainer.compile` compiles: explicit shardings, donated state) on a
  1 x 1 x 1 mesh; 2 warm-up steps, then N timed steps, each ended by `jax.device_get(stats)` as
  the trainer's loop does. The batch is a fixed random token array already on the device, so the
  numbers exclude the host data pipeline (`--breakdown` times that separately);
* the reference (PyTorch): the same BLOOM as `transformers.BloomForCausalLM` (dropout 0), AdamW
  with the same betas/eps/weight decay (no decay on biases and LayerNorms, as ours), the same
  micro-batching (gradient accumulation over the same micro-batches), clip_grad_norm_(1.0), fp32;
  then again under `torch.autocast('cpu', dtype=torch.bfloat16)`.

Throughput: tokens/s = global_batch x seq_len / median step time; model TFLOP/s from
`accounting.megatron_flops_per_iteration` (the same FLOP count for every implementation); MFU
against the best f32 matmul probe (`accounting.measure_matmul_tflops('float32')`, n = 1024 and 2048)
measured at the start and at the end of the same run (the best of both: on a shared machine a probe
that ran while another process held a core would flatter the MFU). bf16 matmul probes (JAX and
torch) are reported alongside.

`--rounds N` measures every (model, implementation) N times, the rounds interleaved, and keeps the
fastest median of each, so that on a shared machine both frameworks get the same chances at a quiet
spell. The probes also time the three f32 GEMM forms of a training step (x @ W, dY @ W^T,
X^T @ dY) at bloom_100m's MLP shape in both frameworks: that, not a square-matmul probe, is the
matmul speed the two steps actually get.

`--profile` traces one step of ours f32 with `jax.profiler` and splits the XLA ops' time by what
they compute (layer matmuls, LM head, attention, layernorms, the layer scan's stacking, the
optimizer...), plus the time in which no traced op runs: XLA runs its large Eigen dots (the weight
gradients that YNNPACK does not take) asynchronously, outside any op's trace event.
`--breakdown` also times, for ours f32, the forward pass, forward + backward and the attention core
as separate jitted functions (indicative only: they are not the fused step, and on a shared
machine they run under a different load), and the host data pipeline's cost per global batch.
`--threads 1` pins every worker to one CPU (torch with one thread): on a shared machine that
comparison suffers far less from other processes than the default (OpenMP barriers stall when a
core is taken).

cpu_util (this process's CPU seconds / (wall seconds x CPUs it may use), over the timed steps) and
the load average after each worker are recorded: on a shared machine they say how much of the
machine each number actually had. tokens per CPU-s (tokens / CPU seconds of the process) is, with
`--threads 1`, close to what an idle core would give whatever else runs (with more threads it
also counts spin-waiting); "MFU per CPU-s" divides the model FLOPs per CPU-second by an f32
matmul probe also measured per CPU-second.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = '@@RESULT@@ '
WARMUP = 2

# Each model is configs/tiny.py on a single-device mesh plus these overrides. The loss is the
# 'fused' cross-entropy (gradient in the forward pass), the fastest of the three on this CPU, and
# activation recomputation keeps only the matmul outputs ('save_dots'): the layer scan's stacked
# [L, ...] residuals cost more than recomputing the softmax, LayerNorms and GeLU (tiny: 0.76-0.82
# vs 0.87-0.94 s per step in three interleaved pairs, 2026-11-22 07:12 UTC).
MODELS = {
  # The tiny config's own shapes: global batch 16 in 4 micro-batches of 4, seq 128.
  'tiny': {'model.cross_entropy_impl': 'fused', 'model.remat_policy': 'save_dots'},
  # BLOOM with GPT-2-small shapes (12 layers, hidden 768, 12 heads, vocab 8192).
  'bloom_100m': {
    'model.cross_entropy_impl': 'fused',
    'model.remat_policy': 'save_dots',
    'model.num_layers': 12,
    'model.hidden_size': 768,
    'model.num_heads': 12,
    'train.seq_len': 256,
    'train.global_batch_size': 8,
    'train.micro_batch_size': 8,
  },
}
DEFAULT_STEPS = {'tiny': 10, 'bloom_100m': 3}

# The f32 GEMMs of bloom_100m's MLP (tokens x hidden x ffn), in the three forms a training step
# runs: forward x @ W, input gradient dY @ W^T, weight gradient X^T @ dY. Both frameworks time
# them at these shapes: a square-matmul probe flatters whichever library packs small K better.
GEMM_SHAPE = (2048, 768, 3072)
GEMM_FORMS = ('fwd', 'dx', 'dw')


def _best_time(fn, repeats: int = 5) -> float:
  fn()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def build_config(model: str, dtype: str = 'float32'):
  from t5x_like.config import load_config_file

  overrides = {
    'mesh.data': 1,
    'mesh.pipeline': 1,
    'mesh.tensor': 1,
    'model.dtype': dtype,
    **MODELS[model],
  }
  return load_config_file(os.path.join(REPO, 'configs', 'tiny.py'), overrides).validate()


def random_batch(cfg, seed: int = 0):
  """int32 [num_micro, micro_batch, seq_len + 1] tokens in [0, vocab_size)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  shape = (cfg.num_microbatches, cfg.train.micro_batch_size, cfg.train.seq_len + 1)
  return rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)


def _summary(times: list[float], cpu_s: float, cfg) -> dict:
  """Throughput from the median step; cpu_util = this process's CPU time / (wall x nproc) over
  the timed steps, which drops below ~1 when other work on the machine takes the cores."""
  from t5x_like.training import accounting

  gbs, seq = cfg.train.global_batch_size, cfg.train.seq_len
  median = statistics.median(times)
  flops = accounting.megatron_flops_per_iteration(cfg, gbs, seq)
  return {
    'step_times_s': times,
    'step_s_median': median,
    'step_s_min': min(times),
    'step_s_max': max(times),
    'tokens_per_sec': gbs * seq / median,
    'tokens_per_sec_best': gbs * seq / min(times),
    'flops_per_iteration': flops,
    'tflops': flops / median / 1e12,
    'cpu_util': cpu_s / (sum(times) * len(os.sched_getaffinity(0))),
    # With one thread this is close to the throughput of an idle core, whatever else runs.
    'tokens_per_cpu_sec': gbs * seq * len(times) / cpu_s,
  }


def _cpu_time() -> float:
  t = os.times()
  return t.user + t.system


# ----------------------------------------------------------------------------------- workers


def worker_jax_probe(_: argparse.Namespace) -> dict:
  import jax

  from t5x_like.training import accounting

  out = {'jax_version': jax.__version__, 'device': str(jax.devices()[0])}
  for dtype in ('float32', 'bfloat16'):
    for n, repeats in ((1024, 8), (2048, 4)):
      out[f'jax_{dtype}_n{n}_tflops'] = accounting.measure_matmul_tflops(
        dtype, n=n, repeats=repeats
      )
  # The same f32 matmul per CPU-second of this process: with --threads 1, an idle core's peak
  # even while other work shares the machine.
  import jax.numpy as jnp

  n = 2048
  a = jnp.ones((n, n), jnp.float32)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  cpu_start = _cpu_time()
  for _ in range(4):
    matmul(a, a).block_until_ready()
  out[f'jax_float32_n{n}_per_cpu_s_tflops'] = 4 * 2 * n**3 / (_cpu_time() - cpu_start) / 1e12
  t, h, f = GEMM_SHAPE
  x, w, dy = jnp.ones((t, h)), jnp.ones((h, f)), jnp.ones((t, f))
  forms = {
    'fwd': (lambda x, w, dy: x @ w),
    'dx': (lambda x, w, dy: dy @ w.T),
    'dw': (lambda x, w, dy: x.T @ dy),
  }
  for form in GEMM_FORMS:
    gemm = jax.jit(forms[form])
    seconds = _best_time(lambda: gemm(x, w, dy).block_until_ready())
    out[f'jax_float32_gemm_{form}_tflops'] = 2 * t * h * f / seconds / 1e12
  return out


def worker_torch_probe(_: argparse.Namespace) -> dict:
  import torch

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  out = {'torch_version': torch.__version__, 'torch_threads': torch.get_num_threads()}
  for dtype in (torch.float32, torch.bfloat16):
    # n = 2048 unless one n = 512 product says that would take seconds per call: torch's bf16
    # on a CPU without bf16 instructions (AMD Zen 3) runs at ~0.3 GFLOP/s, a minute per n = 2048
    # product. The key names the n measured.
    small = torch.ones(512, 512, dtype=dtype)
    start = time.perf_counter()
    torch.mm(small, small)
    n = 2048 if (time.perf_counter() - start) * 64 < 4.0 else 512
    a, b = torch.ones(n, n, dtype=dtype), torch.ones(n, n, dtype=dtype)
    best = _best_time(lambda: torch.mm(a, b), repeats=4)
    out[f'torch_{str(dtype).split(".")[-1]}_n{n}_tflops'] = 2 * n**3 / best / 1e12
  t, h, f = GEMM_SHAPE
  x, dy = torch.ones(t, h), torch.ones(t, f)
  weight = torch.ones(f, h)  # nn.Linear's [out, in] layout, as the reference model stores it.
  forms = {'fwd': lambda: x @ weight.t(), 'dx': lambda: dy @ weight, 'dw': lambda: dy.t() @ x}
  for form in GEMM_FORMS:
    out[f'torch_float32_gemm_{form}_tflops'] = 2 * t * h * f / _best_time(forms[form]) / 1e12
  return out


def worker_jax(args: argparse.Namespace) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from t5x_like.mesh import partitioning

  try:  # The step's own module; older revisions kept it in trainer.py.
    from t5x_like.training import step as trainer
  except ImportError:
    from t5x_like.training import trainer
  from t5x_like.parallel.train_state import make_layout

  cfg = build_config(args.model, args.dtype)
  mesh = partitioning.make_mesh(1, 1, 1)
  layout = make_layout(cfg, mesh)
  batch_sharding = NamedSharding(mesh, P(None, 'data', None))
  host_batch = random_batch(cfg)
  gbs = cfg.train.global_batch_size
  start = time.perf_counter()
  if hasattr(trainer, 'lower_train_step'):  # What Trainer.compile compiles.
    lowered = trainer.lower_train_step(cfg, layout, cfg.num_microbatches)
  else:  # Older trainers: the same jit, written out.
    step = jax.jit(
      trainer.make_train_step(cfg, layout),
      in_shardings=(layout.shardings, batch_sharding, None, None),
      out_shardings=(layout.shardings, None),
      donate_argnums=(0,),
    )
    abstract_batch = jax.ShapeDtypeStruct(host_batch.shape, jnp.int32, sharding=batch_sharding)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    lowered = step.lower(layout.abstract, abstract_batch, scalar, scalar)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - start
  # The step's third argument: the learning rate since the curriculum change (computed on the
  # host), the consumed samples before it (older revisions, measured for A/B runs).
  takes_lr = 'seq_len' in inspect.signature(getattr(trainer, 'lower_train_step', len)).parameters

  def schedule_arg(i: int):
    if takes_lr:
      from t5x_like.training import schedule

      return jnp.float32(schedule.learning_rate(cfg.optimizer, i * gbs))
    return jnp.int32(i * gbs)

  state = layout.init(cfg.train.seed)
  batch = jax.device_put(host_batch, batch_sharding)
  times, losses, cpu_s = [], [], 0.0
  for i in range(WARMUP + args.steps):
    cpu_start, start = _cpu_time(), time.perf_counter()
    state, stats = compiled(state, batch, schedule_arg(i), jnp.int32(i))
    stats = jax.device_get(stats)
    elapsed = time.perf_counter() - start
    losses.append(float(stats['lm_loss']))
    if i >= WARMUP:
      times.append(elapsed)
      cpu_s += _cpu_time() - cpu_start
      if len(times) >= 2 and sum(times) > args.max_timed_s:
        break
  out = {
    'compile_s': compile_s,
    'losses': losses,
    'num_params': cfg.model.num_params(),
    **_summary(times, cpu_s, cfg),
  }
  if args.profile:
    state, out['profile'] = jax_profile(compiled, state, batch, schedule_arg(0))
  if args.breakdown:
    del state
    out['breakdown'] = jax_breakdown(cfg, layout, host_batch)
  return out


def _profile_category(meta: str) -> str:
  """What part of the train step an HLO op belongs to, from its JAX op_name metadata."""
  m = re.sub(r'^jit\(step\)/while/body/closed_call/?', '', meta)
  if not meta:
    return 'other (no metadata)'
  if re.search(r'bse,ve->bsv|ne,ve->nv|nv,ve->ne|nv,ne->ve', m):
    return 'LM head matmuls (tied embedding)'
  if re.search(r'bqnd,bknd|bnqk,bknd|bnqd,bnkd|bnqk,bnkd', m):
    return 'attention score/context matmuls'
  if '/layers/' in m and 'dot_general' in m:
    return 'layer matmuls (qkv, attn out, mlp)'
  if re.search(r'(^|/)(ln1|ln2|embed_ln|final_ln)/', m):
    return 'layernorms'
  if '/layers/attn/' in m:
    return 'attention elementwise (ALiBi, mask, softmax)'
  if '/layers/mlp/' in m:
    return 'MLP elementwise (bias, GeLU)'
  if (
    not m
    or m.endswith('closed_call')
    or 'dynamic_slice' in m
    or 'dynamic_update_slice' in m
    or 'dynamic_index_in_dim' in m
    or re.search(r'Transformer\)\)?/(while|broadcast_in_dim)', m)
  ):
    return 'layer scan: stacking, slicing, zero-init, copies'
  if '/layers/' in m:
    return 'other per-layer elementwise (residual adds, biases)'
  if 'Transformer' in m or 'jvp()' in m or 'transpose(jvp())' in m:
    return 'embedding, logits mask, cross-entropy'
  return 'optimizer, clipping, grad accumulation'


UNTRACED = 'no traced op running (asynchronous Eigen dots: weight-gradient GEMMs; dispatch)'


def untraced_time(intervals: list[tuple[float, float]]) -> tuple[float, float]:
  """(span, time inside the span covered by no interval) of [start, end) op intervals.

  XLA's CPU runtime runs large non-YNNPACK dots (Eigen) asynchronously: their trace event ends
  when the work is handed over, and the GEMM itself runs while no traced op does. For bloom_100m
  those are the MLP weight gradients, 1.3 s of a 7.6 s step (2026-11-24); a breakdown of op time
  alone books them nowhere.
  """
  if not intervals:
    return 0.0, 0.0
  intervals = sorted(intervals)
  covered, (run_start, run_end) = 0.0, intervals[0]
  for start, end in intervals[1:]:
    if start > run_end:
      covered += run_end - run_start
      run_start, run_end = start, end
    else:
      run_end = max(run_end, end)
  covered += run_end - run_start
  span = max(end for _, end in intervals) - intervals[0][0]
  return span, span - covered


def jax_profile(compiled, state, batch, schedule_arg):
  """Traces one step with jax.profiler and splits the step's time into categories.

  Op times are summed over the ops' trace events (on whichever thread ran them); the time in which
  no traced op runs is its own category (`UNTRACED`), so the shares are of op time plus that, and
  add up to about the step's wall time when the ops rarely overlap.
  """
  import collections
  import glob
  import gzip
  import tempfile

  import jax
  import jax.numpy as jnp

  meta = {}
  for line in compiled.as_text().splitlines():
    match = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = ', line)
    if match and match.group(1) not in meta:
      op_name = re.search(r'op_name="([^"]*)"', line)
      meta[match.group(1)] = op_name.group(1) if op_name else ''
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      start = time.perf_counter()
      state, stats = compiled(state, batch, schedule_arg, jnp.int32(10**6))
      jax.device_get(stats)
      wall = time.perf_counter() - start
    with gzip.open(glob.glob(f'{tmp}/**/perfetto_trace.json.gz', recursive=True)[0]) as f:
      trace = json.load(f)
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  by_category, by_op, intervals = collections.Counter(), collections.Counter(), []
  for e in events:
    if e.get('ph') == 'X' and e.get('name') in meta:
      by_category[_profile_category(meta[e['name']])] += e.get('dur', 0) / 1e6
      by_op[e['name']] += e.get('dur', 0) / 1e6
      intervals.append((e['ts'] / 1e6, (e['ts'] + e.get('dur', 0)) / 1e6))
  op_time = sum(by_category.values())
  span, by_category[UNTRACED] = untraced_time(intervals)
  total = sum(by_category.values())
  top = [{'op': name, 's': t, 'op_name': meta[name][-120:]} for name, t in by_op.most_common(12)]
  return state, {
    'step_wall_s': wall,
    'op_time_s': op_time,
    'ops_span_s': span,
    'untraced_s': by_category[UNTRACED],
    'share': {c: t / total for c, t in by_category.most_common()},
    'top_ops': top,
  }


def jax_breakdown(cfg, layout, host_batch) -> dict:
  """Times the forward, forward+backward and the attention core alone (same shapes, jitted): the
  median of two runs after a warm-up run each."""
  import jax
  import jax.numpy as jnp

  from t5x_like.kernels import attention_reference
  from t5x_like.model import losses
  from t5x_like.model import transformer as model_lib

  model = layout.model.clone(mesh=None)
  dtype = jnp.dtype(cfg.model.dtype)
  params = layout.init(cfg.train.seed).params
  micro = jnp.asarray(host_batch[0])

  def loss_fn(p, tokens):
    p = jax.tree.map(lambda x: x.astype(dtype), p)
    logits = model.apply({'params': p}, tokens[:, :-1])
    return losses.cross_entropy(logits, tokens[:, 1:]).mean()

  m = cfg.model
  b, s, n, d = micro.shape[0], cfg.train.seq_len, m.num_heads, m.head_dim
  qkv = [jnp.ones((b, s, n, d), dtype) * (0.01 * (i + 1)) for i in range(3)]

  slopes = model_lib.alibi_slopes(n) if m.architecture == 'bloom' else None

  def attention_loss(q, k, v):  # The attention core the model calls on a CPU ('xla').
    ctx = attention_reference(q, k, v, alibi_slopes=slopes, causal=True)
    return ctx.astype(jnp.float32).sum()

  # Host data pipeline: the Trainer builds each global batch from the embedded corpus.
  def data_batch():
    from t5x_like.data import load_default

    _, source = load_default(cfg.train.seq_len, cfg.train.seed)
    return lambda: source.batch(0, cfg.train.global_batch_size)

  cases = {
    'forward_per_micro': (jax.jit(loss_fn), (params, micro)),
    'fwd_bwd_per_micro': (jax.jit(jax.value_and_grad(loss_fn)), (params, micro)),
    'attention_core_fwd_bwd_per_layer_per_micro': (
      jax.jit(jax.value_and_grad(attention_loss, argnums=(0, 1, 2))),
      qkv,
    ),
  }
  out = {}
  for name, (fn, fn_args) in cases.items():
    jax.block_until_ready(fn(*fn_args))
    times = []
    for _ in range(2):
      start = time.perf_counter()
      jax.block_until_ready(fn(*fn_args))
      times.append(time.perf_counter() - start)
    out[name] = statistics.median(times)
  try:
    start = time.perf_counter()
    make = data_batch()
    out['data_setup_s'] = time.perf_counter() - start
    make()
    start = time.perf_counter()
    for _ in range(10):
      make()
    out['data_batch_s'] = (time.perf_counter() - start) / 10
  except Exception as e:  # The corpus may be unavailable; the rest of the breakdown still counts.
    out['data_error'] = f'{type(e).__name__}: {e}'
  return out


def worker_torch(args: argparse.Namespace) -> dict:
  import contextlib

  import torch
  from transformers import BloomConfig, BloomForCausalLM

  torch.set_num_threads(len(os.sched_getaffinity(0)))
  torch.manual_seed(0)
  cfg = build_config(args.model)
  m, o = cfg.model, cfg.optimizer
  hf_config = BloomConfig(
    vocab_size=cfg.padded_vocab_size,
    hidden_size=m.hidden_size,
    n_layer=m.num_layers,
    n_head=m.num_heads,
    layer_norm_epsilon=m.layernorm_epsilon,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=False,
  )
  model = BloomForCausalLM(hf_config)
  model.train()
  decay, no_decay = [], []
  for _, p in model.named_parameters():
    (no_decay if p.ndim < 2 else decay).append(p)
  optimizer = torch.optim.AdamW(
    [{'params': decay, 'weight_decay': o.weight_decay}, {'params': no_decay, 'weight_decay': 0.0}],
    lr=o.lr,
    betas=(o.beta1, o.beta2),
    eps=o.eps,
  )
  batch = torch.from_numpy(random_batch(cfg)).long()
  num_micro = batch.shape[0]
  autocast = (
    (lambda: torch.autocast('cpu', dtype=torch.bfloat16))
    if args.dtype == 'bfloat16'
    else contextlib.nullcontext
  )
  times, losses, cpu_s = [], [], 0.0
  for i in range(WARMUP + args.steps):
    cpu_start, start = _cpu_time(), time.perf_counter()
    total = 0.0
    for j in range(num_micro):
      inputs = batch[j, :, :-1]
      with autocast():
        loss = model(input_ids=inputs, labels=inputs).loss
      (loss / num_micro).backward()
      total += loss.item() / num_micro
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    losses.append(total)
    if i >= WARMUP:
      times.append(elapsed)
      cpu_s += _cpu_time() - cpu_start
      if len(times) >= 2 and sum(times) > args.max_timed_s:
        break
  return {
    'losses': losses,
    'hf_num_params': sum(p.numel() for p in model.parameters()),
    'torch_version': torch.__version__,
    **_summary(times, cpu_s, cfg),
  }


WORKERS = {
  'jax_probe': worker_jax_probe,
  'torch_probe': worker_torch_probe,
  'jax': worker_jax,
  'torch': worker_torch,
}


# ------------------------------------------------------------------------------------ driver


def run_worker(
  kind: str,
  model: str = '',
  dtype: str = 'float32',
  steps: int = 0,
  max_timed_s: float = 60.0,
  breakdown: bool = False,
  profile: bool = False,
  threads: int = 0,
  timeout: float = 480,
) -> dict:
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    '--_worker',
    kind,
    '--_model',
    model,
    '--_dtype',
    dtype,
    '--steps',
    str(steps),
    '--threads',
    str(threads),
    '--max-timed-s',
    str(max_timed_s),
  ]
  if breakdown:
    cmd.append('--breakdown')
  if profile:
    cmd.append('--profile')
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get('PYTHONPATH', ''))
  label = f'{kind} {model} {dtype}'.strip()
  print(f'# running {label} ...', file=sys.stderr, flush=True)
  start = time.perf_counter()
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {'error': f'timed out after {timeout:.0f} s'}
  for line in proc.stdout.splitlines():
    if line.startswith(MARKER):
      result = json.loads(line[len(MARKER) :])
      result['wall_s'] = time.perf_counter() - start
      result['loadavg_1m_after'] = os.getloadavg()[0]
      return result
  return {'error': f'exit {proc.returncode}: {proc.stderr.strip()[-2000:]}'}


def machine_info() -> dict:
  cpu = ''
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
          break
      f.seek(0)
      flags = next((l.split(':', 1)[1].split() for l in f if l.startswith('flags')), [])
  except OSError:
    flags = []
  return {
    'date': datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC'),
    'nproc': os.cpu_count(),
    'cpu': cpu,
    'cpu_flags': sorted(f for f in flags if f.startswith(('amx', 'avx512_bf16', 'avx512f'))),
    'loadavg_start': os.getloadavg(),
    'python': platform.python_version(),
  }


def _gemm_pair(form: str, probes: dict, probes_end: dict):
  """(best JAX, torch) TFLOP/s of one model-shaped GEMM form, or None if either is missing."""
  ours = [p.get(f'jax_float32_gemm_{form}_tflops') for p in (probes, probes_end)]
  ours = max((v for v in ours if v), default=None)
  ref = probes.get(f'torch_float32_gemm_{form}_tflops')
  return (ours, ref) if ours and ref else None


def fmt_table(results: dict, peak: float, cpu_peak: float) -> str:
  header = (
    '| model | implementation | step s: median (min-max) | tokens/s (median step) '
    '| tokens/s (best step) | TFLOP/s | MFU vs f32 peak | vs torch f32 '
    '| tokens per CPU-s | MFU per CPU-s | CPU util | load |'
  )
  lines = [header, '|' + '---|' * 12]
  for model, rows in results.items():
    ref = rows.get('torch f32', {}).get('tokens_per_sec')
    for impl, r in rows.items():
      if 'error' in r:
        lines.append(f'| {model} | {impl} | error: {r["error"][-120:]!r} | | | | | | | | | |')
        continue
      ratio = f'{r["tokens_per_sec"] / ref:.2f}x' if ref else '-'
      tokens = r['tokens_per_sec'] * r['step_s_median']  # per iteration
      cpu_mfu = r['flops_per_iteration'] * r['tokens_per_cpu_sec'] / tokens / 1e12 / cpu_peak
      lines.append(
        f'| {model} | {impl} | {r["step_s_median"]:.3f} ({r["step_s_min"]:.3f}-'
        f'{r["step_s_max"]:.3f}) | {r["tokens_per_sec"]:,.0f} | {r["tokens_per_sec_best"]:,.0f} '
        f'| {r["tflops"]:.4f} | {100 * r["tflops"] / peak:.1f}% | {ratio} '
        f'| {r["tokens_per_cpu_sec"]:,.0f} '
        f'| {100 * cpu_mfu:.1f}% '
        f'| {r["cpu_util"]:.2f} '
        f'| {r.get("loadavg_1m_after", float("nan")):.1f} |'
      )
  return '\n'.join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument(
    '--models', default='tiny,bloom_100m', help=f'comma-separated, from {sorted(MODELS)}'
  )
  parser.add_argument(
    '--steps',
    type=int,
    default=0,
    help=f'timed steps per measurement (after {WARMUP} warm-up steps); '
    f'0: per-model defaults {DEFAULT_STEPS}',
  )
  parser.add_argument(
    '--impls',
    default='ours_f32,torch_f32,ours_bf16,torch_bf16',
    help='which of ours_f32, ours_bf16, torch_f32, torch_bf16 to run',
  )
  parser.add_argument(
    '--threads',
    type=int,
    default=0,
    help='0 (default): both frameworks use every CPU; N: each worker is pinned '
    'to the first N CPUs (sched_setaffinity) and torch uses N threads',
  )
  parser.add_argument(
    '--max-timed-s',
    type=float,
    default=60.0,
    help='stop a measurement after this many seconds of timed steps (at least '
    '2 steps), so a loaded machine cannot stretch the run without bound',
  )
  parser.add_argument(
    '--rounds',
    type=int,
    default=1,
    help='measure every (model, implementation) this many times, the rounds '
    'interleaved, and keep the fastest median of each: on a shared machine '
    'both frameworks then get the same chances at a quiet spell',
  )
  parser.add_argument(
    '--budget-s',
    type=float,
    default=540.0,
    help='start no further measurement after this many seconds in all',
  )
  parser.add_argument('--json', default='', help='write all results to this file')
  parser.add_argument(
    '--profile',
    action='store_true',
    help='trace one step of ours f32 with jax.profiler and report where the XLA op time goes',
  )
  parser.add_argument(
    '--breakdown', action='store_true', help='also time forward / fwd+bwd / attention for ours f32'
  )
  parser.add_argument('--_worker', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_model', default='', help=argparse.SUPPRESS)
  parser.add_argument('--_dtype', default='float32', help=argparse.SUPPRESS)
  args = parser.parse_args()

  if args._worker:
    args.model, args.dtype = args._model, args._dtype
    if args.threads:  # Before JAX or torch start their thread pools.
      os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    print(MARKER + json.dumps(WORKERS[args._worker](args)), flush=True)
    return

  models = [m for m in args.models.split(',') if m]
  unknown = set(models) - set(MODELS)
  if unknown:
    parser.error(f'unknown model(s) {sorted(unknown)}; choose from {sorted(MODELS)}')
  impls = [i for i in args.impls.split(',') if i]
  info = machine_info()
  total_start = time.perf_counter()
  threads = args.threads
  probes = {
    **run_worker('jax_probe', threads=threads),
    **run_worker('torch_probe', threads=threads),
  }
  names = {
    'ours_f32': 'ours f32',
    'ours_bf16': 'ours bf16',
    'torch_f32': 'torch f32',
    'torch_bf16': 'torch bf16 autocast',
  }
  bad = set(impls) - set(names)
  if bad:
    parser.error(f'unknown implementation(s) {sorted(bad)}; choose from {sorted(names)}')
  # The f32 pair (the goals) of every model first, then the bf16 ones, so a run cut short by
  # --budget-s still has what matters most.
  results = {
    model: {names[i]: {'error': 'skipped: --budget-s spent'} for i in impls} for model in models
  }
  order = sorted(
    ((model, impl) for model in models for impl in impls),
    key=lambda mi: ('bf16' in mi[1], models.index(mi[0]), impls.index(mi[1])),
  )
  for round_index, (model, impl) in ((r, mi) for r in range(args.rounds) for mi in order):
    if time.perf_counter() - total_start > args.budget_s:
      print(
        f'# skipping {model} {impl} (round {round_index + 1}): --budget-s={args.budget_s:.0f} '
        'spent',
        file=sys.stderr,
      )
      continue
    kind, dtype = impl.split('_')
    dtype = {'f32': 'float32', 'bf16': 'bfloat16'}[dtype]
    first = round_index == 0  # The profile and breakdown once, in the first round.
    result = run_worker(
      'jax' if kind == 'ours' else 'torch',
      model,
      dtype,
      args.steps or DEFAULT_STEPS[model],
      max_timed_s=args.max_timed_s,
      breakdown=args.breakdown and impl == 'ours_f32' and first,
      profile=args.profile and impl == 'ours_f32' and first,
      threads=threads,
    )
    kept = results[model][names[impl]]
    medians = kept.get('round_step_s_medians', []) + [result.get('step_s_median')]
    if 'error' in kept or result.get('step_s_median', float('inf')) < kept['step_s_median']:
      result = {**{k: v for k, v in kept.items() if k in ('profile', 'breakdown')}, **result}
      results[model][names[impl]] = kept = result
    kept['round_step_s_medians'] = medians
  # Probe again at the end: on a shared machine the best of both is the fairer peak.
  probes_end = run_worker('jax_probe', threads=threads)
  info['loadavg_end'] = os.getloadavg()
  # The MFU reference: the best square f32 matmul (n = 1024, 2048), as defined by the goals.
  peak = max(
    v
    for p in (probes, probes_end)
    for k, v in p.items()
    if re.fullmatch(r'jax_float32_n\d+_tflops', k)
  )
  cpu_peak = max(p.get('jax_float32_n2048_per_cpu_s_tflops', 0) for p in (probes, probes_end))
  info['total_s'] = time.perf_counter() - total_start

  info['threads'] = threads or info['nproc']
  print(
    f'\n{info["date"]}; {info["nproc"]} CPUs: {info["cpu"]} ({" ".join(info["cpu_flags"])}); '
    f'workers use {info["threads"]} CPU(s)'
  )
  print(
    f'load average at start {info["loadavg_start"][0]:.2f}, at end '
    f'{info["loadavg_end"][0]:.2f}; total {info["total_s"]:.0f} s'
  )
  print(
    'matmul probes (TFLOP/s): '
    + ', '.join(
      f'{k.removesuffix("_tflops")} {v:.4f}' for k, v in probes.items() if k.endswith('tflops')
    )
  )
  print(
    'matmul probes at the end (TFLOP/s): '
    + ', '.join(
      f'{k.removesuffix("_tflops")} {v:.4f}' for k, v in probes_end.items() if k.endswith('tflops')
    )
  )
  print(
    f'MFU reference (best JAX f32 probe): {peak:.4f} TFLOP/s; per CPU-second: '
    f'{cpu_peak:.4f} TFLOP/CPU-s'
  )
  print(
    f"f32 GEMMs at bloom_100m's MLP shape {'x'.join(map(str, GEMM_SHAPE))} (TFLOP/s, best "
    'JAX of both probes / torch; JAX relative to torch): '
    + ', '.join(
      f'{form} {gemm[0]:.4f} / {gemm[1]:.4f} ({gemm[0] / gemm[1]:.2f}x)'
      for form in GEMM_FORMS
      if (gemm := _gemm_pair(form, probes, probes_end))
    )
  )
  print()
  for model, rows in results.items():
    r = rows.get('ours f32') or rows.get('ours bf16') or {}
    if 'num_params' in r:
      cfg = build_config(model)
      print(
        f'{model}: {r["num_params"] / 1e6:.2f}M params (ModelConfig.num_params), '
        f'{cfg.model.num_layers} layers x hidden {cfg.model.hidden_size} x '
        f'{cfg.model.num_heads} heads, vocab {cfg.padded_vocab_size}, seq {cfg.train.seq_len}, '
        f'global batch {cfg.train.global_batch_size} in {cfg.num_microbatches} micro-batch(es) '
        f'of {cfg.train.micro_batch_size}; '
        f'{r["flops_per_iteration"] / 1e9:.1f} GFLOP/iteration; '
        f'{len(r["step_times_s"])} timed steps after {WARMUP} warm-up'
      )
  print()
  print(fmt_table(results, peak, cpu_peak))
  print()
  for model, rows in results.items():
    ours, ref = rows.get('ours f32', {}), rows.get('torch f32', {})
    if 'tokens_per_sec' in ours and 'tokens_per_sec' in ref:
      speedup = ours['tokens_per_sec'] / ref['tokens_per_sec']
      mfu = ours['tflops'] / peak
      print(
        f'{model}: ours f32 / torch f32 = {speedup:.2f}x (goal >= 1.20: '
        f'{"met" if speedup >= 1.2 else "NOT met"}); MFU {100 * mfu:.1f}% (goal >= 60%: '
        f'{"met" if mfu >= 0.6 else "NOT met"})'
      )
      cpu_speedup = ours['tokens_per_cpu_sec'] / ref['tokens_per_cpu_sec']
      cpu_mfu = ours['flops_per_iteration'] / (ours['step_s_median'] * ours['tokens_per_sec'])
      cpu_mfu *= ours['tokens_per_cpu_sec'] / 1e12 / cpu_peak if cpu_peak else float('nan')
      print(
        f'{model} per CPU-second (meaningful with --threads 1): ours / torch = '
        f'{cpu_speedup:.2f}x, MFU {100 * cpu_mfu:.1f}%'
      )
    if 'breakdown' in ours:
      b = ours['breakdown']
      print(
        f'{model} breakdown (ours f32, separate jitted functions, unsharded, timed after '
        f'the steps; s): '
        + ', '.join(f'{k} {v:.4f}' if isinstance(v, float) else f'{k} {v}' for k, v in b.items())
      )
    if 'profile' in ours:
      prof = ours['profile']
      print(
        f'{model} profile (ours f32, one traced step of {prof["step_wall_s"]:.2f} s wall: '
        f'{prof["op_time_s"]:.2f} s of XLA op time, {prof["untraced_s"]:.2f} s with no '
        f'traced op running):'
      )
      for category, share in prof['share'].items():
        print(f'  {100 * share:5.1f}%  {category}')
      print(
        '  top ops: '
        + '; '.join(f'{o["op"]} {o["s"]:.3f} s ({o["op_name"][-60:]})' for o in prof['top_ops'][:6])
      )
    for impl, r in rows.items():
      if len(r.get('round_step_s_medians', [])) > 1:
        print(
          f'{model} {impl}: median step of each round (s) '
          f'{[None if m is None else round(m, 3) for m in r["round_step_s_medians"]]}'
        )
      if 'losses' in r:
        print(f'{model} {impl}: losses {[round(l, 3) for l in r["losses"]]}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
        {
          'machine': info,
          'probes': probes,
          'probes_end': probes_end,
          'peak_f32_tflops': peak,
          'peak_f32_tflops_per_cpu_s': cpu_peak,
          'results': results,
        },
        f,
        indent=2,
      )
    print(f'\nwrote {args.json}')


if __name__ == '__main__':
  main()
