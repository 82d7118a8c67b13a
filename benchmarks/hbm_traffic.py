"""The HBM traffic of a step compiled for a GPU, read from its optimized HLO: no GPU needed.

    python benchmarks/hbm_traffic.py --gpu h100-80gb [--config configs/bloom_1b3.py]
        [--config_mesh] [--config.KEY=VALUE ...] [--save_hlo step.hlo.txt.gz] [--json OUT]
    python benchmarks/hbm_traffic.py --hlo profile_mosaic.hlo.txt.gz [--gpu h100-80gb]

The first form compiles step_throughput.py's step (the config on one device, a global batch of
16: configs/bloom_1b3.py's fused loss with unrolled layers; the GPU suite's reference step with
`--config.model.cross_entropy_impl=chunked --config.model.unroll_layers=False`) for the GPU
without one, as `plan --gpu` does (t5x_like/planning/
gpu_target.py: XLA's GPU compiler on this CPU, jax's CUDA plugin installed). It is the program
the GPU runs, less autotuning's choices: on 2026-11-27 its memory figure for the suite's pallas
step was 46.856 GiB against 46.86 measured on an H100. `--config_mesh` compiles the config's own
step on its own mesh instead (multi-GPU, nodes of 8). The second form reads an HLO the GPU suite
kept.

Every kernel XLA launches (a fusion, a library call, a copy, a Pallas or Mosaic kernel) is taken
once per execution: the ops of a loop body times its known trip count (the micro-batches, the
scanned layers, the loss's vocabulary chunks), of a conditional its costliest branch (a pipeline
tick's head, not its skip). Its HBM traffic is what it reads and writes: its operands and
its output, except that an operand a fusion only slices is read by the slice (a layer's weights
out of the stacked ones), an elementwise (kLoop) fusion reads at most one element of an operand
per element of its output, and an in-place dynamic-update-slice or scatter writes only its
update. Each kernel is categorised as the step profile does (`profile_trace.categorise`), and a
memory-bound kernel's time is its traffic at the GPU's HBM bandwidth: a lower bound that a
kernel reaches within 10-20% when it streams. Matmuls are timed by their FLOPs at the measured
matmul rate (`cost_model`'s `Measured`, else the data-sheet peak); attention kernels (custom
calls) are not timed here (their time is the attention rows of the GPU suite). What it shows is
where the bytes go, per category and per instruction: the part of a step that is not matmul is
mostly traffic.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import gzip
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_trace  # noqa: E402 (benchmarks/, beside this script)

from t5x_like.planning import gpu_target  # noqa: E402
from t5x_like.planning.hlo_text import (  # noqa: E402
  DTYPE_BYTES,
  Instruction,
  Module,
  array_bytes,
  arrays,
  parse_module,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Ops that launch nothing: their buffers are views or bookkeeping.
_NO_KERNEL = {
  'parameter',
  'get-tuple-element',
  'tuple',
  'constant',
  'bitcast',
  'after-all',
  'partition-id',
  'replica-id',
  'opt-barrier',
}
_SLICES = {'dynamic-slice', 'slice', 'gather'}
# Ops that write into their first operand's buffer in place: the operand index of what they
# write (a dynamic-update-slice's update, a scatter's updates).
_IN_PLACE = {'dynamic-update-slice': 1, 'scatter': 2}


def _fusion_traffic(
  module: Module, computation: str, result_type: str, loop: bool
) -> tuple[int, int]:
  """(bytes read, bytes written) of a fused computation: each parameter read whole, or by its slices
  where only slicing ops use it, or not at all where it is only the buffer a dynamic-update-slice or
  scatter writes into (in place; by its slices where they read it too); the result written whole,
  less what those leave untouched. A `loop` fusion (kLoop: no reduction) computes each element of
  its largest output once and, unless it reduces (XLA emits small reductions, such as a split-K
  matmul's partial sums, as loops too), reads at most one element of each parameter for it (an
  elementwise op ahead of a gather or slice reads only what these keep)."""
  body = module.computations[computation]
  loop = loop and not any(i.opcode.startswith('reduce') for i in body)
  outputs = [math.prod(shape) for _, shape in arrays(result_type)]
  users: dict[str, list[Instruction]] = {}
  for instruction in body:
    for operand in instruction.operands:
      users.setdefault(operand, []).append(instruction)
  read = 0
  for instruction in body:
    if instruction.opcode != 'parameter':
      continue
    uses = users.get(instruction.name, [])
    of_it = [u.operands[0] == instruction.name for u in uses]
    if uses and all(o and u.opcode in _SLICES | _IN_PLACE.keys() for u, o in zip(uses, of_it)):
      # Sliced, or the buffer an update writes into, or both (a layer's slice of a stacked
      # accumulator read, added to and written back in place): only the slices are read.
      read += sum(array_bytes(u.type) for u in uses if u.opcode in _SLICES)
    elif loop and outputs:
      (dtype, shape), *_ = arrays(instruction.type) or [('pred', ())]
      read += DTYPE_BYTES[dtype] * min(math.prod(shape), max(outputs))
    else:
      read += array_bytes(instruction.type)
  written = array_bytes(result_type)
  for instruction in body:
    if instruction.opcode in _IN_PLACE:
      update = module.type_of(instruction.operands[_IN_PLACE[instruction.opcode]])
      written -= array_bytes(instruction.type) - array_bytes(update)
  return read, written


def traffic(module: Module, instruction: Instruction) -> tuple[int, int]:
  """(bytes read, bytes written) of one kernel launch."""
  called = instruction.attribute(r'calls=%([\w.\-]+)')
  if instruction.opcode in ('fusion', 'fusion-start') and called:
    result = module.roots[called].type
    return _fusion_traffic(module, called, result, instruction.attribute(r'kind=(\w+)') == 'kLoop')
  operands = [module.type_of(o) for o in instruction.operands]
  if instruction.opcode in _IN_PLACE:
    update = array_bytes(operands[_IN_PLACE[instruction.opcode]])
    return sum(array_bytes(o) for o in operands[1:]), update
  return sum(array_bytes(o) for o in operands), array_bytes(instruction.type)


def dot_flops(module: Module, instruction: Instruction) -> float:
  """FLOPs of the dots a kernel runs (a gemm fusion's or a library call's): 2 x output elements x
  the contracted size."""
  dots = [instruction] if instruction.opcode == 'dot' else []
  called = instruction.attribute(r'calls=%([\w.\-]+)')
  if called:
    dots = [i for i in module.computations[called] if i.opcode == 'dot']
  flops = 0.0
  for dot in dots:
    dims = arrays(module.type_of(dot.operands[0]))[0][1]
    contracting = dot.attribute(r'lhs_contracting_dims=\{([\d,]*)\}')
    size = math.prod(dims[int(c)] for c in contracting.split(',') if c)
    flops += 2.0 * math.prod(arrays(dot.type)[0][1]) * size
  if not dots and instruction.opcode == 'custom-call' and 'gemm' in instruction.text:
    # cuBLAS: the output times the contracted size of its first operand.
    dims = arrays(module.type_of(instruction.operands[0]))[0][1]
    contracting = instruction.attribute(r'"lhs_contracting_dimensions":\["(\d+)"')
    flops = 2.0 * math.prod(arrays(instruction.type)[0][1]) * dims[int(contracting or 0)]
  return flops


@dataclasses.dataclass
class Launch:
  instruction: Instruction
  count: int  # executions per step
  read: int  # bytes per execution
  written: int
  flops: float


def launches_nothing(opcode: str) -> bool:
  # An asynchronous op's work is its start's ('fusion-start', 'all-gather-start', ...).
  return opcode in _NO_KERNEL or opcode.endswith(('-done', '-update'))


def launches(module: Module) -> list[Launch]:
  """Every kernel of one step, with its executions per step."""
  found: list[Launch] = []

  def visit(computation: str, count: int) -> None:
    for instruction in module.computations[computation]:
      if instruction.opcode == 'while':
        trips = instruction.attribute(r'"known_trip_count":\{"n":"(\d+)"')
        body = instruction.attribute(r'body=%([\w.\-]+)')
        visit(body, count * int(trips or 1))
      elif instruction.opcode == 'conditional':
        branches = re.findall(
          r'%([\w.\-]+)',
          instruction.attribute(r'branch_computations=\{([^}]*)\}')
          or ' '.join(re.findall(r'(?:true|false)_computation=(%[\w.\-]+)', instruction.text)),
        )
        best: list[Launch] = []
        for branch in branches:
          before = len(found)
          visit(branch, count)
          taken = found[before:]
          del found[before:]
          if sum((x.read + x.written) * x.count for x in taken) >= sum(
            (x.read + x.written) * x.count for x in best
          ):
            best = taken
        found.extend(best)
      elif instruction.opcode in ('call', 'async-start'):
        visit(instruction.attribute(r'(?:to_apply|calls)=%([\w.\-]+)'), count)
      elif not launches_nothing(instruction.opcode):
        read, written = traffic(module, instruction)
        found.append(Launch(instruction, count, read, written, dot_flops(module, instruction)))

  visit(module.entry, 1)
  return found


def summarise(hlo_text: str, hbm_gb_s: float, matmul_tflops: float, top: int = 12) -> dict:
  """Per category (profile_trace.CATEGORIES), for one step: kernel launches, GB read and written,
  and the time estimates, matmul (their TFLOP at `matmul_tflops`) and memory-bound (the GB of the
  kernels that are neither matmuls nor custom calls, at `hbm_gb_s`); the memory-bound
  instructions moving the most bytes."""
  module = parse_module(hlo_text)
  _, ops = profile_trace.parse_hlo(hlo_text)
  fields = ('launches', 'gb', 'tflop', 'matmul_ms', 'memory_gb', 'memory_ms')
  rows = {c: dict.fromkeys(fields, 0.0) for c in profile_trace.CATEGORIES}
  heaviest = []
  for launch in launches(module):
    name = launch.instruction.name
    category, _ = profile_trace.categorise(name, {'hlo_op': name}, ops.get(name))
    gb = (launch.read + launch.written) * launch.count / 1e9
    row = rows[category]
    row['launches'] += launch.count
    row['gb'] += gb
    if launch.flops:
      row['tflop'] += launch.flops * launch.count / 1e12
      row['matmul_ms'] += launch.flops * launch.count / (matmul_tflops * 1e12) * 1e3
    elif launch.instruction.opcode != 'custom-call':
      row['memory_gb'] += gb
      row['memory_ms'] += gb / hbm_gb_s * 1e3
      heaviest.append(
        {
          'name': name,
          'category': category,
          'count': launch.count,
          'gb': gb,
          'type': launch.instruction.type[:60],
          'op_name': ops[name].op_name if name in ops else '',
        }
      )
  heaviest.sort(key=lambda h: -h['gb'])
  return {
    'module': module.entry,
    'hbm_gb_s': hbm_gb_s,
    'matmul_tflops': matmul_tflops,
    'categories': rows,
    'matmul_ms': sum(r['matmul_ms'] for r in rows.values()),
    'memory_gb': sum(r['memory_gb'] for r in rows.values()),
    'memory_ms': sum(r['memory_ms'] for r in rows.values()),
    'heaviest': heaviest[:top],
  }


def table(summary: dict) -> str:
  lines = [
    f'{"category":<24} {"launches":>9} {"GB":>8} {"TFLOP":>7} {"matmul ms":>10} '
    f'{"memory GB":>10} {"memory ms":>10}'
  ]
  for category, row in summary['categories'].items():
    lines.append(
      f'{category:<24} {row["launches"]:9.0f} {row["gb"]:8.1f} {row["tflop"]:7.1f} '
      f'{row["matmul_ms"]:10.1f} {row["memory_gb"]:10.1f} {row["memory_ms"]:10.1f}'
    )
  lines.append(
    f'{"step":<24} {"":>9} {"":>8} {"":>7} {summary["matmul_ms"]:10.1f} '
    f'{summary["memory_gb"]:10.1f} {summary["memory_ms"]:10.1f}'
  )
  lines.append(
    f'(matmuls at {summary["matmul_tflops"]:.0f} TFLOP/s, memory-bound kernels at '
    f'{summary["hbm_gb_s"]:.0f} GB/s; custom calls such as the attention kernels not timed)'
  )
  lines.append('the memory-bound kernels moving the most (GB per step, executions, op name):')
  for h in summary['heaviest']:
    lines.append(f'  {h["gb"]:7.1f} x{h["count"]:<4d} {h["category"]:<22} {h["op_name"][-90:]}')
  return '\n'.join(lines)


def compile_for(
  gpu: str, config: str, overrides: dict, config_mesh: bool = False
) -> tuple[str, float]:
  """(optimized HLO text, XLA's peak bytes per device) of the suite's step (one device, global
  batch 16), or with `config_mesh` of the config's own step on its mesh, compiled for `gpu` on
  this machine."""
  from t5x_like.config import load_config_file
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout
  from t5x_like.training import device_memory
  from t5x_like.training import step as step_lib

  settings = dict(overrides)
  if not config_mesh:
    settings = {
      'mesh.data': 1,
      'mesh.pipeline': 1,
      'mesh.tensor': 1,
      'train.global_batch_size': 16,
      **overrides,
    }
  cfg = load_config_file(config, settings)
  m = cfg.mesh
  devices = gpu_target.devices(gpu, m.num_devices)
  mesh = partitioning.make_mesh(m.data, m.pipeline, m.tensor, devices, m.zero_group)
  layout = make_layout(cfg, mesh)
  lowered = step_lib.lower_train_step(cfg, layout, cfg.num_microbatches)
  compiled, _ = gpu_target.compile_without_cache(lowered, gpu)
  return compiled.as_text(), device_memory.peak_bytes(compiled.memory_analysis())


def read_text(path: str) -> str:
  opener = gzip.open if path.endswith('.gz') else open
  with opener(path, 'rt') as f:
    return f.read()


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--hlo', default='', help='an optimized HLO text (.gz or plain)')
  parser.add_argument('--gpu', default='h100-80gb', choices=sorted(gpu_target.DEVICES))
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'bloom_1b3.py'))
  parser.add_argument('--save_hlo', default='', help='keep the compiled HLO here (.gz)')
  parser.add_argument(
    '--config_mesh',
    action='store_true',
    help="the config's own step on its own mesh (8 GPUs a node), not the suite's one device",
  )
  parser.add_argument('--top', type=int, default=12)
  parser.add_argument('--json', default='')
  args, rest = parser.parse_known_args(argv)
  from t5x_like.planning import cost_model

  spec = cost_model.GPUS[args.gpu]
  matmul = spec.measured.matmul_tflops if spec.measured else spec.peak_bf16_tflops
  report: dict = {'gpu': args.gpu}
  if args.hlo:
    if rest:
      parser.error(f'config overrides need a compile, not --hlo: {rest}')
    text = read_text(args.hlo)
  else:
    overrides = {}
    for item in rest:
      key, _, value = item.removeprefix('--config.').partition('=')
      if not item.startswith('--config.') or not value:
        parser.error(f'expected --config.KEY=VALUE, got {item!r}')
      try:
        overrides[key] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        overrides[key] = value
    from t5x_like.config import ConfigError

    try:
      text, peak = compile_for(args.gpu, args.config, overrides, args.config_mesh)
    except ConfigError as e:
      raise SystemExit(f'error: {e}') from None
    report.update(config=args.config, overrides=overrides, xla_peak_gib=peak / 2**30)
    print(f'compiled for {args.gpu}: XLA peak {peak / 2**30:.3f} GiB per device')
    if args.save_hlo:
      with gzip.open(args.save_hlo, 'wt') as f:
        f.write(text)
  summary = summarise(text, spec.hbm_gb_s, matmul, args.top)
  print(table(summary))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({**report, **summary}, f, indent=1)


if __name__ == '__main__':
  main()
