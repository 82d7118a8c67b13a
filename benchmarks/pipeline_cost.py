"""Cost of the pipeline, measured from compiled steps: XLA FLOPs and peak memory per device.

  python benchmarks/pipeline_cost.py [--json OUT]

For tiny and bloom_1b3 with mesh.pipeline in {1, 2, 4} (virtual CPU devices, one process each),
runs `python -m t5x_like.plan` twice: rolled (what training runs: its memory is the peak per
device) and with --unroll (XLA's cost analysis counts a loop body once, so FLOPs need every loop
unrolled). The ideal is Megatron's model FLOPs split evenly over the devices; the ratio shows the
bubble and the recomputation as numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, config, overrides). bloom_1b3 keeps its model, sequence and micro-batch but runs on one
# data rank with 2P micro-batches, so that the unrolled compile stays feasible on a CPU.
CASES = []
for stages in (1, 2, 4):
  CASES.append(
    (
      f'tiny P={stages}',
      'configs/tiny.py',
      {
        'mesh.data': 1,
        'mesh.tensor': 1,
        'mesh.pipeline': stages,
        'train.micro_batch_size': 4,
        'train.global_batch_size': 4 * 2 * max(stages, 2),
      },
    )
  )
for stages in (1, 2, 4):
  CASES.append(
    (
      f'bloom_1b3 P={stages}',
      'configs/bloom_1b3.py',
      {
        'mesh.data': 1,
        'mesh.tensor': 1,
        'mesh.pipeline': stages,
        'train.micro_batch_size': 1,
        'train.global_batch_size': 2 * max(stages, 2),
        # The dense loss: --unroll does not unroll the chunked loss's loop over
        # vocabulary chunks, whose FLOPs XLA would count once.
        'model.remat_policy': 'full',
        'model.cross_entropy_impl': 'dense',
        'model.unroll_layers': False,  # `plan --unroll` unrolls every scan; 'full' refuses it
      },
    )
  )


def run_plan(config: str, overrides: dict, unroll: bool) -> dict:
  args = [sys.executable, '-m', 't5x_like.plan', '--config', config, '--json']
  args += [f'--config.{k}={v}' for k, v in overrides.items()]
  if unroll:
    args.append('--unroll')
  out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--json', help='write the results here')
  parser.add_argument('--only', default='', help='run only cases whose name contains this')
  args = parser.parse_args()
  rows = []
  print(
    f'{"case":>14} {"M":>3} {"bubble":>7} {"XLA TFLOP/dev":>14} {"ideal":>10} {"ratio":>6} '
    f'{"peak GiB/dev":>12} {"compile s":>9}'
  )
  for name, config, overrides in CASES:
    if args.only and args.only not in name:
      continue
    rolled = run_plan(config, overrides, unroll=False)
    unrolled = run_plan(config, overrides, unroll=True)
    row = {
      'case': name,
      'num_microbatches': rolled['num_microbatches'],
      'bubble': rolled.get('pipeline_bubble', 0.0),
      'xla_flops_per_device': unrolled['xla_flops_per_device'],
      'ideal_flops_per_device': unrolled['ideal_flops_per_device'],
      'xla_over_ideal': unrolled['xla_over_ideal'],
      'peak_gib_per_device': rolled['peak_gib'],
      'compile_s': rolled['compile_s'],
      'overrides': overrides,
    }
    rows.append(row)
    print(
      f'{name:>14} {row["num_microbatches"]:>3} {row["bubble"]:>7.3f} '
      f'{row["xla_flops_per_device"] / 1e12:>14.4f} '
      f'{row["ideal_flops_per_device"] / 1e12:>10.4f} {row["xla_over_ideal"]:>6.2f} '
      f'{row["peak_gib_per_device"]:>12.3f} {row["compile_s"]:>9.1f}',
      flush=True,
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=2)


if __name__ == '__main__':
  main()
