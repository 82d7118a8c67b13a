"""The real train step on one accelerator: tokens/s, model TFLOP/s and MFU per attention kernel.

    python benchmarks/step_throughput.py [--config configs/bloom_1b3.py] [--attention
        xla,pallas,cudnn] [--global_batch 16] [--steps 10] [--warmup 2] [--profile_steps 0]
        [--json OUT] [--config.KEY=VALUE ...]

The config's model, optimizer and precision on a 1 x 1 x 1 mesh (the step that `Trainer` compiles:
`step.lower_train_step`, explicit shardings, donated state). For each attention implementation the
same initial state and the same random batch: correctness first (each implementation's first-step
loss against xla's, relative difference; the script exits 1 above 2e-2, bf16), then `--warmup`
warm-up steps and the median of `--steps` timed steps, each ended by `jax.device_get(stats)` as the
trainer's loop does; XLA's compiled memory figure and, on a GPU, the allocator's measured peak
(`memory_stats()['peak_bytes_in_use']`: run one implementation per process for a per-kernel
figure, as `benchmarks/gpu_suite.py` does). Model FLOPs are Megatron's
(`accounting.megatron_flops_per_iteration`, counting the recomputation that the remat policy does),
MFU is against the device's dense bf16 peak
(`accounting.BF16_PEAK_TFLOPS`). On CPU it runs (`--smoke`: a small model) but its numbers say
nothing about GPUs.

`--profile_steps N` then runs N more steps under `jax.profiler` and splits the device time by
category (matmuls, attention, LayerNorm/GeLU/elementwise, loss, optimizer, copies, collectives;
`benchmarks/profile_trace.py`). An implementation the config does not accept, or one that fails
to compile or run, is reported as failed with its error and the others still run; `--json` is
rewritten after each implementation (and before its profile), so a crash keeps what was measured.
`--keep_profile DIR` keeps each profile's trace and optimized HLO there (to categorise them again
elsewhere: `profile_trace.summarise`). `--attention` takes implementations, each optionally with
a cross-entropy implementation, `IMPL[:LOSS]` (e.g. `pallas:fused`:
model.cross_entropy_impl='fused'); results are keyed by these names. `auto` resolving to an
implementation measured in this run, or named by `--reuse_if_auto_is a,b` (measured by another
run), is reported as that one, not measured again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from t5x_like.config import ConfigError, allowed_values, load_config_file, parse_overrides
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib
from t5x_like.parallel.train_state import make_layout
from t5x_like.training import accounting, device_memory, schedule, startup
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


def measure(
  cfg, steps: int, warmup: int = WARMUP, profile_steps: int = 0, save=None, keep_profile: str = ''
) -> dict:
  """One implementation's step: compile, `warmup` + `steps` steps, then `profile_steps` under the
  profiler. `save(result)` is called with the result before the profile (a crash there keeps it).
  keep_profile: a path prefix for the profile's trace and optimized HLO (profile_trace.py)."""
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
  for i in range(warmup + steps):
    lr = jnp.float32(schedule.learning_rate(cfg.optimizer, i * gbs))
    start = time.perf_counter()
    state, stats = compiled(state, batch, lr, jnp.int32(i))
    stats = jax.device_get(stats)
    if i >= warmup:
      times.append(time.perf_counter() - start)
    losses.append(float(stats['lm_loss']))
  # The allocator's high-water mark (GPU; None on CPU): the measured peak beside XLA's figure.
  device_stats = jax.devices()[0].memory_stats() or {}
  median = statistics.median(times)
  flops = accounting.megatron_flops_per_iteration(cfg, gbs, cfg.train.seq_len)
  peak, peak_source = accounting.device_peak_tflops('bfloat16')
  result = {
    'attention_impl': cfg.model.attention_impl,
    'cross_entropy_impl': cfg.model.cross_entropy_impl,
    'remat_policy': cfg.model.remat_policy,
    'unroll_layers': cfg.model.unroll_layers,
    'compile_s': compile_s,
    'xla_peak_bytes': device_memory.peak_bytes(memory),
    'measured_peak_bytes': device_stats.get('peak_bytes_in_use'),
    'losses': losses,
    'warmup_steps': warmup,
    'timed_steps': steps,
    'step_s_median': median,
    'step_s_min': min(times),
    'step_s_max': max(times),
    'tokens_per_s': gbs * cfg.train.seq_len / median,
    'model_tflops': flops / median / 1e12,
    'mfu': flops / median / 1e12 / peak,
    'peak_tflops': peak,
    'peak_source': peak_source,
  }
  if profile_steps:
    if save is not None:
      save(result)
    import profile_trace  # benchmarks/, beside this script

    def one_step(i: int) -> None:
      nonlocal state
      lr = jnp.float32(schedule.learning_rate(cfg.optimizer, (warmup + steps + i) * gbs))
      state, stats = compiled(state, batch, lr, jnp.int32(warmup + steps + i))
      jax.device_get(stats)

    try:
      with tempfile.TemporaryDirectory(prefix='step_profile_') as log_dir:
        result['profile'] = profile_trace.profile_steps(
          one_step, profile_steps, compiled.as_text(), log_dir, keep_as=keep_profile
        )
    except Exception as e:  # noqa: BLE001 (the step's figures stand without the profile)
      result['profile_failed'] = f'{type(e).__name__}: {e}'[:1000]
  del state
  return result


