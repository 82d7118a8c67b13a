"""Where a compiled step's device time goes: a `jax.profiler` trace summed by category.

    summary = profile_steps(run_one_step, steps=2, hlo_text=compiled.as_text(), log_dir=DIR)

`profile_steps` runs the step a few times under `jax.profiler.start_trace`, reads the trace that
`stop_trace` writes (`plugins/profile/*/*.trace.json.gz`: plain JSON, Chrome trace format; where
a jax writes none, the `*.xplane.pb` beside it through `jax.profiler.ProfileData`) and
sums the time of the step module's device operations into CATEGORIES, per step and as a share of
the step's wall time. Which events are the device's:

* GPU: the events of the device's process ('/device:GPU:0': one thread per CUDA stream; XLA's
  CUPTI collector names each kernel event by the kernel and gives it the XLA annotation's
  `hlo_op` and `hlo_module` as arguments, xla/backends/profiler/gpu/cupti_collector.cc), the
  'CUPTI overhead' line left out;
* CPU (no device process): the host threads' events that carry an `hlo_op` argument (XLA:CPU's
  thunk executor records one per thunk), less the control flow (`while`, `conditional`, `call`),
  whose events enclose their bodies' ops.

Each event is matched by `hlo_op` to its instruction in the optimized HLO (`compiled.as_text()`,
the same program), or, where `hlo_op` names a command buffer (XLA:GPU runs most of a step as CUDA
graphs), by its kernel's name, the instruction's with '.' and '-' made '_' (`kernel_names`): its
opcode, custom-call target, fused body and metadata. cuBLAS's and custom kernels' names name no
instruction; their names decide. A category is then,
in this order:

1. `collective`: an all-reduce/all-gather/reduce-scatter/all-to-all/collective-permute (or its
   NCCL kernel);
2. the op's REGION, from the Python source of its metadata (the innermost frame of the
   instruction's `stack_frame_id` in the module's StackFrames table: kernels/reference.py,
   kernels/flash_attention.py, t5x_like/model/attention.py, tokamax's or jax's attention are
   `attention`; kernels/cross_entropy.py and t5x_like/model/losses.py are `loss`; optax and
   t5x_like/optim and the step's apply_update are `optimizer`; transformer.py's layer_norm is
   LayerNorm), or else from its
   `op_name` (the Flax module path: '.../layers/attn/...' without the QKV and output projections'
   einsums; the loss function's differentiation segment 'jvp()'; outside the differentiated
   function and the micro-batch loop: the optimizer); fused-attention kernels are also
   recognised by their names (our Triton kernels' 'flash_attention_*', cuDNN's fmha/sdpa/flash,
   Mosaic GPU custom calls);
3. `attention` and `loss` take their region's matmuls too (the attention's QK^T and PV, the
   loss's logits); then `matmul` (a dot or convolution, a fusion or custom call holding one:
   cuBLAS/cuBLASLt, Triton GEMM fusions, or kernels named gemm/cutlass/nvjet/xmma), then
   `copy/transpose` (copies, transposes, slices, concatenations, memcpy and memset kernels,
   fusions of data movement only), then `optimizer`, then `norm/gelu/elementwise` (every other
   fusion or elementwise op), and `other` (what is left: control flow, sorts, unmatched events).

`summarise` reports each category's ms per step and % of the step's wall time, the device's idle
share (the wall time not covered by any of these events), and how many events each rule
recognised (source frames, op names, kernel names, nothing), so a reader can judge the split.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable

from t5x_like.planning import hlo_text

CATEGORIES = (
  'matmul',
  'attention',
  'norm/gelu/elementwise',
  'loss',
  'optimizer',
  'copy/transpose',
  'collective',
  'other',
)
IDLE = 'device idle'

_COLLECTIVES = {
  'all-reduce',
  'all-gather',
  'reduce-scatter',
  'all-to-all',
  'collective-permute',
  'collective-broadcast',
  'ragged-all-to-all',
}
_CONTROL_FLOW = {'while', 'conditional', 'call', 'async-start', 'async-done', 'async-update'}
_MOVES = {
  'copy',
  'copy-start',
  'copy-done',
  'transpose',
  'bitcast',
  'reshape',
  'broadcast',
  'slice',
  'dynamic-slice',
  'dynamic-update-slice',
  'concatenate',
  'pad',
  'reverse',
  'gather',
  'scatter',
  'iota',
  'tuple',
  'get-tuple-element',
  'parameter',
  'constant',
  'bitcast-convert',
}
# A fusion rooted in one of these moves data (XLA names its kernel after it: copy_fusion,
# transpose_fusion, dynamic_update_slice_fusion, ...), whatever index arithmetic or casts it holds.
_MOVE_ROOTS = {
  'copy',
  'transpose',
  'dynamic-update-slice',
  'dynamic-slice',
  'slice',
  'concatenate',
  'pad',
  'gather',
}
_MATMUL_OPCODES = {'dot', 'convolution', 'ragged-dot', 'scaled-dot'}
_MATMUL_NAME = re.compile(r'gemm|cutlass|nvjet|xmma|cublas|wgmma|matmul|ampere_|hopper_', re.I)
_COLLECTIVE_NAME = re.compile(r'nccl|all[-_]?reduce|all[-_]?gather|reduce[-_]?scatter', re.I)
_ATTENTION_NAME = re.compile(r'flash|fmha|sdpa|attention|mosaic', re.I)
_COPY_NAME = re.compile(r'^(memcpy|memset)|copy|transpose', re.I)
# Source files (the innermost frame of an op's stack) and the region they mean.
_SOURCE_REGIONS = (
  (re.compile(r'kernels/(reference|flash_attention)\.py$'), 'attention'),
  (re.compile(r't5x_like/model/attention\.py$'), 'attention'),
  (re.compile(r'tokamax/.*attention'), 'attention'),
  (re.compile(r'jax/_src/cudnn/fused_attention'), 'attention'),
  (re.compile(r'kernels/cross_entropy\.py$|t5x_like/model/losses\.py$'), 'loss'),
  (re.compile(r'optax/|t5x_like/optim/'), 'optimizer'),
)
_NORM_FUNCTIONS = re.compile(r'layer_norm|LayerNorm')
# The einsums of the attention's QKV and output projections (transformer.py's attention_qkv and
# attention_output): matmuls of the attn module that are not the attention itself.
_EINSUM = re.compile(r'^[a-z]+,[a-z]+->[a-z]+$')


@dataclasses.dataclass
class Op:
  """One instruction of the optimized HLO, as far as categorising its device time needs."""

  name: str
  opcode: str
  op_name: str = ''
  source: tuple[str, str] | None = None  # (file, function) of the innermost Python frame
  custom_call_target: str = ''
  backend_kind: str = ''  # a fusion's backend_config kind, e.g. '__triton_gemm', '__cudnn$fusion'
  inner_opcodes: frozenset = frozenset()
  root_opcode: str = ''  # a fusion's root: what XLA names its kernel after
  called: tuple[str, ...] = ()


def parse_hlo(text: str) -> tuple[str, dict[str, Op]]:
  """(module name, instruction name -> Op) of an optimized HLO module's text."""
  module = hlo_text.parse_module(text)
  ops: dict[str, Op] = {}
  for computation in module.computations.values():
    for instruction in computation:
      ops[instruction.name] = Op(
        name=instruction.name,
        opcode=instruction.opcode,
        op_name=instruction.op_name,
        source=module.source_of(instruction),
        custom_call_target=instruction.attribute(r'custom_call_target="([^"]*)"'),
        backend_kind=instruction.attribute(r'"kind":"([^"]*)"'),
        called=instruction.called,
      )
  for op in ops.values():
    inner = {i.opcode for c in op.called for i in module.computations.get(c, [])}
    op.inner_opcodes = frozenset(inner)
    # 'fusion-start': an asynchronous fusion (XLA:GPU runs some slices of loop carries so).
    if op.opcode in ('fusion', 'fusion-start') and op.called and op.called[0] in module.roots:
      op.root_opcode = module.roots[op.called[0]].opcode
  for op in ops.values():
    # A fusion without metadata of its own (XLA:CPU's often): its body's, the root's first.
    if op.op_name or op.source is not None or op.opcode in _CONTROL_FLOW:
      continue
    for c in op.called:
      body = module.computations.get(c, [])
      root = module.roots.get(c)
      ordered = ([root] if root is not None else []) + [i for i in body if i is not root]
      donor = next(
        (ops[i.name] for i in ordered if ops[i.name].op_name or ops[i.name].source), None
      )
      if donor is not None:
        op.op_name, op.source = donor.op_name, donor.source
        break
  return module.name, ops


