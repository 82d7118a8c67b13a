"""Candidate `MosaicBlocks` for the Mosaic GPU attention kernels, compared in one process.

    python benchmarks/mosaic_sweep.py [--seqs 2048,4096,8192] [--rounds 7] [--only NAME,...]
        [--json OUT]
    python benchmarks/mosaic_sweep.py --smoke     # CPU: interpret mode, checked, not timed

The workload is `attention.py`'s (causal ALiBi, 16 heads of 128, bf16, batch x seq = 16384
tokens). For each length, every candidate of `CANDIDATES` (or `--only`'s) is compiled, its
forward and its forward+backward ahead of time in `--compile_workers` threads at once (XLA's
compile, ptxas included, runs outside Python's lock; the tracing and Mosaic GPU's lowering do
not), then checked against the fp32 reference once (out, dQ, dK, dV of the first batch row, the
tolerance of `attention.py`); a candidate that fails to compile or run, or is wrong, says so and
leaves the comparison. Then the correct ones are timed in `--rounds` interleaved rounds: each round
times every candidate's forward and forward+backward once (`attention.median_seconds`, `--iters`
samples of `BACK_TO_BACK` calls), the order rotated from round to round. A candidate's speed-up
in a round is the default's time over its own in that round, so drift that moves every candidate
(clocks, temperature, the other processes of a shared machine) cancels; two processes of the
2026-11-28 H200 run (`mosaic_sweep.sh`'s, a process per candidate until 2026-11-29, and the GPU
suite's) read the same kernel's forward at seq 4096 as 0.71 ms and 0.84 ms.

The table gives each candidate's median TFLOP/s over the rounds and its median speed-up with the
rounds' range. A candidate is `faster` at a length when it was faster in every round, `slower`
when slower in every round, `within` otherwise: under no real difference each round is a coin
toss, so 7 rounds agreeing by chance is 1 in 64 either way. It is worth adopting
(`MosaicBlocks`' defaults) when its forward+backward is faster at every length and its forward
is not slower at any (the forward's own aim is issue 33's; the step runs both).

On CPU (`--smoke`: seq 64 and 128, 2 heads of 64, two candidates by default) the kernels run in
Mosaic GPU's interpret mode: checked, never timed (an interpreter's time says nothing of a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import attention as attention_benchmark  # a script beside this one (benchmarks/)
import jax
import jax.numpy as jnp

from t5x_like.kernels import MosaicBlocks, mosaic_attention
from t5x_like.model.transformer import alibi_slopes
from t5x_like.training import accounting

# Each is MosaicBlocks' defaults with these fields changed; 'default' first (the others' speed-ups
# are against it). docs/kernels.md says what each option does.
CANDIDATES: dict[str, dict[str, Any]] = {
  'default': {},
  'issue_handoff': {'issue_handoff': True},
  'own_turns_no_auto_barriers': {
    'issue_handoff': True,
    'own_turn_barriers': True,
    'no_auto_barriers': True,
  },
  'issue_handoff_persistent': {'issue_handoff': True, 'persistent': True},
  'paired_turns': {'paired_turns': True},
  'bias_in_product': {'bias_in_product': True},
  'own_turns_bias_in_product': {
    'issue_handoff': True,
    'own_turn_barriers': True,
    'bias_in_product': True,
  },
  'intra_overlap_bias_in_product': {'intra_overlap': True, 'bias_in_product': True},
  'paired_turns_bias_in_product': {'paired_turns': True, 'bias_in_product': True},
  'paired_turns_persistent_bias_in_product': {
    'paired_turns': True,
    'persistent': True,
    'bias_in_product': True,
  },
  'bias_in_product_copy24': {'bias_in_product': True, 'copy_registers': 24},
  'bias_in_product_copy24_paired_backward': {
    'bias_in_product': True,
    'copy_registers': 24,
    'paired_backward': True,
  },
}
SMOKE_CANDIDATES = ('default', 'own_turns_no_auto_barriers')
VERDICTS = ('faster', 'slower', 'within')


def blocks_of(name: str) -> MosaicBlocks:
  if name not in CANDIDATES:
    raise SystemExit(f'unknown candidate {name!r}; the candidates: {", ".join(CANDIDATES)}')
  return dataclasses.replace(MosaicBlocks(), **CANDIDATES[name])


def verdict(speedups: Sequence[float]) -> str:
  """'faster' if every round's speed-up is above 1, 'slower' if every one is below, else
  'within' (the rounds disagree)."""
  if all(s > 1.0 for s in speedups):
    return 'faster'
  if all(s < 1.0 for s in speedups):
    return 'slower'
  return 'within'


def interleaved_rounds(
  timers: dict[str, Callable[[], float]], rounds: int, baseline: str
) -> dict[str, dict[str, Any]]:
  """Each round calls every timer once (seconds), the order rotated by one each round; per name
  the rounds' seconds, their median, and against `baseline` (timed in the same rounds) each
  round's speed-up (its seconds over the name's), their median, range and verdict."""
  names = list(timers)
  seconds: dict[str, list[float]] = {name: [] for name in names}
  for index in range(rounds):
    shift = index % len(names)
    for name in names[shift:] + names[:shift]:
      seconds[name].append(timers[name]())
  result = {}
  for name in names:
    speedups = [base / own for base, own in zip(seconds[baseline], seconds[name])]
    result[name] = {
      'seconds': seconds[name],
      'median_s': statistics.median(seconds[name]),
      'speedups': speedups,
      'speedup': statistics.median(speedups),
      'speedup_range': [min(speedups), max(speedups)],
      'verdict': verdict(speedups) if name != baseline else 'baseline',
    }
  return result


def adoptable(rows: list[dict[str, Any]], name: str, seqs: Sequence[int]) -> bool:
  """Faster forward+backward at every length and no slower forward at any (the module's rule)."""
  mine = {row['seq']: row for row in rows if row['candidate'] == name and 'fwd' in row}
  if set(mine) != set(seqs):
    return False
  return all(
    mine[seq]['fwd_bwd']['verdict'] == 'faster' and mine[seq]['fwd']['verdict'] != 'slower'
    for seq in seqs
  )


def compiled_programs(
  candidates: dict[str, MosaicBlocks],
  slopes,
  shape: tuple[int, ...],
  interpret: bool,
  workers: int,
) -> dict[str, tuple[Callable, Callable] | Exception]:
  """Per candidate, its forward (q, k, v) and forward+backward (q, k, v, dout) compiled ahead of
  time for bf16 inputs of `shape`, the programs compiled in `workers` threads at once; or the
  exception that tracing, lowering or compiling raised (a candidate the kernel refuses), when a
  compile of its own in this thread raises it again."""
  spec = jax.ShapeDtypeStruct(shape, jnp.bfloat16)

  def compile_one(blocks: MosaicBlocks, backward: bool):
    fn = lambda q, k, v: mosaic_attention(  # noqa: E731
      q, k, v, alibi_slopes=slopes, blocks=blocks, interpret=interpret
    )
    forward, forward_backward = attention_benchmark.fwd_and_bwd(fn)
    if backward:
      return forward_backward.lower(spec, spec, spec, spec).compile()
    return forward.lower(spec, spec, spec).compile()

  with futures.ThreadPoolExecutor(max_workers=workers) as pool:
    jobs = {
      name: (pool.submit(compile_one, blocks, False), pool.submit(compile_one, blocks, True))
      for name, blocks in candidates.items()
    }
  programs: dict[str, tuple[Callable, Callable] | Exception] = {}
  for name, (forward, forward_backward) in jobs.items():
    try:
      programs[name] = (forward.result(), forward_backward.result())
    except Exception:  # noqa: BLE001
      # Compiled again alone: a failure only under threads costs no candidate.
      try:
        programs[name] = (compile_one(candidates[name], False), compile_one(candidates[name], True))
      except Exception as e:  # noqa: BLE001 (one candidate's failure; the others still run)
        programs[name] = e
  return programs


def first_row_outputs(entry: tuple[Callable, Callable] | Exception, operands) -> list | Exception:
  """out, dq, dk, dv of the first batch row from a candidate's compiled forward+backward, or the
  exception its compile or its run raised."""
  if isinstance(entry, Exception):
    return entry
  try:
    return jax.device_get([x[:1] for x in entry[1](*operands)])
  except Exception as e:  # noqa: BLE001 (one candidate's failure; the others still run)
    return e


def run(args) -> dict[str, Any]:
  device = jax.devices()[0]
  platform = device.platform
  on_cpu = platform == 'cpu'
  peak, peak_source = accounting.device_peak_tflops('bfloat16')
  slopes = alibi_slopes(args.heads)
  names = list(args.only) or list(SMOKE_CANDIDATES if args.smoke else CANDIDATES)
  if 'default' not in names:
    names.insert(0, 'default')
  candidates = {name: blocks_of(name) for name in names}
  report: dict[str, Any] = {
    'date': datetime.date.today().isoformat(),
    'device': f'{platform} {device.device_kind}',
    'jax': jax.__version__,
    'cuda': None if on_cpu else attention_benchmark.cuda_runtime(),
    'peak_tflops': peak,
    'peak_source': peak_source,
    'rounds': args.rounds,
    'compile_workers': args.compile_workers,
    'compile_s': {},
    'candidates': {name: dataclasses.asdict(blocks) for name, blocks in candidates.items()},
    'rows': [],
  }
  print(
    f'# {report["device"]}, jax {jax.__version__}, bf16 peak {peak:.1f} TFLOP/s; '
    f'{len(names)} candidates, {args.rounds} rounds',
    flush=True,
  )

  def save() -> None:
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(report, f, indent=2)

  back_to_back = 1 if on_cpu else attention_benchmark.BACK_TO_BACK
  for seq in args.seqs:
    batch = max(1, args.tokens // seq)
    fwd_flops = 4 * batch * args.heads * seq * seq * args.head_dim * 0.5  # causal
    q, k, v, do = attention_benchmark.random_inputs(
      batch, seq, args.heads, args.head_dim, 'bfloat16'
    )
    reference = attention_benchmark.reference_grads(q, k, v, do, slopes)
    started = time.perf_counter()
    compiled = compiled_programs(candidates, slopes, q.shape, on_cpu, args.compile_workers)
    report['compile_s'][seq] = round(time.perf_counter() - started, 1)
    print(
      f'seq {seq}: {2 * len(compiled)} programs compiled in {report["compile_s"][seq]:.1f} s '
      f'({args.compile_workers} threads)',
      flush=True,
    )
    programs = {}
    for name, entry in compiled.items():
      row: dict[str, Any] = {'candidate': name, 'seq': seq, 'batch': batch}
      got = first_row_outputs(entry, (q, k, v, do))
      if isinstance(got, Exception):
        row['failed'] = f'{type(got).__name__}: {got}'.splitlines()[0][:300]
        print(f'{name:30} {seq:5}  FAILED: {row["failed"]}', flush=True)
        report['rows'].append(row)
        save()
        continue
      errors = attention_benchmark.errors_against(got, reference)
      row.update(
        errors=errors, correct=all(e <= attention_benchmark.TOLERANCE for e in errors.values())
      )
      report['rows'].append(row)
      save()
      error_text = '/'.join(f'{errors[n]:.1e}' for n in ('out', 'dq', 'dk', 'dv'))
      state = 'correct' if row['correct'] else f'WRONG (> {attention_benchmark.TOLERANCE})'
      print(f'{name:30} {seq:5}  {state}, max error out/dq/dk/dv {error_text}', flush=True)
      if row['correct']:
        assert not isinstance(entry, Exception)
        programs[name] = (*entry, row)
    if on_cpu or 'default' not in programs:
      continue  # an interpreter's time means nothing; without the default there is no baseline
    for kind, flops in (('fwd', fwd_flops), ('fwd_bwd', 3.5 * fwd_flops)):
      which = 0 if kind == 'fwd' else 1
      operands = (q, k, v) if kind == 'fwd' else (q, k, v, do)
      timers = {
        name: (
          lambda fn=entry[which], operands=operands: attention_benchmark.median_seconds(
            fn, operands, args.iters, warmup=1, back_to_back=back_to_back
          )
        )
        for name, entry in programs.items()
      }
      for name, figures in interleaved_rounds(timers, args.rounds, 'default').items():
        figures['ms'] = 1e3 * figures['median_s']
        figures['tflops'] = flops / figures['median_s'] / 1e12
        figures['pct_peak'] = 100 * figures['tflops'] / peak
        programs[name][2][kind] = figures
    save()
    print(
      f'seq {seq} x batch {batch}: TFLOP/s (% of peak), speed-up over the default: median '
      f'[range of {args.rounds} rounds] verdict',
      flush=True,
    )
    for name, (_, _, row) in programs.items():
      cells = []
      for kind in ('fwd', 'fwd_bwd'):
        f = row[kind]
        low, high = f['speedup_range']
        cells.append(
          f'{kind} {f["tflops"]:5.0f} ({f["pct_peak"]:4.1f}%) x{f["speedup"]:.3f} '
          f'[{low:.3f}-{high:.3f}] {f["verdict"]}'
        )
      print(f'  {name:30} ' + ' | '.join(cells), flush=True)
  if not on_cpu:
    report['adoptable'] = [
      name for name in names if name != 'default' and adoptable(report['rows'], name, args.seqs)
    ]
    print(f"adoptable (module docstring's rule): {', '.join(report['adoptable']) or 'none'}")
    save()
  return report


def failures(report: dict[str, Any]) -> list[dict[str, Any]]:
  return [row for row in report['rows'] if 'failed' in row or row.get('correct') is False]


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--seqs', default='')
  parser.add_argument('--only', default='', help='candidates by name: ' + ', '.join(CANDIDATES))
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--iters', type=int, default=5, help='samples per timing in a round')
  parser.add_argument('--tokens', type=int, default=16384, help='batch x seq per call')
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--head_dim', type=int, default=128)
  parser.add_argument(
    '--compile_workers',
    type=int,
    default=os.cpu_count() or 1,
    help='threads compiling the programs of a length at once (default: the CPU count)',
  )
  parser.add_argument('--smoke', action='store_true', help='CPU: tiny shapes, checked only')
  parser.add_argument('--json', default='')
  args = parser.parse_args(argv)
  if args.smoke:
    args.tokens, args.heads, args.head_dim = 128, 2, 64
  args.seqs = [
    int(s) for s in (args.seqs or ('64,128' if args.smoke else '2048,4096,8192')).split(',')
  ]
  args.only = [name for name in args.only.split(',') if name]
  for name in args.only:
    blocks_of(name)
  if args.rounds < 1:
    parser.error('--rounds must be at least 1')
  if args.compile_workers < 1:
    parser.error('--compile_workers must be at least 1')
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.smoke:
    attention_benchmark.use_cpu_devices_for_interpret_mode()
  report = run(args)
  return 1 if failures(report) else 0


if __name__ == '__main__':
  sys.exit(main())