def resolved_impl(cfg) -> str:
  """The implementation `model.attention_impl` runs on this machine's first device ('auto'
  resolved for its kind and compute capability)."""
  device = attention_lib.Device.of(jax.devices()[0])
  return str(attention_lib.resolve_impl(cfg.model, device, quiet=True))


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


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'bloom_1b3.py'))
  parser.add_argument('--attention', default='xla,pallas,cudnn')
  parser.add_argument('--global_batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--warmup', type=int, default=WARMUP)
  parser.add_argument(
    '--profile_steps', type=int, default=0, help='then N steps under the profiler, by category'
  )
  parser.add_argument(
    '--reuse_if_auto_is',
    default='',
    help="implementations measured elsewhere: 'auto' resolving to one of them is not re-measured",
  )
  parser.add_argument(
    '--keep_profile',
    default='',
    help="keep each profile's trace and optimized HLO in this folder, as "
    'profile_IMPL.trace.json.gz and profile_IMPL.hlo.txt.gz',
  )
  parser.add_argument('--smoke', action='store_true', help='a 2-layer model (runs on CPU)')
  parser.add_argument('--json', default='')
  args, rest = parser.parse_known_args(argv)

  overrides = dict(SMOKE) if args.smoke else {}
  overrides.update(parse_overrides(rest))
  overrides.update(
    {
      'mesh.data': 1,
      'mesh.pipeline': 1,
      'mesh.tensor': 1,
      'train.global_batch_size': args.global_batch,
      'train.steps': args.warmup + args.steps + args.profile_steps,
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

  def save(impl: str | None = None, result: dict | None = None) -> None:
    if impl is not None:
      report['results'][impl] = result
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(report, f, indent=1)

  print(
    f'{device.device_kind} ({device.platform}), jax {jax.__version__}; {args.config} '
    f'{base.model.num_params() / 1e9:.2f}B params, {base.model.dtype}, '
    f'remat {base.model.remat_policy}, loss {base.model.cross_entropy_impl}, global batch '
    f'{args.global_batch} x seq {base.train.seq_len}, micro-batch {base.train.micro_batch_size}',
    flush=True,
  )
  failed = False
  accepted = allowed_values('model.attention_impl') or ()
  reusable = [s for s in args.reuse_if_auto_is.split(',') if s]
  for spec in args.attention.split(','):
    impl, _, loss = spec.partition(':')
    if impl not in accepted:
      # Not (yet) an implementation of this checkout: a failed row, not a crash.
      error = f'model.attention_impl={impl!r} is not accepted here (one of {accepted})'
      save(spec, {'failed': error})
      print(f'{spec:>7}: FAILED: {error}', flush=True)
      failed = True
      continue
    model = {'attention_impl': impl, **({'cross_entropy_impl': loss} if loss else {})}
    try:
      cfg = startup.check_config(base.replace(model=model))
    except ConfigError as error:  # a kernel this platform cannot run is reported as skipped
      save(spec, {'skipped': str(error)})
      print(f'{spec:>7}: skipped: {error}', flush=True)
      continue
    runs = resolved_impl(cfg)
    same = runs if loss == '' else f'{runs}:{loss}'
    if impl == 'auto' and (runs in reusable or 'step_s_median' in report['results'].get(same, {})):
      save(spec, {'resolved_to': runs, 'same_as': same})
      print(f'{spec:>7}: resolves to {runs}, measured as {same}', flush=True)
      continue
    try:
      result = measure(
        cfg,
        args.steps,
        args.warmup,
        args.profile_steps,
        save=lambda r: save(spec, {**r, 'resolved_to': runs}),
        keep_profile=(
          os.path.join(args.keep_profile, f'profile_{spec.replace(":", "-")}')
          if args.keep_profile
          else ''
        ),
      )
    except Exception as e:  # noqa: BLE001 (one implementation's failure; the others still run)
      traceback.print_exc()
      save(spec, {'failed': f'{type(e).__name__}: {e}'[:2000], 'resolved_to': runs})
      print(f'{spec:>7}: FAILED: {type(e).__name__}: {str(e)[:300]}', flush=True)
      failed = True
      jax.clear_caches()
      continue
    result['resolved_to'] = runs
    reference = report['results'].get('xla', {}).get('losses')
    if reference:
      result['first_loss_vs_xla'] = abs(result['losses'][0] - reference[0]) / abs(reference[0])
      failed |= result['first_loss_vs_xla'] > LOSS_TOLERANCE
    save(spec, result)
    print(describe(spec, result), flush=True)
    if 'profile' in result:
      import profile_trace

      print(profile_trace.table(result['profile']), flush=True)
    elif 'profile_failed' in result:
      print(f'{spec:>7}: profile FAILED: {result["profile_failed"][:300]}', flush=True)
    jax.clear_caches()
  save()
  sys.exit(1 if failed else 0)


if __name__ == '__main__':
  main()
