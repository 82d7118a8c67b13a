"""XLA's peak memory per device for the chronicles' BLOOM-176B topologies (issue 22's table).

Compiles `configs/bloom_176b.py`'s step with `python -m t5x_like.plan` on virtual CPU devices
for every row of seed 004's 02-25 table (NLAYERS 72, NHIDDEN 14336, NHEADS 64), plus tr11 itself
and tr11 at MBS 4, and prints a markdown table beside Megatron-DeepSpeed's measured GB.

  python benchmarks/plan_topologies.py [--only N ...] [--grad_sync step|tick] [--gpu KIND]

--grad_sync: pipeline.grad_sync (default: the config's, 'step'): when the data ranks' gradients
are summed (docs/pipeline.md); the table's earlier figures are 'tick'.
--gpu KIND: compile for 384 GPUs of KIND instead (`plan --gpu`: XLA's GPU compiler on this CPU,
jax's CUDA plugin installed), the chronicles' a100-80gb for their table; the GPU program's own
peak, and the cost model's estimate for the same GPUs beside it (`plan --estimate`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (DP, TP, PP, MBS, GBS, Megatron-DeepSpeed's measured GB), seed 004's 02-25 table.
TABLE = [
  (8, 4, 12, 2, 2048, 44),
  (8, 8, 6, 4, 2048, 55),
  (4, 8, 12, 4, 2048, 49),
  (16, 4, 6, 2, 2048, 57),
  (8, 2, 24, 1, 2048, 44),
  (16, 2, 12, 2, 2048, 63),
  (12, 8, 4, 4, 2016, 59),
  (24, 8, 2, 2, 2016, 76),
]


def plan(overrides: list[str], gpu: str | None = None) -> dict:
  if gpu:
    compiled = _plan([*overrides, '--gpu', gpu])
    estimate = _plan([*overrides, '--estimate', '--gpu', gpu])
    return {**compiled, 'estimated_memory_gib': estimate['estimated_memory_gib']}
  return _plan(overrides)


def describe(r: dict) -> str:
  """The columns after the row's own: XLA's peak and its GPU estimate (a CPU compile), or the
  GPU compile's peak and the cost model's estimate (--gpu)."""
  if 'estimated_memory_gib' in r:
    return f'{r["peak_gib"]:.2f} | {r["estimated_memory_gib"]:.2f} |'
  return f'{r["peak_gib"]:.2f} | {r["gpu_estimate_peak_gib"]:.2f} |'


def _plan(overrides: list[str]) -> dict:
  cmd = [
    sys.executable,
    '-m',
    't5x_like.plan',
    '--config',
    'configs/bloom_176b.py',
    '--json',
    *overrides,
  ]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
  if r.returncode:
    raise SystemExit(f'{" ".join(cmd)} failed:\n{r.stderr[-3000:]}')
  return json.loads(r.stdout.strip().splitlines()[-1])


def row_overrides(dp, tp, pp, mbs, gbs) -> list[str]:
  return [
    '--config.model.num_layers=72',
    '--config.model.hidden_size=14336',
    '--config.model.num_heads=64',
    f'--config.mesh.data={dp}',
    f'--config.mesh.tensor={tp}',
    f'--config.mesh.pipeline={pp}',
    f'--config.train.micro_batch_size={mbs}',
    f'--config.train.global_batch_size={gbs}',
    '--config.train.rampup_batch_size=()',
  ]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', type=int, nargs='*', help='row numbers of TABLE (0-based)')
  parser.add_argument('--grad_sync', choices=('step', 'tick'), help='pipeline.grad_sync')
  parser.add_argument('--gpu', help='compile for GPUs of this kind (plan --gpu), e.g. a100-80gb')
  args = parser.parse_args(argv)
  sync = [f'--config.pipeline.grad_sync={args.grad_sync}'] if args.grad_sync else []
  figures = (
    f"XLA's {args.gpu} compile (GiB) | cost model" if args.gpu else 'XLA peak (GiB) | GPU estimate'
  )
  print(f'| DP | TP | PP | MBS | GBS | Megatron-DeepSpeed (GB) | {figures} |')
  print('|---:|---:|---:|---:|---:|---:|---:|---:|')
  for i, (dp, tp, pp, mbs, gbs, megatron) in enumerate(TABLE):
    if args.only is not None and i not in args.only:
      continue
    r = plan(row_overrides(dp, tp, pp, mbs, gbs) + sync, args.gpu)
    print(f'| {dp} | {tp} | {pp} | {mbs} | {gbs} | {megatron} | {describe(r)}', flush=True)
  for name, extra in (
    ('tr11 (MBS 2, ramp-up)', []),
    (
      'tr11 MBS 4 (no ramp-up)',
      ['--config.train.micro_batch_size=4', '--config.train.rampup_batch_size=()'],
    ),
  ):
    if args.only is not None:
      break
    r = plan(extra + sync, args.gpu)
    print(f'{name}: {figures.replace(" (GiB)", "")}: {describe(r)}', flush=True)


if __name__ == '__main__':
  main()