def kernel_names(ops: dict[str, Op]) -> dict[str, Op]:
  """Instruction by the name XLA:GPU gives its kernel: the instruction's name with every
  character but letters, digits and '_' replaced by '_' ('loop_add_fusion.1' runs as
  'loop_add_fusion_1'). Inside a command buffer (CUDA graphs) every kernel's `hlo_op` names the
  buffer ('command_buffer_91'), not an instruction: the kernel's name is what is left to go by.
  Names that two instructions share after the replacement are left out."""
  found: dict[str, Op] = {}
  shared: set[str] = set()
  for name, op in ops.items():
    kernel = re.sub(r'[^A-Za-z0-9_]', '_', name)
    if kernel in found:
      shared.add(kernel)
    found[kernel] = op
  return {k: op for k, op in found.items() if k not in shared}


def _innermost_jvp(op_name: str) -> str | None:
  """The name inside the innermost 'jvp(...)' segment of an op name ('' for 'jvp()'), None when
  the op is outside any differentiated function."""
  found = None
  for segment in op_name.split('/'):
    m = re.search(r'jvp\(([^()]*)\)', segment)
    if m:
      found = m.group(1)
  return found


def region_of(op: Op | None, kernel: str, args: dict) -> tuple[str | None, str]:
  """(region: 'attention', 'loss', 'optimizer', 'norm' or None, how it was recognised)."""
  if op is not None and op.source is not None:
    # The Python source decides, when the HLO text has it.
    file, function = op.source
    for pattern, region in _SOURCE_REGIONS:
      if pattern.search(file):
        return region, 'source'
    if file.endswith('transformer.py') and _NORM_FUNCTIONS.search(function):
      return 'norm', 'source'
    if file.endswith('training/step.py') and 'apply_update' in function:
      return 'optimizer', 'source'  # the step's update: clipping, Adam, weight decay
    if _ATTENTION_NAME.search(f'{kernel} {op.custom_call_target}'):
      return 'attention', 'kernel name'
    return None, 'source'
  op_name = (op.op_name if op is not None else '') or str(
    args.get('op_name') or args.get('name') or ''
  )
  targets = f'{kernel} {op.custom_call_target if op else ""}'
  if _ATTENTION_NAME.search(targets):
    return 'attention', 'kernel name'
  if op_name:
    segments = op_name.split('/')
    if 'attn' in segments or 'attention' in op_name:
      einsums = [s for s in segments if _EINSUM.match(s)]
      # The projections' einsums (attention_qkv, attention_output) have no q-by-k product.
      if not einsums or any('q' in e and 'k' in e for e in einsums):
        return 'attention', 'op name'
      return None, 'op name'
    if 'cross_entropy' in op_name:
      return 'loss', 'op name'
    jvp = _innermost_jvp(op_name)
    # The loss function's own ops; not a layer's inside the in-place loop's differentiated
    # forward (training/step.py's add_microbatch_grads: 'jvp()/.../layers/mlp/...').
    if (
      jvp is not None
      and jvp in ('', '<lambda>', 'loss_fn', 'mean_loss')
      and 'layers' not in segments
    ):
      return 'loss', 'op name'
    if any(
      s in ('ln1', 'ln2', 'final_ln', 'embed_ln') or s.startswith('LayerNorm') for s in segments
    ):
      return 'norm', 'op name'
    # The update, outside the differentiated function and the micro-batch loop. (XLA gives the
    # ops it makes up a bare op name, e.g. 'reduce_sum': nothing to go by.)
    if op_name.startswith('jit(') and jvp is None and '/while/' not in op_name:
      return 'optimizer', 'op name'
    return None, 'op name'
  return None, 'nothing'


