"""Peak memory per device under ZeRO-1, ZeRO-3 and hybrid sharding (mesh.zero_stage,
mesh.zero_group), from XLA's compile of the train step (`python -m t5x_like.plan` on virtual CPU
devices), for BLOOM-shaped 7B and 13B models on 8 devices, a 70B on 64 and BLOOM-176B on 384.

  python benchmarks/zero_memory.py [--only NAME ...] [--gpu KIND [--attention IMPL]]

Prints a markdown table: XLA's CPU peak and plan's GPU estimate of it (the CPU backend holds
bf16 values in f32 buffers; docs/benchmarks.md says how the estimate is made). With --gpu, XLA's
peak for GPUs of KIND instead (`plan --gpu KIND`: its GPU compiler, no GPU needed) beside the
cost model's estimate (`plan --estimate`) and its error; --attention sets model.attention_impl.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# BLOOM's shapes (ALiBi, 250,880-row padded vocabulary, hidden 4x FFN), on bloom_1b3.py's
# training setup (bf16, chunked cross-entropy, seq 2048), micro-batch 1, full recomputation.
SHAPES = {
  '7b': dict(num_layers=30, hidden_size=4096, num_heads=32),  # bloom-7b1
  '13b': dict(num_layers=40, hidden_size=5120, num_heads=40),  # the 13B goal
  '70b': dict(num_layers=80, hidden_size=8192, num_heads=64),
}

# name -> (config, model shape or None, (data, pipeline, tensor), global batch, [(stage, group)])
CASES = {
  '7b_8': ('bloom_1b3.py', '7b', (8, 1, 1), 256, [(1, 0), (3, 0), (3, 4), (1, 4)]),
  '7b_8_tp2': ('bloom_1b3.py', '7b', (4, 1, 2), 256, [(1, 2), (3, 2)]),
  '13b_8': ('bloom_1b3.py', '13b', (8, 1, 1), 256, [(1, 0), (3, 0), (3, 4)]),
  '70b_64': ('bloom_1b3.py', '70b', (64, 1, 1), 512, [(1, 0), (3, 0), (3, 8)]),
  '70b_64_tp8': ('bloom_1b3.py', '70b', (8, 1, 8), 512, [(1, 0), (3, 0)]),
  '176b_384': ('bloom_176b.py', None, (8, 12, 4), 2048, [(1, 0), (3, 0), (3, 4)]),
}


def plan(config: str, overrides: list[str]) -> dict:
  cmd = [sys.executable, '-m', 't5x_like.plan', '--config', f'configs/{config}', '--json']
  r = subprocess.run(cmd + overrides, cwd=REPO, capture_output=True, text=True, check=False)
  if r.returncode != 0:
    return {'error': r.stderr.strip().splitlines()[-1] if r.stderr.strip() else 'failed'}
  return json.loads(r.stdout)


def case_overrides(shape: str | None, mesh, global_batch: int, stage: int, group: int) -> list:
  data, pipeline, tensor = mesh
  overrides = [
    f'--config.mesh.data={data}',
    f'--config.mesh.pipeline={pipeline}',
    f'--config.mesh.tensor={tensor}',
    f'--config.mesh.zero_stage={stage}',
    f'--config.mesh.zero_group={group}',
    f'--config.train.global_batch_size={global_batch}',
    # bloom_1b3.py names 'step'; these rows are each ZeRO layout's own sum ('tick' without a
    # pipeline, 'step' with one under ZeRO-1).
    '--config.pipeline.grad_sync=auto',
  ]
  if shape is not None:
    model = SHAPES[shape]
    overrides += [f'--config.model.{key}={value}' for key, value in model.items()]
    overrides += [
      f'--config.model.init_std={(1 / (3 * model["hidden_size"])) ** 0.5:.6f}',
      '--config.model.remat_policy=full',
      '--config.train.micro_batch_size=1',
      # bloom_1b3.py's model before 2026-11-28 (its layers are unrolled now, which 'full' refuses).
      '--config.model.cross_entropy_impl=chunked',
      '--config.model.unroll_layers=False',
    ]
  return overrides


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--only', nargs='*', default=None, choices=sorted(CASES))
  parser.add_argument('--gpu', default=None, help="compile for GPUs of this kind (plan's --gpu)")
  parser.add_argument('--attention', default=None, help='model.attention_impl')
  args = parser.parse_args(argv)
  if args.gpu:
    print(
      '| model, devices | mesh (DP, PP, TP) | ZeRO | group | XLA peak GiB | model GiB | error |'
    )
    print('|---|---|---|---|---|---|---|')
  else:
    print('| model, devices | mesh (DP, PP, TP) | ZeRO | group | XLA peak GiB | GPU estimate GiB |')
    print('|---|---|---|---|---|---|')
  for name, (config, shape, mesh, global_batch, variants) in CASES.items():
    if args.only and name not in args.only:
      continue
    for stage, group in variants:
      overrides = case_overrides(shape, mesh, global_batch, stage, group)
      if args.attention:
        overrides.append(f'--config.model.attention_impl={args.attention}')
      row = f'| {name} | {mesh} | {stage} | {group or "all"} |'
      report = plan(config, overrides + (['--gpu', args.gpu] if args.gpu else []))
      if 'error' in report:
        print(f'{row} {report["error"]} | |', flush=True)
      elif args.gpu:
        estimate = plan(config, overrides + ['--estimate', '--gpu', args.gpu])
        gib = estimate.get('estimated_memory_gib', float('nan'))
        peak = report['peak_gib']
        print(f'{row} {peak:.2f} | {gib:.2f} | {100 * (gib / peak - 1):+.1f}% |', flush=True)
      else:
        print(
          f'{row} {report["peak_gib"]:.2f} | '
          f'{report.get("gpu_estimate_peak_gib", float("nan")):.2f} |',
          flush=True,
        )
  return 0


if __name__ == '__main__':
  sys.exit(main())
