"""What `train.rampup_microbatch_multiple` costs: a ramp-up step run in a program compiled for
more micro-batches than it has, the rest padding.

    python benchmarks/rampup_padding.py [--config configs/tiny.py] [--stages 1,2] [--real 2]
        [--full 8] [--steps 5] [--json OUT]

For each pipeline depth P (mesh data 1 x pipeline P x tensor 1 on virtual CPU devices, one
process) it times the real train step (`step.jit_train_step`, donated state) three ways:

* exact: compiled for `--real` micro-batches and given them (what a ramp-up step is without
  padding: one program per micro-batch count);
* padded: compiled for `--full` micro-batches and given the same `--real` ones plus
  `full - real` micro-batches of padding (`losses.PAD_ID`), as the trainer runs a ramp-up step
  with `train.rampup_microbatch_multiple` (one program for all counts);
* full: compiled for and given `--full` real micro-batches (the step after the ramp-up).

Each is its own compiled program, run `--steps` times after one warm-up step, the three
alternated step by step so that a shared machine's load falls on all of them; the table shows
medians. exact and padded must train the same (their losses are printed and compared: the script
exits 1 if they differ by more than 1e-5 relatively). Without a pipeline the padded step loops
over the real micro-batches only, so padded should cost what exact does; with a pipeline the
stages compute the padding micro-batches, so padded should cost what full does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--config', default='configs/tiny.py')
  p.add_argument('--stages', default='1,2', help='pipeline depths, comma-separated')
  p.add_argument('--real', type=int, default=2, help='micro-batches of the ramp-up step')
  p.add_argument('--full', type=int, default=8, help='micro-batches the padded program has')
  p.add_argument('--steps', type=int, default=5, help='timed steps of each program')
  p.add_argument('--remat', default='', help="model.remat_policy (default: the config's)")
  p.add_argument('--json', default='', help='also write the results here')
  return p.parse_args(argv)


def measure(config: str, stages: int, real: int, full: int, steps: int, remat: str) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from t5x_like.config import load_config_file
  from t5x_like.mesh import partitioning
  from t5x_like.model import losses
  from t5x_like.parallel.train_state import make_layout
  from t5x_like.training import step as trainer

  base = load_config_file(config)
  mbs = base.train.micro_batch_size
  overrides = {
    'mesh.data': 1,
    'mesh.pipeline': stages,
    'mesh.tensor': 1,
    'train.global_batch_size': full * mbs,
    'train.rampup_batch_size': (real * mbs, (full - real) * mbs, 1),
    'train.rampup_microbatch_multiple': full,
  }
  if remat:
    overrides['model.remat_policy'] = remat
  if stages > 1:
    overrides['model.cross_entropy_impl'] = 'chunked'  # 'fused' is refused with a pipeline
  cfg = load_config_file(config, overrides)
  layout = make_layout(cfg, partitioning.make_mesh(1, stages, 1))
  sharding = trainer.batch_sharding(layout)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.model.vocab_size, (full, mbs, cfg.train.seq_len + 1), np.int32)
  padded = tokens.copy()
  padded[real:] = losses.PAD_ID
  batches = {'exact': tokens[:real], 'padded': padded, 'full': tokens}
  runs = {}
  for name, batch in batches.items():
    step = trainer.jit_train_step(cfg, layout)
    runs[name] = {
      'step': step,
      'state': layout.init(cfg.train.seed),
      'batch': jax.device_put(batch, sharding),
      'times': [],
      'losses': [],
    }
  lr = jnp.float32(1e-4)
  for i in range(steps + 1):  # step 0 compiles and warms up
    for run in runs.values():
      start = time.perf_counter()
      run['state'], stats = run['step'](run['state'], run['batch'], lr, jnp.int32(i))
      loss = float(jax.device_get(stats['lm_loss']))
      if i:
        run['times'].append(time.perf_counter() - start)
      run['losses'].append(loss)
  return {
    name: {
      'step_s_median': statistics.median(run['times']),
      'times': run['times'],
      'losses': run['losses'],
      'micro_batches_compiled': int(run['batch'].shape[0]),
      'micro_batches_real': real if name != 'full' else full,
    }
    for name, run in runs.items()
  }


def main(argv=None) -> int:
  args = parse_args(argv)
  stages = [int(s) for s in args.stages.split(',')]
  if args.real < max(stages) or args.full <= args.real:
    print(
      f'--real ({args.real}) must be at least the largest pipeline depth ({max(stages)}) and '
      f'below --full ({args.full})',
      file=sys.stderr,
    )
    return 2
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from t5x_like.mesh import partitioning

  partitioning.ensure_devices(max(stages))  # virtual CPU devices, before JAX starts
  results, ok = {}, True
  print(
    f'{args.config}{" remat " + args.remat if args.remat else ""}: {args.real} real '
    f'micro-batches in a program of {args.full}; medians of {args.steps} steps'
  )
  print('| pipeline | exact s | padded s | full s | padded / exact | padded / full |')
  print('|---:|---:|---:|---:|---:|---:|')
  for p in stages:
    r = measure(args.config, p, args.real, args.full, args.steps, args.remat)
    results[f'pipeline={p}'] = r
    exact, padded, full = (r[k]['step_s_median'] for k in ('exact', 'padded', 'full'))
    print(
      f'| {p} | {exact:.3f} | {padded:.3f} | {full:.3f} | {padded / exact:.2f} | '
      f'{padded / full:.2f} |'
    )
    for a, b in zip(r['exact']['losses'], r['padded']['losses']):
      if abs(a - b) > 1e-5 * abs(a):
        print(
          f'pipeline={p}: padded losses {r["padded"]["losses"]} differ from exact '
          f'{r["exact"]["losses"]}',
          file=sys.stderr,
        )
        ok = False
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
        {
          'config': args.config,
          'remat': args.remat,
          'real': args.real,
          'full': args.full,
          'steps': args.steps,
          'results': results,
        },
        f,
        indent=1,
      )
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