def kind_of(op: Op | None, kernel: str) -> str:
  """'collective', 'matmul', 'copy', 'control', 'elementwise' or 'unknown'."""
  if op is not None:
    if op.opcode in _CONTROL_FLOW:  # its body's ops are events of their own
      return 'control'
    opcodes = {op.opcode.removesuffix('-start').removesuffix('-done')} | {
      o.removesuffix('-start').removesuffix('-done') for o in op.inner_opcodes
    }
    if opcodes & _COLLECTIVES:
      return 'collective'
    if (
      opcodes & _MATMUL_OPCODES
      or _MATMUL_NAME.search(op.custom_call_target)
      or re.search(r'gemm|cublas|cudnn\$fusion', op.backend_kind)
    ):
      return 'matmul'
    if op.opcode in _MOVES or (
      op.opcode in ('fusion', 'fusion-start')
      and (op.inner_opcodes <= _MOVES | {'convert'} or op.root_opcode in _MOVE_ROOTS)
    ):
      return 'copy'
    if op.opcode == 'custom-call':
      return 'unknown'
    return 'elementwise'
  if _COLLECTIVE_NAME.search(kernel):
    return 'collective'
  if _MATMUL_NAME.search(kernel):
    return 'matmul'
  if _COPY_NAME.search(kernel):
    return 'copy'
  if 'fusion' in kernel or kernel.startswith(('loop_', 'input_', 'wrapped_')):
    return 'elementwise'
  return 'unknown'


