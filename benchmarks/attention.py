"""Attention kernels on one device: forward and forward+backward TFLOP/s, and their correctness.

    python benchmarks/attention.py [--seqs 2048,4096,8192] [--impls pallas,mosaic,tokamax,cudnn,xla]
        [--json OUT]
    python benchmarks/attention.py --smoke      # tiny shapes; runs on CPU (interpret modes)

The workload is the one of the issue: causal self-attention with ALiBi (BLOOM's slopes), head_dim
128, bf16 inputs, 16 heads, and batch x seq = 16384 tokens (FlashAttention-2's benchmark shape:
seq 2048 -> batch 8, seq 4096 -> batch 4). For each implementation and sequence length:

* correctness first: outputs and dQ/dK/dV of the first batch row (from the timed forward+backward
  program's first run) against the fp32 plain-JAX reference (`attention_reference` on the same
  bf16 inputs upcast, computed once per sequence length), as max |error| / max |reference|; this
  is where the Triton lowering of the Pallas kernels and the GPU path of the Mosaic GPU kernels
  (wgmma, register layouts: what interpret mode replaces) are checked, since CPU tests only
  interpret them;
* then time: `jax.jit` of the forward, and of the forward plus the vjp (dQ, dK, dV), after warm-up,
  the median of `--iters` samples. On a GPU a sample is `BACK_TO_BACK` calls dispatched one after
  the other and waited for once, divided by their number: the host's dispatch of and wait for
  each call (felt most by the shortest, a 0.45 ms forward at seq 2048) then overlap the device's
  work, as in a training step, so the figure is the kernels'. Each row also gives the median of
  single calls, each ended by `block_until_ready` (`fwd_ms_synced`, `fwd_bwd_ms_synced`: how the
  GPU runs up to 2026-11-28 timed every row).

FLOPs (FlashAttention's convention): forward 4 B H S^2 D, halved for causal; backward 2.5 x the
forward (five matmuls against two); so fwd+bwd = 3.5 x forward. The backward's own rate comes from
(fwd+bwd time - fwd time). Percentages are of the device's dense bf16 peak
(`accounting.BF16_PEAK_TFLOPS`; on CPU a matmul probe). The issue's aims: forward >= 50%, backward
>= 40%.

Implementations (`--impls`):

* `pallas`: ours, `t5x_like.kernels.flash_attention` (Triton on GPU, interpret mode on CPU);
* `mosaic`: ours for Hopper, `t5x_like.kernels.mosaic_attention` (Mosaic GPU: TMA, wgmma, warp
  specialisation, ALiBi added in the kernel), the model's `model.attention_impl='mosaic'`; on a
  GPU of compute capability below 9.0 reported as not runnable, with the reason. On CPU it runs in
  Mosaic GPU's interpret mode (the row says so), which simulates every warpgroup, copy and
  barrier: about 15 s for one forward+backward at the smoke shape, so there the row is checked
  against the reference but not timed (`untimed` says why; no TFLOP/s), and lengths above
  `MOSAIC_INTERPRET_MAX_SEQ` (256) are skipped;
* `cudnn`: `jax.nn.dot_product_attention(implementation='cudnn')` with a materialised
  [1, H, S, S] ALiBi bias (`t5x_like.model.attention.cudnn_attention`);
* `xla`: `attention_reference`;
* `tokamax`: the model's `model.attention_impl='tokamax'` (`t5x_like.model.attention.
  tokamax_attention`: its implementation for this device, its score-gradient dtype); where this
  checkout has none, `tokamax-mosaic`'s direct call (the row says so);
* `tokamax-mosaic`: `tokamax.dot_product_attention(q, k, v, bias, is_causal=True,
  implementation='mosaic')` called directly, ALiBi as a float32 [1, H, 1, S] bias slope_h x
  key position (ALiBi up to a constant per score row, which softmax cancels);
* `tokamax-nobias`: the same without a bias: NOT ALiBi, the speed an in-kernel ALiBi should reach
  (a target only; checked against the causal reference without ALiBi);
* `tokamax-cudnn`: `tokamax.dot_product_attention(..., implementation='cudnn')` with the same
  bias, if tokamax's cuDNN path accepts it.

On CPU the tokamax rows run tokamax's `implementation='xla'` (so their code runs; the row says
so); `cudnn` and `pallas` on a platform that cannot run them are reported as skipped with the
reason; a row that fails is reported with its error and the others still run. `--json` is
rewritten after each row (a run cut short keeps its rows). `--blocks` and
`--num_warps/--num_stages` override the Pallas tile sizes and `--mosaic_blocks` the Mosaic GPU
kernels' `MosaicBlocks` (tuning: `attention_sweep.sh`, `mosaic_sweep.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from t5x_like.kernels import (
  BlockSizes,
  MosaicBlocks,
  attention_reference,
  flash_attention,
  mosaic_attention,
)
from t5x_like.kernels.mosaic_attention import INTERPRET_CPU_DEVICES, cuda_runtime_version
from t5x_like.model import attention as attention_lib
from t5x_like.model.transformer import alibi_slopes
from t5x_like.training import accounting

TOLERANCE = 2.5e-2  # bf16 inputs against the fp32 reference (max error / max reference)
MOSAIC_INTERPRET_MAX_SEQ = 256  # longer: Mosaic GPU's interpret mode takes minutes on CPU


IMPLEMENTATIONS = (
  'pallas',
  'mosaic',
  'tokamax',
  'tokamax-mosaic',
  'tokamax-nobias',
  'cudnn',
  'tokamax-cudnn',
  'xla',
)


@dataclasses.dataclass
class Impl:
  fn: Callable | None  # attention of q, k, v
  reason: str | None = None  # why it cannot run here (skipped)
  note: str = ''  # what ran, where it is not what the name says
  alibi: bool = True  # False: checked against the causal reference without ALiBi
  untimed: str | None = None  # why it is only checked, not timed (an interpreter's time)
  max_seq: int | None = None  # the longest sequence it runs here (an interpreter's cost)


def _tokamax(q, k, v, slopes, implementation: str):
  import tokamax

  _absl_flags_parsed()
  bias = None
  if slopes is not None:  # ALiBi up to a per-row constant: slope_h * key position, float32
    seq = k.shape[1]
    bias = (jnp.asarray(slopes, jnp.float32)[:, None] * jnp.arange(seq, dtype=jnp.float32))[
      None, :, None, :
    ]
  return tokamax.dot_product_attention(
    q, k, v, bias=bias, is_causal=True, implementation=implementation
  )


def _absl_flags_parsed() -> None:
  """tokamax reads absl flags and parses sys.argv for them when no one has (our argparse flags
  would be refused): marked parsed, at their defaults."""
  from absl import flags

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def cuda_runtime() -> str:
  """'CUDA runtime 12.9 (12090)', cudaRuntimeGetVersion's number too (the Mosaic GPU kernels
  refuse some: `kernels/mosaic_attention.PTXAS_MISCOMPILES_CAUSAL`), or ''."""
  version = cuda_runtime_version()
  if version is None:
    return ''
  return f'CUDA runtime {version // 1000}.{version % 1000 // 10} ({version})'


def make_impl(
  name: str,
  platform: str,
  slopes,
  blocks: BlockSizes | None,
  mosaic_blocks: MosaicBlocks | None = None,
) -> Impl:
  """The attention function `name` stands for on `platform`, or why it cannot run here."""
  if name == 'xla':
    return Impl(lambda q, k, v: attention_reference(q, k, v, alibi_slopes=slopes, causal=True))
  if name == 'pallas':
    if platform not in ('gpu', 'cpu'):
      return Impl(None, f'Pallas/Triton needs a GPU (or CPU interpret mode), not {platform}')
    return Impl(
      lambda q, k, v: flash_attention(
        q, k, v, alibi_slopes=slopes, causal=True, block_sizes=blocks, interpret=platform == 'cpu'
      ),
      note='interpret mode' if platform == 'cpu' else '',
    )
  if name == 'mosaic':
    device = attention_lib.Device.of(jax.devices()[0])
    # The model's rule for where the kernels run (its head_dim and dtype rules are the kernel's
    # own errors, in the row).
    problems = attention_lib.unmet_constraints(
      'mosaic',
      head_dim=128,
      dtype='bfloat16',
      platform=platform,
      compute_capability=device.compute_capability,
    )
    if problems:
      return Impl(None, '; '.join(problems))
    on_cpu = platform == 'cpu'
    return Impl(
      lambda q, k, v: mosaic_attention(
        q, k, v, alibi_slopes=slopes, blocks=mosaic_blocks, interpret=on_cpu
      ),
      note='Mosaic GPU interpret mode' if on_cpu else cuda_runtime(),
      # The interpreter simulates every warpgroup, copy and barrier: about 6 s a forward and
      # 15 s a forward+backward at the smoke shape (seq 64, padded to 128), a time that says
      # nothing of the kernel; the cost grows with batch x heads x seq^2.
      untimed='checked, not timed (an interpreter)' if on_cpu else None,
      max_seq=MOSAIC_INTERPRET_MAX_SEQ if on_cpu else None,
    )
  if name == 'cudnn':
    if platform != 'gpu':
      return Impl(None, f'cuDNN attention needs a GPU, not {platform}')
    return Impl(lambda q, k, v: attention_lib.cudnn_attention(q, k, v, alibi_slopes=slopes))
  if name.startswith('tokamax'):
    try:
      import tokamax  # noqa: F401
    except ImportError as e:
      return Impl(None, f'tokamax is not installed ({e})')
    on_cpu = platform == 'cpu'
    if name == 'tokamax':
      which = attention_lib.tokamax_implementation(attention_lib.Device.of(jax.devices()[0]))
      return Impl(
        lambda q, k, v: attention_lib.tokamax_attention(q, k, v, alibi_slopes=slopes),
        note=f"model.attention_impl='tokamax' (tokamax implementation={which!r})",
      )
    implementation = {
      'tokamax-mosaic': 'mosaic',
      'tokamax-nobias': 'mosaic',
      'tokamax-cudnn': 'cudnn',
    }[name]
    note = (
      f"tokamax implementation='xla' on cpu (stands in for {implementation!r})" if on_cpu else ''
    )
    implementation = 'xla' if on_cpu else implementation
    if name == 'tokamax-nobias':
      return Impl(
        lambda q, k, v: _tokamax(q, k, v, None, implementation),
        note=('no ALiBi, target only; ' + note).rstrip('; '),
        alibi=False,
      )
    return Impl(lambda q, k, v: _tokamax(q, k, v, slopes, implementation), note=note)
  raise SystemExit(f'unknown implementation {name!r}; use {", ".join(IMPLEMENTATIONS)}')


def fwd_and_bwd(fn):
  forward = jax.jit(fn)

  @jax.jit
  def forward_backward(q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return out, *vjp(do)

  return forward, forward_backward


# Calls per timed sample on a GPU (the module's docstring says why).
BACK_TO_BACK = 5


def median_seconds(fn, args, iters: int, warmup: int = 2, back_to_back: int = 1) -> float:
  """Seconds per call: the median of `iters` samples of `back_to_back` calls waited for once."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(back_to_back - 1):
      fn(*args)
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - start) / back_to_back)
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


