"""`python -m t5x_like.plan`: compile a config's train step ahead of time and report its cost.

  python -m t5x_like.plan --config configs/bloom_176b.py [--config.key=value ...]
  python -m t5x_like.plan --gin_file configs/bloom_176b.gin [--gin_bindings 'key = value' ...]
      [--gpu KIND] [--unroll] [--json] [--breakdown]

Nothing is allocated: the step is lowered for abstract (shape-only) state and batch on the
config's mesh (virtual CPU devices when no accelerator is present) and compiled by XLA. The report
gives XLA's FLOPs and memory per device against the ideal: the Megatron model FLOPs split evenly
over the devices, so the pipeline bubble's and recomputation's costs are numbers. XLA's cost
analysis counts a loop body once, not once per trip: pass --unroll for FLOP counts (the rolled
compile is what training runs and what the memory figures describe).

--gpu KIND compiles for the config's mesh of GPUs of KIND instead, with XLA's GPU compiler and
no GPU (t5x_like/planning/gpu_target.py; jax's CUDA plugin must be installed): the memory figures
are then XLA's own for the GPU, not a CPU compile's, and the report says whether they fit the
memory JAX may use of one (`fits`, `usable_gib`; XLA_PYTHON_CLIENT_MEM_FRACTION, as the cost
model reads it). Meshes of more than 8 GPUs are whole nodes of 8. Without a GPU, XLA gives no
FLOP count (`xla_flops_per_device` is null). With --breakdown it lists XLA's largest buffers
live at the GPU program's peak and what defines each (`live_at_peak` in --json), without the
CPU compile's categories, which are fitted to CPU programs.

--breakdown prints where the peak memory goes (`memory_breakdown` in --json), read from XLA's
buffer assignment for this compile (t5x_like/planning/memory_report.py): the state by kind, the
buffers live at XLA's peak by what they hold, the heap's packing loss, the largest temporaries,
and what the CPU compile overstates by keeping bf16 values in f32 buffers.

Without compiling (t5x_like/planning/cost_model.py, docs/planner.md), in milliseconds:

  python -m t5x_like.plan --config CFG [--config.k=v ...] --estimate --gpu KIND [--json]
  python -m t5x_like.plan --config CFG --search --gpus N --gpu KIND [--nodes-of 8] [--top K]
      [--aot] [--json]

--estimate: the config's step on its mesh of GPUs of KIND (a100-80gb, a100-40gb, h100-80gb,
h200), its ZeRO stage and group (mesh.zero_stage, mesh.zero_group) included: seconds per
iteration, TFLOP/s per GPU (Megatron's formula), memory per GPU and whether it fits (and whether
within the memory model's 5% error of the limit: `near_limit`, where only a compile can say),
and the parts they add up from. --search: every valid (data, pipeline, tensor, micro-batch,
ZeRO stage 1 or 3 over all of data or one node's data ranks) for N GPUs at the config's model
and global batch, those that fit first, each group by estimated time, each with why it does not
fit or what it loses to the first; --aot adds XLA's compiled memory for the top K, each
compiled for the GPUs of --gpu as `plan --gpu` compiles (jax's CUDA plugin needed): XLA's own
peak per GPU and whether it fits, beside the model's estimate. More --gpus than any topology can
use (cost_model.max_gpus) is refused at once, with the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from t5x_like.cli.config_arguments import add_config_arguments, config_from_arguments
from t5x_like.config import Config, ConfigError
from t5x_like.planning import cost_model, gpu_target, memory_report
from t5x_like.training import device_memory, schedule, startup


def plan(cfg: Config, gpu: str | None = None, breakdown: bool = False) -> dict:
  """The compiled step's report: for the config's mesh of this machine's devices, or of abstract
  GPUs of kind `gpu` (gpu_target). A CPU compile's always has the memory breakdown; a GPU
  compile's has XLA's buffers live at its peak with `breakdown`."""
  from t5x_like.mesh import partitioning
  from t5x_like.model import attention
  from t5x_like.optim import adamw as optim
  from t5x_like.parallel.train_state import make_layout
  from t5x_like.training import accounting
  from t5x_like.training.step import lower_train_step

  m = cfg.mesh
  # Before the compile: a bad XLA_PYTHON_CLIENT_MEM_FRACTION or a missing plugin is one error.
  usable = cost_model.gpu_spec(gpu).hbm_gib * cost_model.jax_memory_fraction() if gpu else None
  gpus = gpu_target.devices(gpu, m.num_devices) if gpu else None
  mesh = partitioning.make_mesh(m.data, m.pipeline, m.tensor, gpus, m.zero_group)
  layout = make_layout(cfg, mesh)
  start = time.perf_counter()
  lowered = lower_train_step(cfg, layout, cfg.num_microbatches)
  gpu_options: dict = {}
  if gpu and breakdown:
    (compiled, gpu_options), dump = memory_report.compile_with_buffer_dump(
      lowered, compile=lambda options: gpu_target.compile_without_cache(lowered, gpu, options)
    )
  elif gpu:
    (compiled, gpu_options), dump = gpu_target.compile_without_cache(lowered, gpu), None
  else:
    compiled, dump = memory_report.compile_with_buffer_dump(lowered)
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis()
  # XLA's GPU compiler without a GPU gives no cost analysis (jax 0.10.2): no FLOP count then.
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  memory = compiled.memory_analysis()
  devices = cfg.mesh.num_devices
  model_flops = accounting.megatron_flops_per_iteration(
    cfg, cfg.train.global_batch_size, cfg.train.seq_len
  )
  xla_flops = float(cost['flops']) if 'flops' in cost else None
  gib = 1024**3
  report = {
    'compiled_for': gpu or jax_platform(),
    'mesh': [cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor],
    'zero_stage': cfg.mesh.zero_stage,
    'zero_group': cfg.mesh.zero_group_size,  # data ranks that split one copy of the state
    'pipeline_repeats': cfg.pipeline.repeats,
    'num_microbatches': cfg.num_microbatches,
    'params': cfg.model.num_params(cfg.mesh.tensor),
    # Adam state bytes per param: 8 for 'adamw', about 2 for 'adamw_8bit' (its codes+scales).
    'optimizer_bytes_per_param': round(
      optim.bytes_per_param(
        cfg.optimizer, layout.canonical.params, optim.fp32_state_params(cfg.model)
      ),
      4,
    ),
    'remat_policy': cfg.model.remat_policy,
    # 'auto' resolved for the devices compiled for (AUTO_ORDER of their family).
    'attention_impl': attention.resolved(cfg.model, attention.Device.of(mesh.devices.flat[0])),
    'compile_s': round(compile_s, 1),
    # Each (micro-batches, length) of the batch ramp-up and the curriculum is one more
    # compilation of about compile_s (on this platform) during the run.
    'train_programs': len(schedule.step_shapes(cfg)),
    'xla_flops_per_device': xla_flops,
    'ideal_flops_per_device': model_flops / devices,
    'xla_over_ideal': xla_flops / (model_flops / devices) if model_flops and xla_flops else None,
    'argument_gib': memory.argument_size_in_bytes / gib,
    'output_gib': memory.output_size_in_bytes / gib,
    'temp_gib': memory.temp_size_in_bytes / gib,
    'peak_gib': device_memory.peak_bytes(memory) / gib,
    # ZeRO-1 leaves these params' fp32 copy and Adam moments whole on every `data` rank (only
    # ones with no dim to pad: every dim split by the rules, or smaller than `data`).
    'replicated_over_data': layout.replicated_over_data(),
  }
  if cfg.train.rampup_microbatch_multiple:
    # What the fewer programs cost: the share of the micro-batches the step runs over the run
    # that are padding (computed by a pipeline's stages, skipped without a pipeline).
    padding, runs = schedule.padding_microbatches(cfg)
    report['padding_microbatch_share'] = padding / runs
  if cfg.mesh.pipeline > 1:
    report['pipeline_bubble'] = layout.placement.bubble_fraction(
      cfg.num_microbatches, cfg.pipeline.microbatch_group
    )
    report['layer_placement'] = layout.placement.describe()
  if usable is not None:
    # XLA options the GPU compile needed without a GPU (gpu_target.TRITON_GEMM_OFF), else {}.
    report.update(usable_gib=usable, fits=report['peak_gib'] <= usable, xla_options=gpu_options)
    if dump is not None:
      with dump:
        report['live_at_peak'] = _live_at_peak(dump.name)
    return report
  assert dump is not None
  with dump:
    report.update(_memory_breakdown(cfg, dump.name, memory, report['peak_gib']))
  return report


def jax_platform() -> str:
  import jax

  return jax.devices()[0].platform


def _memory_breakdown(cfg: Config, dump_dir: str, memory, peak_gib: float) -> dict:
  gib = 1024**3
  stage_input = None
  if cfg.mesh.pipeline > 1:
    # A pipeline keeps stage inputs: GPipe one per tick, [ticks, stages on a device, rows, seq,
    # hidden] (the ticks of one group's schedule under pipeline.microbatch_group); 1F1B a ring of
    # 2P - 1 per stage.
    per_schedule = cfg.pipeline.microbatch_group or cfg.num_microbatches
    ticks = per_schedule * cfg.pipeline.repeats + cfg.mesh.pipeline - 1
    if cfg.pipeline.schedule == '1f1b':
      ticks = 2 * cfg.mesh.pipeline - 1
    # model.sequence_parallel splits their sequence over tensor.
    seq = cfg.train.seq_len // (cfg.mesh.tensor if cfg.model.sequence_parallel else 1)
    stage_input = (ticks, cfg.train.micro_batch_size, seq, cfg.model.hidden_size)
  try:
    found = memory_report.breakdown(dump_dir, memory, stage_input=stage_input, data=cfg.mesh.data)
  except memory_report.DumpError as e:
    return {'memory_breakdown': {'error': str(e)}}
  overstated = found['cpu_overstatement_bytes'] / gib
  breakdown = {
    'gib': {name: value / gib for name, value in found['bytes'].items()},
    'peak_phase': found['peak_phase'],
    'largest_temporaries': [
      dict(t, gib=t.pop('bytes') / gib) for t in found['largest_temporaries']
    ],
    'cpu_overstatement_note': memory_report.OVERSTATEMENT_NOTE,
  }
  return {
    'memory_breakdown': breakdown,
    'cpu_overstatement_gib': overstated,
    'gpu_estimate_peak_gib': peak_gib - overstated,
  }


def _live_at_peak(dump_dir: str) -> dict:
  try:
    found = memory_report.live_at_peak(dump_dir)
  except memory_report.DumpError as e:
    return {'error': str(e)}
  gib = 1024**3
  found['live_gib'] = found.pop('live_bytes') / gib
  found['largest'] = [dict(r, gib=r.pop('bytes') / gib) for r in found['largest']]
  return found


def print_live_at_peak(report: dict) -> None:
  found = report['live_at_peak']
  if 'error' in found:
    print(f'buffers at the peak unavailable: {found["error"]}')
    return
  print(
    f"\nXLA's peak ({report['peak_gib']:.2f} GiB per {report['compiled_for']}) is at "
    f'{found["peak_instruction"]} ({found["peak_op"] or "no op name"}); the largest of the '
    f'{found["live_gib"]:.2f} GiB live there:'
  )
  print(f'{"GiB":>9}  {"shape":<34} {"":<8} defined by')
  for r in found['largest']:
    kind = 'argument' if r['argument'] else ''
    print(f'{r["gib"]:9.3f}  {r["shape"]:<34} {kind:<8} {r["defined_by"][-80:]} ({r["values"]})')


def print_breakdown(report: dict) -> None:
  breakdown = report['memory_breakdown']
  if 'error' in breakdown:
    print(f'memory breakdown unavailable: {breakdown["error"]}')
    return
  print(
    f"\nWhere the peak goes (GiB per device; XLA's peak {report['peak_gib']:.2f}, in the "
    f'{breakdown["peak_phase"]} pass):'
  )
  for name, value in breakdown['gib'].items():
    print(f'{name:>40}: {value:9.3f}')
  print(f'{"total":>40}: {sum(breakdown["gib"].values()):9.3f}')
  print('\nLargest temporaries:')
  print(f'{"GiB":>9}  {"shape":<32} {"category":<28} {"at peak":<7} op')
  for t in breakdown['largest_temporaries']:
    widened = ' (bf16 held as f32)' if t['widened_from_bf16'] else ''
    print(
      f'{t["gib"]:9.3f}  {t["shape"]:<32} {t["category"]:<28} '
      f'{"yes" if t["live_at_peak"] else "no":<7} {t["op"][-70:]}{widened}'
    )
  print(
    f'\nCPU overstatement: {report["cpu_overstatement_gib"]:.3f} GiB; GPU estimate of the '
    f'peak: {report["gpu_estimate_peak_gib"]:.2f} GiB. {breakdown["cpu_overstatement_note"]}'
  )


def check_model_arguments(args) -> None:
  """One ConfigError for cost-model flags that do not go together."""
  if not (args.estimate or args.search):
    if args.gpu is not None and args.gpu not in gpu_target.DEVICES:
      raise ConfigError(
        f'--gpu {args.gpu!r}: no such GPU kind to compile for; one of: '
        f'{", ".join(gpu_target.DEVICES)}'
      )
    extra = [
      flag
      for flag, given in (
        ('--gpus', args.gpus),
        ('--aot', args.aot),
        ('--nodes-of', args.nodes_of is not None),
      )
      if given
    ]
    if extra:
      raise ConfigError(
        f'{" and ".join(extra)} only apply to --estimate or --search; add one '
        'of them, or drop the cost-model flags to compile the config (--gpu KIND alone '
        'compiles it for GPUs of KIND)'
      )
    return
  if args.gpu is None:
    raise ConfigError(f'--estimate and --search need --gpu, one of: {", ".join(cost_model.GPUS)}')
  cost_model.gpu_spec(args.gpu, args.nodes_of)
  if args.unroll or args.breakdown:
    raise ConfigError(
      '--unroll and --breakdown describe a compile; --estimate and --search '
      'compile nothing (--search --aot adds the compiled memory)'
    )
  if args.estimate and (args.gpus is not None or args.aot):
    raise ConfigError(
      "--estimate takes the GPUs from the config's mesh (--config.mesh.data=...)"
      '; --gpus and --aot go with --search'
    )
  if args.search and args.gpus is None:
    raise ConfigError('--search needs --gpus N, the GPUs to spread the model over')
  # Before the config loads; the most GPUs the model and batch can use is cost_model.search's.
  if args.search and args.gpus < 1:
    raise ConfigError(f'--gpus must be >= 1, got {args.gpus}')
  if args.top < 1:
    raise ConfigError(f'--top must be >= 1, got {args.top}')


def _number(value) -> str:
  return f'{value:.4g}' if isinstance(value, float) else str(value)


def print_estimate(report: dict, as_json: bool) -> int:
  if as_json:
    print(json.dumps(report))
    return 0
  for key, value in report.items():
    if key == 'memory_gib_by_category':
      print(f'{"memory (GiB per GPU)":>32}:')
      for name, gib in value.items():
        print(f'{name:>40}: {gib:.3f}')
    else:
      print(f'{key:>32}: {_number(value)}')
  return 0


def run_search(cfg: Config, args) -> int:
  """--search: the top K of the ranked topologies (a JSON list under --json), XLA's compiled
  memory added to them under --aot."""
  results = cost_model.search(cfg, args.gpus, args.gpu, args.nodes_of)
  if not results:
    raise ConfigError(
      f'no valid topology for {args.gpus} GPUs at this model and global batch '
      '(tensor must divide the heads and a node, the layers go over the stages '
      'with at most one padding slot, micro-batch x data must divide every '
      'ramp-up batch); change --gpus or the global batch'
    )
  top = results[: args.top]
  if args.aot:
    for r in top:
      data, pipeline, tensor = r['mesh']
      zero_group = 0 if r['zero_group'] == data else r['zero_group']
      candidate = startup.check_config(
        cfg.replace(
          mesh={
            'data': data,
            'pipeline': pipeline,
            'tensor': tensor,
            'zero_stage': r['zero_stage'],
            'zero_group': zero_group,
          },
          train={'micro_batch_size': r['micro_batch_size']},
          pipeline={'grad_sync': r['grad_sync'] or cfg.pipeline.grad_sync},
        ),
        gpu_target.attention_device(args.gpu),
      )
      compiled = plan(candidate, args.gpu)
      r['aot_peak_gib'] = compiled['peak_gib']
      r['aot_fits'] = compiled['fits']
  if args.json:
    print(json.dumps(top))
    return 0
  print(
    f'{len(results)} valid topologies for {args.gpus} x {args.gpu} '
    f'({sum(r["fits"] for r in results)} fit); the top {len(top)}, fitting first, by '
    'estimated time per iteration:'
  )
  aot = '  XLA peak' if args.aot else ''
  # ZeRO: the stage (1, 3) and the data ranks G that split one copy of the state (hybrid
  # sharding when G < DP); sync: when the data ranks sum their gradients (pipeline.grad_sync),
  # '-' with one data rank.
  print(
    f'{"rank":>4} {"DP":>4} {"PP":>3} {"TP":>3} {"ZeRO":>4} {"G":>4} {"MBS":>3} {"sync":>4} '
    f'{"s/it":>7} '
    f'{"TFLOP/s":>7} {"bubble":>6} {"GiB":>6}{aot}  fits; behind rank 1 by'
  )
  for i, r in enumerate(top, 1):
    data, pipeline, tensor = r['mesh']
    aot_peak = f'  {r["aot_peak_gib"]:8.2f}' if args.aot else ''
    verdict = 'yes' if r['fits'] else 'no: ' + r['why_not']
    if r['near_limit']:
      verdict += ', near the limit'
    if r['fits'] and 'why_behind' in r:
      verdict += '; ' + r['why_behind']
    print(
      f'{i:>4} {data:>4} {pipeline:>3} {tensor:>3} {r["zero_stage"]:>4} {r["zero_group"]:>4} '
      f'{r["micro_batch_size"]:>3} {r["grad_sync"] or "-":>4} {r["estimated_step_s"]:7.1f} '
      f'{r["estimated_tflops_per_gpu"]:7.1f} {r["bubble_fraction"]:6.1%} '
      f'{r["estimated_memory_gib"]:6.1f}{aot_peak}  {verdict}'
    )
  if any(r['near_limit'] for r in top):
    print(
      f"near the limit: estimated to fit with less headroom than the memory model's error "
      f'({cost_model.MEMORY_ERROR:.0%}); {"XLA" if args.aot else "--aot"} says whether it does'
    )
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.plan',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_config_arguments(parser)
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument(
    '--breakdown',
    action='store_true',
    help='print where the peak memory goes (always in --json for a CPU compile)',
  )
  parser.add_argument(
    '--unroll',
    action='store_true',
    help='unroll every scan so XLA counts each FLOP (slower compile)',
  )
  model = parser.add_argument_group('cost model (no compilation; docs/planner.md)')
  mode = model.add_mutually_exclusive_group()
  mode.add_argument(
    '--estimate', action='store_true', help="estimate the config's step on its mesh of --gpu GPUs"
  )
  mode.add_argument(
    '--search', action='store_true', help='rank every valid topology for --gpus GPUs of --gpu'
  )
  model.add_argument('--gpu', help='GPU kind: ' + ', '.join(cost_model.GPUS))
  model.add_argument('--gpus', type=int, help='--search: how many GPUs')
  model.add_argument(
    '--nodes-of', type=int, default=None, help="GPUs per node, >= 1 (default: the kind's, 8)"
  )
  model.add_argument('--top', type=int, default=10, help='--search: how many to print')
  model.add_argument(
    '--aot',
    action='store_true',
    help="--search: add XLA's GPU compile's memory for the top K (slow)",
  )
  args, rest = parser.parse_known_args(argv)
  try:
    check_model_arguments(args)
    if args.gpu and not os.environ.get('JAX_PLATFORMS'):
      # The GPUs are described to XLA, and this process runs on the CPU. On a machine with jax's
      # CUDA plugin and no GPU (a login node) the plugin's backend would start first, and where
      # CUDA's libraries are missing its failure left the plugin without GPU topologies.
      import jax

      jax.config.update('jax_platforms', 'cpu')
    cfg = config_from_arguments(args, rest)
    if args.unroll:
      cfg = cfg.replace(model={'scan_unroll': True})
    if args.estimate or args.search:
      # Config and schedule arithmetic only: the mesh is the GPUs', not this machine's.
      cfg.validate()
      schedule.check(cfg)
      if args.estimate:
        return print_estimate(cost_model.estimate(cfg, args.gpu, nodes_of=args.nodes_of), args.json)
      return run_search(cfg, args)
    # The config is checked for the devices it is compiled for: --gpu's, else this machine's.
    cfg = startup.check_config(cfg, gpu_target.attention_device(args.gpu) if args.gpu else None)
    # The layout refuses a mesh the 8-bit moments cannot be split over.
    report = plan(cfg, args.gpu, args.breakdown)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(report))
  else:
    for key, value in report.items():
      if key in ('memory_breakdown', 'live_at_peak'):
        continue
      print(f'{key:>24}: {value:.4g}' if isinstance(value, float) else f'{key:>24}: {value}')
    if args.breakdown:
      (print_live_at_peak if args.gpu else print_breakdown)(report)
  return 0


if __name__ == '__main__':
  sys.exit(main())