def categorise(kernel: str, args: dict, op: Op | None) -> tuple[str, str]:
  """(category, how the region was recognised) of one device event: `kernel` its name, `args`
  its trace arguments, `op` its HLO instruction (None when unknown)."""
  kind = kind_of(op, kernel)
  if kind == 'collective':
    return 'collective', 'opcode' if op else 'kernel name'
  region, how = region_of(op, kernel, args)
  if region in ('attention', 'loss'):
    return region, how
  if kind == 'matmul':
    return 'matmul', how
  if kind == 'copy':
    return 'copy/transpose', how
  if region == 'optimizer':
    return 'optimizer', how
  if region == 'norm' or kind == 'elementwise':
    return 'norm/gelu/elementwise', how
  return 'other', how


@dataclasses.dataclass
class Event:
  name: str
  ts: float  # microseconds
  dur: float
  track: tuple
  args: dict


def find_trace(log_dir: str) -> str:
  """The newest `*.trace.json.gz` that `jax.profiler.stop_trace` wrote under `log_dir`, else its
  `*.xplane.pb` (read by `trace_from_xspace`)."""
  for pattern in ('*.trace.json.gz', '*.xplane.pb'):
    found = glob.glob(os.path.join(log_dir, 'plugins', 'profile', '*', pattern))
    if found:
      return max(found, key=os.path.getmtime)
  raise FileNotFoundError(f'no plugins/profile/*/*.trace.json.gz or *.xplane.pb under {log_dir}')


def load_trace(path: str) -> dict:
  if path.endswith('.xplane.pb'):
    return trace_from_xspace(path)
  with gzip.open(path, 'rt') as f:
    return json.load(f)