def reference_grads(q, k, v, do, slopes):
  """out, dq, dk, dv of the fp32 reference on the first batch row of q, k, v, do (slopes None:
  without ALiBi)."""
  reference = lambda q, k, v: attention_reference(q, k, v, alibi_slopes=slopes, causal=True)
  f32 = lambda x: x[:1].astype(jnp.float32)
  return jax.device_get(fwd_and_bwd(reference)[1](f32(q), f32(k), f32(v), f32(do)))


def errors_against(got, want) -> dict[str, float]:
  """Max error / max reference of out, dq, dk, dv: `got`'s first batch row against `want`."""
  return {
    name: relative_error(a[:1], b) for name, a, b in zip(('out', 'dq', 'dk', 'dv'), got, want)
  }


MOSAIC_BLOCK_FIELDS = tuple(field.name for field in dataclasses.fields(MosaicBlocks))


def parse_mosaic_blocks(text: str) -> MosaicBlocks:
  """--mosaic_blocks: MOSAIC_BLOCK_FIELDS' values in order, comma-separated (0 or 1 for the
  options that are booleans)."""
  values = [int(v) for v in text.split(',')]
  if len(values) != len(MOSAIC_BLOCK_FIELDS):
    raise SystemExit(
      f'--mosaic_blocks needs {len(MOSAIC_BLOCK_FIELDS)} integers '
      f'({",".join(MOSAIC_BLOCK_FIELDS)}), got {text!r}'
    )
  defaults = MosaicBlocks()
  return MosaicBlocks(
    **{
      name: bool(value) if isinstance(getattr(defaults, name), bool) else value
      for name, value in zip(MOSAIC_BLOCK_FIELDS, values)
    }
  )


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
  mosaic_blocks = parse_mosaic_blocks(args.mosaic_blocks) if args.mosaic_blocks else None
  report: dict[str, Any] = {
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
    'mosaic_blocks': None if mosaic_blocks is None else mosaic_blocks.__dict__,
    'results': [],
  }
  print(
    f'# {report["device"]}, jax {jax.__version__}, bf16 peak {peak:.1f} TFLOP/s ({peak_source})',
    flush=True,
  )
  print(
    'impl            seq  batch |  fwd ms  fwd TFLOP/s (% peak) | fwd+bwd ms  TFLOP/s | bwd '
    'TFLOP/s (% peak) | max rel. error out/dq/dk/dv',
    flush=True,
  )

  def save() -> None:
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(report, f, indent=2)

  unsupported: dict[str, int] = {}  # implementation -> the length it raised NotImplementedError at
  # One call per sample on a CPU: its calls run where they are dispatched, nothing overlaps.
  back_to_back = BACK_TO_BACK if platform == 'gpu' else 1
  for seq in args.seqs:
    batch = max(1, args.tokens // seq)
    fwd_flops = 4 * batch * args.heads * seq * seq * args.head_dim * 0.5  # causal
    q, k, v, do = random_inputs(batch, seq, args.heads, args.head_dim, dtype)
    references: dict[bool, Any] = {}  # with / without ALiBi, computed when first needed
    for name in args.impls:
      impl = make_impl(name, platform, slopes, blocks, mosaic_blocks)
      if name in unsupported:  # refused at a shorter length: not tried again
        impl = Impl(None, f'not supported (at seq {unsupported[name]})', impl.note, impl.alibi)
      elif impl.max_seq is not None and seq > impl.max_seq:
        impl = Impl(None, f'too slow here beyond seq {impl.max_seq}', impl.note, impl.alibi)
      row: dict[str, Any] = {'impl': name, 'seq': seq, 'batch': batch}
      if impl.note:
        row['note'] = impl.note
      if not impl.alibi:
        row['alibi'] = False
      if impl.fn is None:
        row['skipped'] = impl.reason
        print(f'{name:14} {seq:5} {batch:5}  skipped: {impl.reason}', flush=True)
        report['results'].append(row)
        save()
        continue
      try:
        forward, forward_backward = fwd_and_bwd(impl.fn)
        # The first run of the timed program is also the correctness check (its first row).
        got = jax.device_get([x[:1] for x in forward_backward(q, k, v, do)])
        if impl.alibi not in references:
          references[impl.alibi] = reference_grads(q, k, v, do, slopes if impl.alibi else None)
        errors = errors_against(got, references[impl.alibi])
        del got
        if impl.untimed is None:
          t_fwd = median_seconds(forward, (q, k, v), args.iters, back_to_back=back_to_back)
          t_all = median_seconds(
            forward_backward, (q, k, v, do), args.iters, back_to_back=back_to_back
          )
          if back_to_back > 1:
            row['fwd_ms_synced'] = 1e3 * median_seconds(forward, (q, k, v), args.iters)
            row['fwd_bwd_ms_synced'] = 1e3 * median_seconds(
              forward_backward, (q, k, v, do), args.iters
            )
      except Exception as e:  # noqa: BLE001 (report the failure of one impl, run the others)
        row['failed'] = f'{type(e).__name__}: {e}'.splitlines()[0][:300]
        if isinstance(e, NotImplementedError) or 'NotImplementedError' in repr(e):
          unsupported[name] = seq
        print(f'{name:14} {seq:5} {batch:5}  FAILED: {row["failed"]}', flush=True)
        report['results'].append(row)
        save()
        continue
      row.update(errors=errors, correct=all(e <= TOLERANCE for e in errors.values()))
      flag = '' if row['correct'] else f'  WRONG (> {TOLERANCE})'
      error_text = '/'.join(f'{errors[n]:.1e}' for n in ('out', 'dq', 'dk', 'dv')) + flag
      if impl.untimed is not None:
        row['untimed'] = impl.untimed
        report['results'].append(row)
        save()
        note = f'  [{impl.note}]' if impl.note else ''
        print(f'{name:14} {seq:5} {batch:5}  {impl.untimed} | {error_text}{note}', flush=True)
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
        fwd_bwd_pct_peak=100 * all_tflops / peak,
        bwd_pct_peak=None if bwd_tflops is None else 100 * bwd_tflops / peak,
      )
      report['results'].append(row)
      save()
      bwd = (
        '     n/a         '
        if bwd_tflops is None
        else f'{bwd_tflops:8.3g} ({row["bwd_pct_peak"]:4.1f}%)'
      )
      synced = (
        f'  [single calls: {row["fwd_ms_synced"]:.2f} / {row["fwd_bwd_ms_synced"]:.2f} ms]'
        if 'fwd_ms_synced' in row
        else ''
      )
      print(
        f'{name:14} {seq:5} {batch:5} | {t_fwd * 1e3:7.2f}  {fwd_tflops:8.3g} '
        f'({row["fwd_pct_peak"]:4.1f}%)      | {t_all * 1e3:9.2f}  {all_tflops:7.3g} | {bwd}'
        '    | ' + error_text + (f'  [{impl.note}]' if impl.note else '') + synced,
        flush=True,
      )
  return report


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--seqs', default='')
  parser.add_argument('--impls', default=','.join(IMPLEMENTATIONS))
  parser.add_argument('--tokens', type=int, default=16384, help='batch x seq per measurement')
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--head_dim', type=int, default=128)
  parser.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float16', 'float32'])
  parser.add_argument('--iters', type=int, default=20)
  parser.add_argument(
    '--blocks', default='', help='block_q,block_k,block_q_dkv,block_k_dkv,block_q_dq,block_k_dq'
  )
  parser.add_argument(
    '--mosaic_blocks',
    default='',
    help='mosaic tiles: ' + ','.join(MOSAIC_BLOCK_FIELDS) + ' (benchmarks/mosaic_sweep.py)',
  )
  parser.add_argument('--num_warps', type=int, default=0)
  parser.add_argument('--num_stages', type=int, default=0)
  parser.add_argument(
    '--smoke',
    action='store_true',
    help='tiny shapes (seq 64 and 80 unless --seqs, 2 heads of 64, 2 iterations): checks that '
    'the script and every implementation run, e.g. on CPU',
  )
  parser.add_argument('--json', default='', help='also write the report here')
  args = parser.parse_args(argv)
  if args.smoke:
    args.seqs = args.seqs or '64,80'
    args.tokens, args.heads, args.head_dim, args.iters = 160, 2, 64, 2
  args.seqs = args.seqs or '2048,4096,8192'
  args.seqs = [int(s) for s in args.seqs.split(',')]
  args.impls = [s.strip() for s in args.impls.split(',') if s.strip()]
  return args


def failures(report: dict) -> list[dict]:
  """Rows that failed to run or gave wrong results."""
  return [r for r in report['results'] if 'failed' in r or r.get('correct') is False]


def use_cpu_devices_for_interpret_mode() -> None:
  """Before jax starts its CPU backend: the CPU devices interpret mode needs (--smoke). It runs
  each warpgroup of a Mosaic GPU kernel as a computation of its own on XLA's CPU client, whose
  threads are max(cores, CPU devices) (mosaic_attention.check_interpret_threads)."""
  jax.config.update('jax_num_cpu_devices', INTERPRET_CPU_DEVICES)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.smoke:
    use_cpu_devices_for_interpret_mode()
  report = run(args)
  return 1 if failures(report) else 0


if __name__ == '__main__':
  sys.exit(main())
