"""The real train step on one accelerator: tokens/s, model TFLOP/s and MFU per attention kernel.

    python benchmarks/step_throughput.py [--config configs/bloom_1b3.py] [--attention
        xla,pallas,cudnn] [--global_batch 16] [--steps 10] [--json OUT] [--config.KEY=VALUE ...]

The config's model, optimizer and precision on a 1 x 1 x 1 mesh (the step that `Trainer` compiles:
`step.lower_train_step`, explicit shardings, donated state). For each attention implementation the
same initial state and the same random batch: correctness first (each implementation's first-step
loss against xla's, relative difference; the script exits 1 above 2e-2, bf16), then 2 warm-up
steps and the median of `--steps` timed steps, each ended by `jax.device_get(stats)` as the
trainer's loop does; XLA's compiled memory figure and, on a GPU, the allocator's measured peak
(`memory_stats()['peak_bytes_in_use']`: run one implementation per process for a per-kernel
figure, as `benchmarks/gpu_suite.py` does). Model FLOPs are Megatron's
(`accounting.megatron_flops_per_iteration`, counting the recomputation that the remat policy does),
MFU is against the device's dense bf16 peak
(`accounting.BF16_PEAK_TFLOPS`). On CPU it runs (`--smoke`: a small model) but its numbers say
nothing about GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from t5x_like.config import ConfigError, load_config_file, parse_overrides
from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import accounting, schedule, startup
from t5x_like.training import step as step_lib

WARMUP = 2
LOSS_TOLERANCE = 2e-2
SMOKE = {
  'model.num_layers': 2,
  'model.hidden_size': 128,
  'model.num_heads': 2,
  'model.vocab_size': 1000,
  'model.pad_vocab_size_to': 1024,
  'train.seq_len': 64,
  'train.micro_batch_size': 2,
}


def measure(cfg, steps: int) -> dict:
  mesh = partitioning.make_mesh(1, 1, 1)
  layout = make_layout(cfg, mesh)
  start = time.perf_counter()
  compiled = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches).compile()
  compile_s = time.perf_counter() - start
  memory = compiled.memory_analysis()
  rng = np.random.default_rng(0)
  shape = (cfg.num_microbatches, cfg.train.micro_batch_size, cfg.train.seq_len + 1)
  batch = jax.device_put(
    rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32), step_lib.batch_sharding(layout)
  )
  state = layout.init(cfg.train.seed)
  gbs = cfg.train.global_batch_size
  times, losses = [], []
  for i in range(WARMUP + steps):
    lr = jnp.float32(schedule.learning_rate(cfg.optimizer, i * gbs))
    start = time.perf_counter()
    state, stats = compiled(state, batch, lr, jnp.int32(i))
    stats = jax.device_get(stats)
    if i >= WARMUP:
      times.append(time.perf_counter() - start)
    losses.append(float(stats['lm_loss']))
  del state
  # The allocator's high-water mark (GPU; None on CPU): the measured peak beside XLA's figure.
  device_stats = jax.devices()[0].memory_stats() or {}
  median = statistics.median(times)
  flops = accounting.megatron_flops_per_iteration(cfg, gbs, cfg.train.seq_len)
  peak, peak_source = accounting.device_peak_tflops('bfloat16')
  return {
    'compile_s': compile_s,
    'xla_peak_bytes': memory.temp_size_in_bytes
    + memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes,
    'measured_peak_bytes': device_stats.get('peak_bytes_in_use'),
    'losses': losses,
    'step_s_median': median,
    'step_s_min': min(times),
    'step_s_max': max(times),
    'tokens_per_s': gbs * cfg.train.seq_len / median,
    'model_tflops': flops / median / 1e12,
    'mfu': flops / median / 1e12 / peak,
    'peak_tflops': peak,
    'peak_source': peak_source,
  }


def describe(impl: str, result: dict) -> str:
  """One line per implementation."""
  gib = 2**30
  line = (
    f'{impl:>7}: {result["step_s_median"] * 1e3:8.1f} ms/step  '
    f'{result["tokens_per_s"]:9.0f} tokens/s  {result["model_tflops"]:6.1f} TFLOP/s  '
    f'MFU {result["mfu"] * 100:5.1f}%  XLA peak {result["xla_peak_bytes"] / gib:5.1f} GiB  '
  )
  if result['measured_peak_bytes']:
    line += f'measured {result["measured_peak_bytes"] / gib:5.1f} GiB  '
  line += (
    f'compile {result["compile_s"]:5.1f} s  loss {result["losses"][0]:.4f} -> '
    f'{result["losses"][-1]:.4f}'
  )
  if 'first_loss_vs_xla' in result:
    line += f'  (first loss vs xla {result["first_loss_vs_xla"]:.1e})'
  return line


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'bloom_1b3.py'))
  parser.add_argument('--attention', default='xla,pallas,cudnn')
  parser.add_argument('--global_batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--smoke', action='store_true', help='a 2-layer model (runs on CPU)')
  parser.add_argument('--json', default='')
  args, rest = parser.parse_known_args()

  overrides = dict(SMOKE) if args.smoke else {}
  overrides.update(parse_overrides(rest))
  overrides.update(
    {
      'mesh.data': 1,
      'mesh.pipeline': 1,
      'mesh.tensor': 1,
      'train.global_batch_size': args.global_batch,
      'train.steps': WARMUP + args.steps,
    }
  )
  base = load_config_file(args.config, overrides)
  device = jax.devices()[0]
  report = {
    'date': datetime.date.today().isoformat(),
    'device': device.device_kind,
    'platform': device.platform,
    'jax': jax.__version__,
    'config': args.config,
    'overrides': overrides,
    'results': {},
  }
  print(
    f'{device.device_kind} ({device.platform}), jax {jax.__version__}; {args.config} '
    f'{base.model.num_params() / 1e9:.2f}B params, {base.model.dtype}, '
    f'remat {base.model.remat_policy}, global batch {args.global_batch} x seq '
    f'{base.train.seq_len}, micro-batch {base.train.micro_batch_size}',
    flush=True,
  )
  failed = False
  for impl in args.attention.split(','):
    cfg = base.replace(model={'attention_impl': impl})
    try:
      cfg = startup.check_config(cfg)
    except ConfigError as error:  # a kernel this platform cannot run is reported as skipped
      report['results'][impl] = {'skipped': str(error)}
      print(f'{impl:>7}: skipped: {error}', flush=True)
      continue
    result = measure(cfg, args.steps)
    reference = report['results'].get('xla', {}).get('losses')
    if reference:
      result['first_loss_vs_xla'] = abs(result['losses'][0] - reference[0]) / abs(reference[0])
      failed |= result['first_loss_vs_xla'] > LOSS_TOLERANCE
    report['results'][impl] = result
    print(describe(impl, result), flush=True)
    jax.clear_caches()
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=1)
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