def trace_from_xspace(path: str) -> dict:
  """The profiler's XSpace (`*.xplane.pb`, read by jax's own `jax.profiler.ProfileData`) as the
  trace JSON's events: a process per plane, a thread per line, the events' stats as args."""
  from jax.profiler import ProfileData

  events: list[dict] = []
  for pid, plane in enumerate(ProfileData.from_file(path).planes):
    events.append({'ph': 'M', 'pid': pid, 'name': 'process_name', 'args': {'name': plane.name}})
    for tid, line in enumerate(plane.lines):
      events.append(
        {'ph': 'M', 'pid': pid, 'tid': tid, 'name': 'thread_name', 'args': {'name': line.name}}
      )
      for event in line.events:
        events.append(
          {
            'ph': 'X',
            'pid': pid,
            'tid': tid,
            'ts': event.start_ns / 1e3,
            'dur': event.duration_ns / 1e3,
            'name': event.name,
            'args': {str(k): v for k, v in event.stats},
          }
        )
  return {'traceEvents': events}


def device_events(trace: dict, module: str = '') -> tuple[list[Event], str]:
  """The device operations of `module` (all modules if ''), and where they were found: 'device'
  (a GPU's stream tracks) or 'host' (CPU: host threads' events that name an hlo_op)."""
  events = trace.get('traceEvents', [])
  processes, threads = {}, {}
  for e in events:
    if e.get('ph') == 'M' and e.get('name') == 'process_name':
      processes[e.get('pid')] = str(e.get('args', {}).get('name', ''))
    elif e.get('ph') == 'M' and e.get('name') == 'thread_name':
      threads[(e.get('pid'), e.get('tid'))] = str(e.get('args', {}).get('name', ''))
  devices = {
    pid for pid, name in processes.items() if name.startswith('/device:') and 'CPU' not in name
  }
  found = []
  for e in events:
    if e.get('ph') != 'X' or 'dur' not in e:
      continue
    args = e.get('args') or {}
    track = (e.get('pid'), e.get('tid'))
    if devices:
      if e.get('pid') not in devices or 'overhead' in threads.get(track, '').lower():
        continue
    elif 'hlo_op' not in args:
      continue
    found.append(Event(str(e.get('name', '')), float(e['ts']), float(e['dur']), track, args))
  if module:
    mine = [e for e in found if e.args.get('hlo_module') == module]
    if mine:
      # Events without a module (memcpy, memset) count while the module runs.
      start = min(e.ts for e in mine)
      end = max(e.ts + e.dur for e in mine)
      found = mine + [
        e for e in found if 'hlo_module' not in e.args and start <= e.ts and e.ts + e.dur <= end
      ]
  return found, 'device' if devices else 'host'


def _busy_us(events: Iterable[Event]) -> float:
  """Microseconds covered by at least one event (the union of their intervals)."""
  busy, end = 0.0, float('-inf')
  for e in sorted(events, key=lambda e: e.ts):
    start, stop = max(e.ts, end), e.ts + e.dur
    if stop > start:
      busy += stop - start
    end = max(end, stop)
  return busy


