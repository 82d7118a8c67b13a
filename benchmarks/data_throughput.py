"""Loader throughput: tokens/s the data path delivers against tokens/s the train step consumes.

    python benchmarks/data_throughput.py [--config configs/tiny.py] [--iterations 200]
        [--steps 5] [--cache_dir DIR] [--min_ratio 20] [--json OUT] [--config.KEY=VALUE ...]

Two data paths, each for `--iterations` consecutive iterations of the config's global batch,
built as the trainer builds them (`batches.global_batch`: the samples of the blend, cut into
micro-batches, each id checked against the vocabulary, put on the devices, waited for):

* seqio: `data.mixture_or_task=t5x_like_corpus_mix` (the project's Mixture of two corpus Tasks,
  rates 1:3), materialised first (`materialize.py`; not timed: it happens once);
* Megatron: `data.train_path='1 REF 3 STDLIB'`, a blend of the same two materialised .bin/.idx
  files read as Megatron datasets (`data.split` 969,30,1).

Consumption is the config's real train step on a 1 x 1 x 1 mesh (`step_throughput.measure`: the
compiled step `Trainer` runs, 2 warm-up steps, median of `--steps`), in tokens/s. The ratio
delivered / consumed must be at least `--min_ratio` (exit 1 otherwise): the trainer never waits
for data. The mesh of the timed batches is the config's (tiny: 2 x 1 x 2 over 4 virtual CPU
devices), so each batch is also split into per-device shards as in training.
"""

from __future__ import annotations

import os

# The config's mesh (tiny: 4 devices) on CPU needs virtual devices, set before JAX starts.
os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import argparse
import datetime
import json
import platform
import sys
import time

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from step_throughput import measure

from t5x_like.config import load_config_file, parse_overrides
from t5x_like.data import materialize, seqio_tasks, sources
from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import (
  batches,
  startup,
)
from t5x_like.training import step as step_lib


def delivered_tokens_per_s(cfg, iterations: int) -> dict:
  """Builds `iterations` consecutive global batches of cfg's training data; tokens/s."""
  data = sources.build(cfg.data, cfg.train.seq_len, cfg.train.seed)
  mesh = partitioning.mesh_of(cfg.mesh)
  sharding = step_lib.batch_sharding(make_layout(cfg, mesh))
  gbs = cfg.train.global_batch_size
  jax.block_until_ready(batches.global_batch(cfg, sharding, data.train, 0, gbs))  # warm-up
  start = time.perf_counter()
  for iteration in range(1, iterations + 1):
    jax.block_until_ready(batches.global_batch(cfg, sharding, data.train, iteration * gbs, gbs))
  elapsed = time.perf_counter() - start
  return {
    'iterations': iterations,
    'seconds': elapsed,
    'tokens_per_s': iterations * gbs * cfg.train.seq_len / elapsed,
    'datasets': data.train_names,
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'tiny.py'))
  parser.add_argument('--iterations', type=int, default=200)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--cache_dir', default='', help='data.cache_dir of the seqio Mixture')
  parser.add_argument('--min_ratio', type=float, default=20.0)
  parser.add_argument('--json', default='')
  args, rest = parser.parse_known_args()
  overrides = parse_overrides(rest)
  overrides.update({'data.split': '969,30,1', 'data.valid_path': {}, 'eval.interval': 0})
  seqio_cfg = startup.check_config(
    load_config_file(
      args.config,
      {
        **overrides,
        'data.mixture_or_task': seqio_tasks.CORPUS_MIXTURE,
        'data.cache_dir': args.cache_dir,
      },
    )
  )
  prepared = materialize.prepare(seqio_tasks.CORPUS_MIXTURE, cache_dir=args.cache_dir)
  blend = ' '.join(f'{task.rate:g} {task.train.prefix}' for task in prepared)
  megatron_cfg = startup.check_config(
    load_config_file(args.config, {**overrides, 'data.train_path': blend})
  )

  device = jax.devices()[0]
  report = {
    'date': datetime.date.today().isoformat(),
    'device': device.device_kind,
    'platform': device.platform,
    'cpus': os.cpu_count(),
    'machine': platform.machine(),
    'config': args.config,
    'overrides': overrides,
    'global_batch_size': seqio_cfg.train.global_batch_size,
    'seq_len': seqio_cfg.train.seq_len,
  }
  for name, cfg in (('seqio', seqio_cfg), ('megatron', megatron_cfg)):
    report[name] = delivered_tokens_per_s(cfg, args.iterations)
    print(
      f'{name:>8}: {report[name]["tokens_per_s"]:12,.0f} tokens/s delivered '
      f'({args.iterations} global batches of {cfg.train.global_batch_size} x '
      f'{cfg.train.seq_len} in {report[name]["seconds"]:.2f} s)',
      flush=True,
    )
  step_cfg = seqio_cfg.replace(
    mesh={'data': 1, 'pipeline': 1, 'tensor': 1}, train={'steps': 2 + args.steps}
  )
  step = measure(step_cfg, args.steps)
  report['train_step'] = {k: step[k] for k in ('step_s_median', 'tokens_per_s', 'compile_s')}
  print(
    f'   train: {step["tokens_per_s"]:12,.0f} tokens/s consumed (median step '
    f'{step["step_s_median"] * 1e3:.1f} ms, 1 x 1 x 1 mesh)'
  )
  ratios = {
    name: report[name]['tokens_per_s'] / step['tokens_per_s'] for name in ('seqio', 'megatron')
  }
  report['ratio'] = ratios
  print(
    '   ratio: '
    + ', '.join(f'{name} {ratio:.0f}x' for name, ratio in ratios.items())
    + f' (needed: >= {args.min_ratio:g}x)'
  )
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=1)
  sys.exit(0 if min(ratios.values()) >= args.min_ratio else 1)


if __name__ == '__main__':
  main()
