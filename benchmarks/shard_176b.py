"""BLOOM-176B's work per GPU as tr11 split it: one tensor-parallel rank's share of its layers.

    python benchmarks/shard_176b.py [--layers 4] [--attention pallas,tokamax] [--iters 5]
        [--json OUT]
    python benchmarks/shard_176b.py --smoke     # small shapes, runs on CPU

tr11 (configs/bloom_176b.py) ran tensor 4 x pipeline 12 x data 8 on A100s: each GPU computed a
quarter of each of its layers (Megatron's tensor parallelism). This measures that quarter on one
GPU: hidden 14336, 112 heads split 4 ways (28 heads of 128 here), the FFN's 4 x 14336 split 4 ways
(14336 here), micro-batch 2 x seq 2048, bf16, ALiBi (the rank's 28 contiguous slopes), full
recomputation as tr11 (`jax.checkpoint` of each layer, nothing saved: its forward runs again in
the backward pass); `--layers` such layers scanned, forward + backward to the layers' inputs and
bf16 weights (the fp32 master weights, the optimizer, the embedding and the loss are not
measured: this is the layers' compute). The layer is Megatron's column/row-parallel split:
LayerNorm (whole hidden, replicated) -> QKV (h -> 3 x 28 x 128) -> attention (28 heads, the
project's `t5x_like.model.attention.attention` with `--attention`) -> output projection
(3584 -> h) -> [all-reduce] -> LayerNorm -> h -> 14336 -> GeLU -> 14336 -> h -> [all-reduce].

The tensor-parallel all-reduces do not happen on one GPU. Their time is the planner's estimate
(t5x_like/planning/cost_model.py's ring collective: busbw x time = 2 (n - 1)/n x bytes, at its
measured NVLink bus bandwidths, not overlapped with compute, as in Megatron), per layer: 2 in the
forward, 2 in the backward and, under full recomputation, 2 again in the recomputed forward (the
cost model's count: 6 all-reduces of [2, 2048, 14336] bf16 = 117 MB), for the GPU here and for
tr11's A100 nodes.

TFLOP/s per GPU, three counts of the same work (per layer and rank, B = 2, s = 2048, h = 14336;
Megatron's formula 24 B s h^2 (1 + s / 6h) per layer forward, the logits term left out as no
logits are computed here, divided by the 4 ranks):

* `tr11`: Megatron-DeepSpeed's count, which tr11's 150 TFLOP/s per A100 (48% of 312) is: forward
  + backward + the recomputed forward, 4 x the forward (`accounting.megatron_flops_per_iteration`
  counts the same way under remat_policy='full'); the attention's score matmuls counted whole
  (not halved for causality);
* `model`: without the recomputation, 3 x the forward (what MFU counts);
* `executed`: an estimate of the FLOPs the kernels run: the matmuls 4 x, the causal attention's
  score matmuls halved (the kernels skip the masked blocks), forward twice and flash backward
  2.5 x forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from t5x_like.config import ModelConfig
from t5x_like.model import attention as attention_lib
from t5x_like.model.transformer import alibi_slopes, gelu_tanh, layer_norm
from t5x_like.training import accounting

TR11: dict[str, Any] = {
  'hidden': 14336,
  'heads': 112,
  'tensor': 4,
  'seq': 2048,
  'micro_batch': 2,
  'tflops_per_gpu': 150.0,
  'gpu': 'a100-80gb',
  'gpu_peak_tflops': 312.0,
}
SMOKE: dict[str, Any] = {'hidden': 256, 'heads': 16, 'tensor': 4, 'seq': 128, 'micro_batch': 1}
EPS = 1e-5


def layer_shapes(hidden: int, heads: int, head_dim: int, ffn: int) -> dict[str, tuple]:
  """One rank's share of one layer's weights (Megatron's column/row-parallel split)."""
  return {
    'ln1_scale': (hidden,),
    'ln1_bias': (hidden,),
    'qkv_kernel': (hidden, heads, 3, head_dim),
    'qkv_bias': (heads, 3, head_dim),
    'out_kernel': (heads, head_dim, hidden),
    'out_bias': (hidden,),
    'ln2_scale': (hidden,),
    'ln2_bias': (hidden,),
    'wi_kernel': (hidden, ffn),
    'wi_bias': (ffn,),
    'wo_kernel': (ffn, hidden),
    'wo_bias': (hidden,),
  }


def init_layers(key, layers: int, shapes: dict[str, tuple], dtype, std: float) -> dict:
  """Random bf16 weights, stacked [layers, ...] for the scan (values do not change the speed)."""
  params = {}
  for i, (name, shape) in enumerate(sorted(shapes.items())):
    if name.endswith('scale'):
      params[name] = jnp.ones((layers, *shape), dtype)
    elif name.endswith('bias'):
      params[name] = jnp.zeros((layers, *shape), dtype)
    else:
      params[name] = (
        jax.random.normal(jax.random.fold_in(key, i), (layers, *shape), jnp.float32) * std
      ).astype(dtype)
  return params


def make_layer(cfg: ModelConfig, slopes):
  """One rank's layer: x [B, s, h] -> x [B, s, h]; the all-reduces after the output projection
  and the second FFN matmul are where tensor parallelism would sum the ranks' partial outputs."""

  def layer(x, p):
    y = layer_norm(x, p['ln1_scale'], p['ln1_bias'], EPS)
    qkv = jnp.einsum('bse,encd->bsncd', y, p['qkv_kernel']) + p['qkv_bias']
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    context = attention_lib.attention(q, k, v, cfg=cfg, mesh=None, alibi_slopes=slopes)
    x = x + jnp.einsum('bsnd,nde->bse', context, p['out_kernel']) + p['out_bias']  # all-reduce
    y = layer_norm(x, p['ln2_scale'], p['ln2_bias'], EPS)
    y = gelu_tanh(jnp.einsum('bse,ef->bsf', y, p['wi_kernel']) + p['wi_bias'])
    return x + jnp.einsum('bsf,fe->bse', y, p['wo_kernel']) + p['wo_bias']  # all-reduce

  return layer


def make_step(layer):
  """Forward + backward of the scanned layers, each recomputed in the backward (nothing saved)."""
  remat = jax.checkpoint(
    lambda x, p: (layer(x, p), None),
    policy=jax.checkpoint_policies.nothing_saveable,
    prevent_cse=False,
  )

  def forward(x, params):
    return jax.lax.scan(remat, x, params)[0]

  @jax.jit
  def step(x, params, dy):
    out, vjp = jax.vjp(forward, x, params)
    dx, dparams = vjp(dy)
    return out, dx, dparams

  return step


def flops_per_layer(batch: int, seq: int, hidden: int, tensor: int) -> dict[str, float]:
  """FLOPs of one layer on one rank, by the three counts of the module docstring."""
  matmuls = 24 * batch * seq * hidden**2 / tensor  # QKV 6, output 2, FFN 16 (x B s h^2)
  scores = 4 * batch * seq**2 * hidden / tensor  # QK^T and PV, whole
  forward = matmuls + scores  # = 24 B s h^2 (1 + s / 6h) / tensor
  return {
    'tr11': 4 * forward,
    'model': 3 * forward,
    'executed': 4 * matmuls + scores / 2 * (1 + 1 + 2.5),
  }


def tp_allreduce_estimate(batch: int, seq: int, hidden: int, tensor: int, gpu: str) -> dict:
  """The planner's time for one layer's tensor-parallel all-reduces on `gpu`'s NVLink."""
  from t5x_like.planning import cost_model

  size = batch * seq * hidden * 2  # bf16 hidden states
  spec = cost_model.GPUS[gpu]
  one = cost_model.collective_s(spec, 'all-reduce', size, tensor, tensor, False)
  how = 'cost_model.collective_s (ring all-reduce at the measured NVLink bus bandwidth)'
  return {
    'gpu': gpu,
    'bytes_each': size,
    'seconds_each': one,
    'per_layer_forward_backward_s': 4 * one,
    'per_layer_with_recompute_s': 6 * one,
    'how': how,
  }


def measure(args, impl: str) -> dict:
  shape = SMOKE if args.smoke else TR11
  hidden, tensor = shape['hidden'], shape['tensor']
  heads = shape['heads'] // tensor
  head_dim = hidden // shape['heads']
  ffn = 4 * hidden // tensor
  batch, seq = shape['micro_batch'], shape['seq']
  # attention_lib reads the head count, head_dim, dtype and implementation from a ModelConfig.
  fields: dict[str, Any] = {'attention_impl': impl}  # checked when the attention is traced
  cfg = ModelConfig(hidden_size=heads * head_dim, num_heads=heads, dtype='bfloat16', **fields)
  slopes = alibi_slopes(shape['heads'])[:heads]  # rank 0's heads
  dtype = jnp.bfloat16
  key = jax.random.PRNGKey(0)
  params = init_layers(
    key, args.layers, layer_shapes(hidden, heads, head_dim, ffn), dtype, math.sqrt(1 / (3 * hidden))
  )
  x = jax.random.normal(jax.random.fold_in(key, 100), (batch, seq, hidden), jnp.float32).astype(
    dtype
  )
  dy = jax.random.normal(jax.random.fold_in(key, 101), (batch, seq, hidden), jnp.float32)
  dy = dy.astype(dtype)
  step = make_step(make_layer(cfg, slopes))
  start = time.perf_counter()
  compiled = step.lower(x, params, dy).compile()
  compile_s = time.perf_counter() - start
  out = None
  for _ in range(args.warmup):
    out = jax.block_until_ready(compiled(x, params, dy))
  finite = bool(out is None or all(np.isfinite(np.asarray(a, np.float32)).all() for a in out[:2]))
  times = []
  for _ in range(args.iters):
    start = time.perf_counter()
    jax.block_until_ready(compiled(x, params, dy))
    times.append(time.perf_counter() - start)
  median = statistics.median(times)
  per_layer = median / args.layers
  flops = flops_per_layer(batch, seq, hidden, tensor)
  peak, peak_source = accounting.device_peak_tflops('bfloat16')
  device = jax.devices()[0]
  stats = device.memory_stats() or {}
  result = {
    'attention': impl,
    'layers': args.layers,
    'compile_s': compile_s,
    'finite': finite,
    'step_s_median': median,
    'layer_ms': per_layer * 1e3,
    'tflops': {name: f / per_layer / 1e12 for name, f in flops.items()},
    'pct_of_peak': {name: 100 * f / per_layer / 1e12 / peak for name, f in flops.items()},
    'peak_tflops': peak,
    'peak_source': peak_source,
    'measured_peak_bytes': stats.get('peak_bytes_in_use'),
  }
  # Beside tr11: this GPU's layer time plus the planner's all-reduces on its NVLink, and on
  # tr11's A100s (tr11's 150 TFLOP/s includes its communication, pipeline bubble and optimizer).
  from t5x_like.planning import cost_model

  kind = 'h100-80gb'
  for marker, name in (('H200', 'h200'), ('H100', 'h100-80gb'), ('A100', 'a100-80gb')):
    if marker in device.device_kind:
      kind = name
      break
  result['tp_allreduce'] = {}
  for gpu in dict.fromkeys((kind, TR11['gpu'])):
    if gpu not in cost_model.GPUS:
      continue
    estimate = tp_allreduce_estimate(batch, seq, hidden, tensor, gpu)
    with_comm = per_layer + estimate['per_layer_with_recompute_s']
    estimate['tr11_tflops_with_allreduces'] = flops['tr11'] / with_comm / 1e12
    result['tp_allreduce'][gpu] = estimate
  return result


def describe(r: dict) -> str:
  t, pct = r['tflops'], r['pct_of_peak']
  line = (
    f'{r["attention"]:>8}: {r["layer_ms"]:7.2f} ms/layer, TFLOP/s per GPU: tr11 count '
    f'{t["tr11"]:.4g} ({pct["tr11"]:.1f}% of peak), model {t["model"]:.4g}, executed '
    f'{t["executed"]:.4g}; compile {r["compile_s"]:.1f} s'
  )
  for gpu, e in r.get('tp_allreduce', {}).items():
    line += (
      f'\n          + planner all-reduces on {gpu}: 6 x {e["seconds_each"] * 1e3:.2f} ms per '
      f'layer -> {e["tr11_tflops_with_allreduces"]:.4g} TFLOP/s (tr11 count)'
    )
  return line


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument(
    '--attention',
    default='',
    help="comma-separated model.attention_impl values (default: 'pallas,tokamax' on GPU, "
    "'xla,tokamax' on CPU)",
  )
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--iters', type=int, default=5)
  parser.add_argument('--smoke', action='store_true', help='small shapes (CPU)')
  parser.add_argument('--json', default='')
  args = parser.parse_args(argv)
  if args.smoke:
    args.layers = min(args.layers, 2)
  device = jax.devices()[0]
  impls = args.attention or ('pallas,tokamax' if device.platform == 'gpu' else 'xla,tokamax')
  shape = SMOKE if args.smoke else TR11
  report: dict = {
    'date': datetime.date.today().isoformat(),
    'device': device.device_kind,
    'platform': device.platform,
    'jax': jax.__version__,
    'shape': {**shape, 'layers': args.layers, 'dtype': 'bfloat16', 'remat': 'full'},
    'tr11': TR11,
    'results': {},
  }
  print(
    f'{device.device_kind} ({device.platform}), jax {jax.__version__}: one tensor-parallel rank '
    f'of {shape["tensor"]}, hidden {shape["hidden"]}, {shape["heads"] // shape["tensor"]} heads, '
    f'micro-batch {shape["micro_batch"]} x seq {shape["seq"]}, {args.layers} layers, full '
    f'recomputation; tr11: {TR11["tflops_per_gpu"]:.0f} TFLOP/s per A100',
    flush=True,
  )
  failed = False
  for impl in impls.split(','):
    try:
      result = measure(args, impl)
    except Exception as e:  # noqa: BLE001 (one implementation's failure; the others still run)
      result = {'attention': impl, 'failed': f'{type(e).__name__}: {e}'[:1500]}
      print(f'{impl:>8}: FAILED: {result["failed"][:300]}', flush=True)
      failed = True
    else:
      print(describe(result), flush=True)
      failed |= not result['finite']
    report['results'][impl] = result
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(report, f, indent=1)
    jax.clear_caches()
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