def summarise(trace: dict, hlo_text: str, steps: int, step_s: float | None) -> dict:
  """Device time per category of the `steps` steps in `trace` (ms per step, % of `step_s`, the
  step's wall time; the traced span per step if None)."""
  module, ops = parse_hlo(hlo_text)
  events, where = device_events(trace, module)
  events = [
    e
    for e in events
    if not (
      (ops.get(str(e.args.get('hlo_op'))) or Op('', '')).opcode in _CONTROL_FLOW
      or (where == 'host' and str(e.args.get('hlo_op', '')).startswith(('while', 'conditional')))
    )
  ]
  if not events:
    raise ValueError(
      f'the trace has no device events of module {module!r} ({where} events looked at)'
    )
  totals = dict.fromkeys(CATEGORIES, 0.0)
  how_counts: dict[str, int] = {}
  top: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
  unmatched: dict[str, dict] = {}  # kernel name -> an example of its event's arguments
  bare: dict[str, str] = {}  # instructions matched but without a source or an op name
  matched = 0
  by_kernel = kernel_names(ops)
  for e in events:
    op = ops.get(str(e.args.get('hlo_op', ''))) or by_kernel.get(e.name)
    matched += op is not None
    if op is None and len(unmatched) < 8:
      unmatched.setdefault(e.name, {k: str(v)[:120] for k, v in e.args.items()})
    category, how = categorise(e.name, e.args, op)
    if how == 'nothing' and op is not None and len(bare) < 8:
      bare.setdefault(op.name, op.opcode)
    totals[category] += e.dur
    how_counts[how] = how_counts.get(how, 0) + 1
    label = op.name if op is not None else e.name
    top[category][label] = top[category].get(label, 0.0) + e.dur
  span_us = max(e.ts + e.dur for e in events) - min(e.ts for e in events)
  wall_ms = step_s * 1e3 if step_s else span_us / 1e3 / steps
  busy_ms = _busy_us(events) / 1e3 / steps
  rows = {c: totals[c] / 1e3 / steps for c in CATEGORIES}
  return {
    'module': module,
    'events_from': where,
    'events': len(events),
    'steps': steps,
    'step_ms': wall_ms,
    'busy_ms': busy_ms,
    'ms_per_step': {**rows, IDLE: max(0.0, wall_ms - busy_ms)},
    'pct_of_step': {
      **{c: 100 * v / wall_ms for c, v in rows.items()},
      IDLE: 100 * max(0.0, wall_ms - busy_ms) / wall_ms,
    },
    'recognised_by': how_counts,
    # How many events name an instruction of the module (`hlo_op`); a few that do not, with
    # their arguments; a few instructions matched that carry neither a source nor an op name.
    'matched_events': matched,
    'unmatched_examples': unmatched,
    'bare_examples': bare,
    'top_ops': {
      c: [
        [name, us / 1e3 / steps] for name, us in sorted(top[c].items(), key=lambda kv: -kv[1])[:3]
      ]
      for c in CATEGORIES
      if top[c]
    },
  }


def profile_steps(
  run_step: Callable[[int], None],
  steps: int,
  hlo_text: str,
  log_dir: str,
  keep_as: str = '',
) -> dict:
  """Runs `run_step(i)` (which must block until the step is done) `steps` times under the
  profiler and summarises the trace. `keep_as`: a path prefix under which the trace
  (`PREFIX.trace.json.gz`, or `.xplane.pb`) and the optimized HLO (`PREFIX.hlo.txt.gz`) are kept,
  to categorise them again elsewhere."""
  import jax

  options = None
  try:  # the Python tracer's events are not needed, and slow the trace down
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
  except Exception:  # noqa: BLE001 (an older or newer ProfileOptions: its defaults then)
    options = None
  jax.profiler.start_trace(log_dir, profiler_options=options)
  try:
    start = time.perf_counter()
    for i in range(steps):
      run_step(i)
    wall = time.perf_counter() - start
  finally:
    jax.profiler.stop_trace()
  trace_path = find_trace(log_dir)
  if keep_as:
    suffix = '.xplane.pb' if trace_path.endswith('.xplane.pb') else '.trace.json.gz'
    shutil.copyfile(trace_path, keep_as + suffix)
    with gzip.open(keep_as + '.hlo.txt.gz', 'wt') as f:
      f.write(hlo_text)
  return summarise(load_trace(trace_path), hlo_text, steps, wall / steps)


def table(profile: dict) -> str:
  """The profile as lines: category, ms per step, % of the step."""
  lines = [f'{"category":<24} {"ms/step":>9} {"% of step":>9}']
  for category in (*CATEGORIES, IDLE):
    lines.append(
      f'{category:<24} {profile["ms_per_step"][category]:9.2f} '
      f'{profile["pct_of_step"][category]:8.1f}%'
    )
  lines.append(
    f'{"step (wall)":<24} {profile["step_ms"]:9.2f} {100.0:8.1f}%   ({profile["events"]} '
    f'{profile["events_from"]} events of {profile["module"]}, recognised by '
    + ', '.join(f'{k} {v}' for k, v in sorted(profile['recognised_by'].items()))
    + ')'
  )
  return '\n'.join(lines)
