"""Attention kernels on one device: forward and forward+backward TFLOP/s, and their correctness.

    python benchmarks/attention.py [--seqs 2048,4096] [--impls pallas,cudnn,xla] [--json OUT]
    python benchmarks/attention.py --smoke      # tiny shapes; runs on CPU (Pallas interpret mode)

The workload is the one of the issue: causal self-attention with ALiBi (BLOOM's slopes), head_dim
128, bf16 inputs, 16 heads, and batch x seq = 16384 tokens (FlashAttention-2's benchmark shape:
seq 2048 -> batch 8, seq 4096 -> batch 4). For each implementation and sequence length:

* correctness first: outputs and dQ/dK/dV on one batch row against the fp32 plain-JAX reference
  (`attention_reference` on the same bf16 inputs upcast), as max |error| / max |reference|; this is
  where the Triton lowering of the Pallas kernels is checked, since CPU tests only interpret them;
* then time: `jax.jit` of the forward, and of the forward plus the vjp (dQ, dK, dV), after warm-up,
  the median of `--iters` runs, each ended by `block_until_ready`.

FLOPs (FlashAttention's convention): forward 4 B H S^2 D, halved for causal; backward 2.5 x the
forward (five matmuls against two); so fwd+bwd = 3.5 x forward. The backward's own rate comes from
(fwd+bwd time - fwd time). Percentages are of the device's dense bf16 peak
(`accounting.BF16_PEAK_TFLOPS`; on CPU a matmul probe). The issue's aims: forward >= 50%, backward
>= 40%.

`cudnn` runs `jax.nn.dot_product_attention(implementation='cudnn')` with a materialised
[1, H, S, S] ALiBi bias; it and `pallas` on a platform that cannot run them are reported as skipped
with the reason. `--blocks` and `--num_warps/--num_stages` override the Pallas tile sizes (tuning).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.kernels import BlockSizes, attention_reference, flash_attention
from t5x_like.model import attention as attention_lib
from t5x_like.model.transformer import alibi_slopes
from t5x_like.training import accounting

TOLERANCE = 2.5e-2  # bf16 inputs against the fp32 reference (max error / max reference)


def make_impl(name: str, platform: str, slopes, blocks: BlockSizes | None):
  """(attention function of q, k, v, reason it cannot run here or None)."""
  if name == 'xla':
    return (lambda q, k, v: attention_reference(q, k, v, alibi_slopes=slopes, causal=True)), None
  if name == 'pallas':
    if platform not in ('gpu', 'cpu'):
      return None, f'Pallas/Triton needs a GPU (or CPU interpret mode), not {platform}'
    return (
      lambda q, k, v: flash_attention(
        q, k, v, alibi_slopes=slopes, causal=True, block_sizes=blocks, interpret=platform == 'cpu'
      )
    ), None
  if name == 'cudnn':
    if platform != 'gpu':
      return None, f'cuDNN attention needs a GPU, not {platform}'
    return (lambda q, k, v: attention_lib.cudnn_attention(q, k, v, alibi_slopes=slopes)), None
  raise SystemExit(f'unknown implementation {name!r}; use pallas, cudnn, xla')


def fwd_and_bwd(fn):
  forward = jax.jit(fn)

  @jax.jit
  def forward_backward(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, *vjp(do)

  return forward, forward_backward


def median_seconds(fn, args, iters: int, warmup: int = 2) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def relative_error(actual, expected) -> float:
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  if not np.isfinite(actual).all():
    return float('inf')
  return float(np.abs(actual - expected).max() / np.abs(expected).max())


def random_inputs(batch, seq, heads, head_dim, dtype, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  return [
    jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32).astype(dtype) for key in keys
  ]


def check(fn, seq, heads, head_dim, dtype, slopes) -> dict[str, float]:
  """Errors of out, dq, dk, dv on one batch row against the fp32 reference."""
  q, k, v, do = random_inputs(1, seq, heads, head_dim, dtype, seed=1)
  _, forward_backward = fwd_and_bwd(fn)
  got = forward_backward(q, k, v, do)
  reference = lambda q, k, v: attention_reference(q, k, v, alibi_slopes=slopes, causal=True)
  f32 = lambda x: x.astype(jnp.float32)
  want = fwd_and_bwd(reference)[1](f32(q), f32(k), f32(v), f32(do))
  return {name: relative_error(a, b) for name, a, b in zip(('out', 'dq', 'dk', 'dv'), got, want)}


def run(args) -> dict:
  device = jax.devices()[0]
  platform = device.platform
  peak, peak_source = accounting.device_peak_tflops('bfloat16')
  dtype = jnp.dtype(args.dtype)
  slopes = alibi_slopes(args.heads)
  blocks = None
  if args.blocks or args.num_warps or args.num_stages:
    base = BlockSizes.for_head_dim(args.head_dim)
    sizes = dict(
      zip(
        ('block_q', 'block_k', 'block_q_dkv', 'block_k_dkv', 'block_q_dq', 'block_k_dq'),
        (int(b) for b in args.blocks.split(',')) if args.blocks else (),
      )
    )
    blocks = BlockSizes(
      **{
        **base.__dict__,
        **sizes,
        **({'num_warps': args.num_warps} if args.num_warps else {}),
        **({'num_stages': args.num_stages} if args.num_stages else {}),
      }
    )
  report = {
    'date': datetime.date.today().isoformat(),
    'device': f'{platform} {device.device_kind}',
    'jax': jax.__version__,
    'peak_tflops': peak,
    'peak_source': peak_source,
    'shape': {
      'tokens': args.tokens,
      'heads': args.heads,
      'head_dim': args.head_dim,
      'dtype': args.dtype,
      'causal': True,
      'alibi': True,
    },
    'blocks': None if blocks is None else blocks.__dict__,
    'results': [],
  }
  print(
    f'# {report["device"]}, jax {jax.__version__}, bf16 peak {peak:.1f} TFLOP/s ({peak_source})',
    flush=True,
  )
  print(
    'impl    seq  batch |  fwd ms  fwd TFLOP/s (% peak) | fwd+bwd ms  TFLOP/s | bwd TFLOP/s '
    '(% peak) | max rel. error out/dq/dk/dv',
    flush=True,
  )
  for seq in args.seqs:
    batch = max(1, args.tokens // seq)
    fwd_flops = 4 * batch * args.heads * seq * seq * args.head_dim * 0.5  # causal
    q, k, v, do = random_inputs(batch, seq, args.heads, args.head_dim, dtype)
    for name in args.impls:
      fn, reason = make_impl(name, platform, slopes, blocks)
      row = {'impl': name, 'seq': seq, 'batch': batch}
      if reason:
        row['skipped'] = reason
        print(f'{name:6} {seq:5} {batch:5}  skipped: {reason}', flush=True)
        report['results'].append(row)
        continue
      try:
        errors = check(fn, seq, args.heads, args.head_dim, dtype, slopes)
        forward, forward_backward = fwd_and_bwd(fn)
        t_fwd = median_seconds(forward, (q, k, v), args.iters)
        t_all = median_seconds(forward_backward, (q, k, v, do), args.iters)
      except Exception as e:  # noqa: BLE001 (report the failure of one impl, run the others)
        row['failed'] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
        print(f'{name:6} {seq:5} {batch:5}  FAILED: {row["failed"]}', flush=True)
        report['results'].append(row)
        continue
      fwd_tflops = fwd_flops / t_fwd / 1e12
      all_tflops = 3.5 * fwd_flops / t_all / 1e12
      # Timing noise can make fwd+bwd no slower than fwd on tiny (smoke) shapes: no bwd rate then.
      bwd_tflops = 2.5 * fwd_flops / (t_all - t_fwd) / 1e12 if t_all > t_fwd else None
      row.update(
        fwd_ms=t_fwd * 1e3,
        fwd_tflops=fwd_tflops,
        fwd_bwd_ms=t_all * 1e3,
        fwd_bwd_tflops=all_tflops,
        bwd_tflops=bwd_tflops,
        fwd_pct_peak=100 * fwd_tflops / peak,
        bwd_pct_peak=None if bwd_tflops is None else 100 * bwd_tflops / peak,
        errors=errors,
        correct=all(e <= TOLERANCE for e in errors.values()),
      )
      report['results'].append(row)
      flag = '' if row['correct'] else f'  WRONG (> {TOLERANCE})'
      bwd = (
        '     n/a         '
        if bwd_tflops is None
        else f'{bwd_tflops:8.3g} ({row["bwd_pct_peak"]:4.1f}%)'
      )
      print(
        f'{name:6} {seq:5} {batch:5} | {t_fwd * 1e3:7.2f}  {fwd_tflops:8.3g} '
        f'({row["fwd_pct_peak"]:4.1f}%)      | {t_all * 1e3:9.2f}  {all_tflops:7.3g} | {bwd}'
        '    | ' + '/'.join(f'{errors[n]:.1e}' for n in ('out', 'dq', 'dk', 'dv')) + flag,
        flush=True,
      )
  return report


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--seqs', default='2048,4096')
  parser.add_argument('--impls', default='pallas,cudnn,xla')
  parser.add_argument('--tokens', type=int, default=16384, help='batch x seq per measurement')
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--head_dim', type=int, default=128)
  parser.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float16', 'float32'])
  parser.add_argument('--iters', type=int, default=20)
  parser.add_argument(
    '--blocks', default='', help='block_q,block_k,block_q_dkv,block_k_dkv,block_q_dq,block_k_dq'
  )
  parser.add_argument('--num_warps', type=int, default=0)
  parser.add_argument('--num_stages', type=int, default=0)
  parser.add_argument(
    '--smoke',
    action='store_true',
    help='tiny shapes (seq 64 and 80, 2 heads of 64, 2 iterations): checks that '
    'the script and every implementation run, e.g. on CPU',
  )
  parser.add_argument('--json', default='', help='also write the report here')
  args = parser.parse_args(argv)
  if args.smoke:
    args.seqs, args.tokens, args.heads, args.head_dim, args.iters = '64,80', 160, 2, 64, 2
  args.seqs = [int(s) for s in args.seqs.split(',')]
  args.impls = [s.strip() for s in args.impls.split(',') if s.strip()]
  return args


def failures(report: dict) -> list[dict]:
  """Rows that failed to run or gave wrong results."""
  return [r for r in report['results'] if 'failed' in r or r.get('correct') is False]


def main(argv=None) -> int:
  args = parse_args(argv)
  report = run(args)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=2)
  return 1 if failures(report) else 0


if __name__ == '__main__':
  sys.exit(main())
