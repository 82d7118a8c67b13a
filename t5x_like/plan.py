"""`python -m t5x_like.plan`: compile a config's train step ahead of time and report its cost.

  python -m t5x_like.plan --config configs/bloom_176b.py [--config.key=value ...]
      [--unroll] [--json] [--breakdown]

Nothing is allocated: the step is lowered for abstract (shape-only) state and batch on the
config's mesh (virtual CPU devices when no accelerator is present) and compiled by XLA. The report
gives XLA's FLOPs and memory per device against the ideal: the Megatron model FLOPs split evenly
over the devices, so the pipeline bubble's and recomputation's costs are numbers. XLA's cost
analysis counts a loop body once, not once per trip: pass --unroll for FLOP counts (the rolled
compile is what training runs and what the memory figures describe).

--breakdown prints where the peak memory goes (`memory_breakdown` in --json), read from XLA's
buffer assignment for this compile (t5x_like/memory_report.py): the state by kind, the buffers
live at XLA's peak by what they hold, the heap's packing loss, the largest temporaries, and what
the CPU compile overstates by keeping bf16 values in f32 buffers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from t5x_like import memory_report, schedule, startup
from t5x_like.config import Config, ConfigError, load_config_file, parse_overrides


def plan(cfg: Config) -> dict:
  from t5x_like import metrics, partitioning
  from t5x_like.train_state import make_layout
  from t5x_like.step import lower_train_step
  mesh = partitioning.make_mesh(cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor)
  layout = make_layout(cfg, mesh)
  start = time.perf_counter()
  lowered = lower_train_step(cfg, layout, cfg.num_microbatches)
  compiled, dump = memory_report.compile_with_buffer_dump(lowered)
  compile_s = time.perf_counter() - start
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  memory = compiled.memory_analysis()
  devices = cfg.mesh.num_devices
  model_flops = metrics.megatron_flops_per_iteration(cfg, cfg.train.global_batch_size,
                                                     cfg.train.seq_len)
  xla_flops = float(cost.get('flops', 0.0))
  gib = 1024**3
  report = {
      'mesh': [cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor],
      'pipeline_repeats': cfg.pipeline.repeats,
      'num_microbatches': cfg.num_microbatches,
      'params': cfg.model.num_params(cfg.mesh.tensor),
      'remat_policy': cfg.model.remat_policy,
      'compile_s': round(compile_s, 1),
      # Each (micro-batches, length) of the batch ramp-up and the curriculum is one more
      # compilation of about compile_s (on this platform) during the run.
      'train_programs': len(schedule.step_shapes(cfg)),
      'xla_flops_per_device': xla_flops,
      'ideal_flops_per_device': model_flops / devices,
      'xla_over_ideal': xla_flops / (model_flops / devices) if model_flops else None,
      'argument_gib': memory.argument_size_in_bytes / gib,
      'output_gib': memory.output_size_in_bytes / gib,
      'temp_gib': memory.temp_size_in_bytes / gib,
      'peak_gib': (memory.argument_size_in_bytes + memory.output_size_in_bytes +
                   memory.temp_size_in_bytes - memory.alias_size_in_bytes) / gib,
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
    report['pipeline_bubble'] = layout.plan.bubble_fraction(cfg.num_microbatches,
                                                           cfg.pipeline.microbatch_group)
    report['stage_plan'] = layout.plan.describe()
  with dump:
    report.update(_memory_breakdown(cfg, dump.name, memory, report['peak_gib']))
  return report


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
    found = memory_report.breakdown(dump_dir, memory, stage_input=stage_input,
                                    data=cfg.mesh.data)
  except memory_report.DumpError as e:
    return {'memory_breakdown': {'error': str(e)}}
  overstated = found['cpu_overstatement_bytes'] / gib
  breakdown = {
      'gib': {name: value / gib for name, value in found['bytes'].items()},
      'peak_phase': found['peak_phase'],
      'largest_temporaries': [dict(t, gib=t.pop('bytes') / gib)
                              for t in found['largest_temporaries']],
      'cpu_overstatement_note': memory_report.OVERSTATEMENT_NOTE,
  }
  return {'memory_breakdown': breakdown, 'cpu_overstatement_gib': overstated,
          'gpu_estimate_peak_gib': peak_gib - overstated}


def print_breakdown(report: dict) -> None:
  breakdown = report['memory_breakdown']
  if 'error' in breakdown:
    print(f'memory breakdown unavailable: {breakdown["error"]}')
    return
  print(f'\nWhere the peak goes (GiB per device; XLA\'s peak {report["peak_gib"]:.2f}, in the '
        f'{breakdown["peak_phase"]} pass):')
  for name, value in breakdown['gib'].items():
    print(f'{name:>40}: {value:9.3f}')
  print(f'{"total":>40}: {sum(breakdown["gib"].values()):9.3f}')
  print('\nLargest temporaries:')
  print(f'{"GiB":>9}  {"shape":<32} {"category":<28} {"at peak":<7} op')
  for t in breakdown['largest_temporaries']:
    widened = ' (bf16 held as f32)' if t['widened_from_bf16'] else ''
    print(f'{t["gib"]:9.3f}  {t["shape"]:<32} {t["category"]:<28} '
          f'{"yes" if t["live_at_peak"] else "no":<7} {t["op"][-70:]}{widened}')
  print(f'\nCPU overstatement: {report["cpu_overstatement_gib"]:.3f} GiB; GPU estimate of the '
        f'peak: {report["gpu_estimate_peak_gib"]:.2f} GiB. {breakdown["cpu_overstatement_note"]}')


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m t5x_like.plan', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', required=True)
  parser.add_argument('--json', action='store_true', help='print one JSON object')
  parser.add_argument('--breakdown', action='store_true',
                      help='print where the peak memory goes (always in --json)')
  parser.add_argument('--unroll', action='store_true',
                      help='unroll every scan so XLA counts each FLOP (slower compile)')
  args, rest = parser.parse_known_args(argv)
  try:
    overrides = parse_overrides(rest)
    if args.unroll:
      overrides['model.scan_unroll'] = True
    cfg = startup.check_config(load_config_file(args.config, overrides))
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  report = plan(cfg)
  if args.json:
    print(json.dumps(report))
  else:
    for key, value in report.items():
      if key == 'memory_breakdown':
        continue
      print(f'{key:>24}: {value:.4g}' if isinstance(value, float) else f'{key:>24}: {value}')
    if args.breakdown:
      print_breakdown(report)
  return 0


if __name__ == '__main__':
  sys.exit(main())
