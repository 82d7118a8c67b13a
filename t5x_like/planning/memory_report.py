"""Where a compiled step's memory goes, read from XLA's own buffer assignment.

`compile_with_buffer_dump` compiles a lowered program with XLA's dump enabled (into a temporary
directory) and `breakdown` reads three of the dump's files for the step's module:

* `*-buffer-assignment.txt`: every allocation (the entry parameters, the one preallocated temp
  allocation, the output tuple) and every value placed in it, with its offset and size;
* `*-buffer-assignment-values.txt`: the instruction that defines each value, with the JAX op name
  (`jit(step)/transpose(jvp())/while/body/...`) that says which pass of the step computed it;
* `*-live-range.txt`: each value's live range in the step's schedule, and XLA's own list of the
  buffers live at the schedule's peak.

Arguments are classified by their tree path (XLA keeps it as the parameter's op name). Temporaries
are the buffers live at XLA's peak, classified by the pass of the op that last wrote them (the op
name's innermost jvp/transpose/rematted_computation): written in the forward pass and read in the
backward one (kept activations; under a pipeline the [ticks, ..., rows, seq, hidden] stack of
stage inputs, matched by shape), recomputed in the backward pass, weight-shaped f32 in the backward
pass (gradient accumulators), weight-shaped and made outside the differentiated function or cast
from bf16 (weight copies: ZeRO-1's gathered weights, bf16 casts), the rest of the backward pass,
or other. These are heuristics on names and shapes: a buffer XLA reuses for several roles gets
the role of its last writer. The heap bytes not live at the peak are XLA's packing loss. The
categories add up to XLA's figure of arguments + outputs + temporaries - aliased.

The CPU backend has no bf16 data movement: buffers that a GPU keeps in bf16 are f32 here. Their
values are f32 buffers whose defining op converts from bf16 (or a fusion whose body does), and
half of their bytes at the peak is what the CPU compile overstates.

The dump's form across XLA versions (openxla/xla, read from jaxlib 0.10.2's XLA 5a9e73cb of
2026-06-14 to the XLA of 2026-08-22; jaxlib 0.11.2's was not available): for a CPU compile the
three files' text and names are unchanged; what changed are dump defaults, so the compile asks for
each option it relies on (`_DUMP_OPTIONS`), and the module text is read in both forms of its
get-tuple-element operands (XLA 0b695bff, 2026-07-13, in jaxlib 0.11.0 and later, prints
`%while.3#1` for a get-tuple-element of a tuple by default). A dump that still does not parse is a
DumpError naming the file, the part not found, how the file begins, which files the dump holds and
XLA's non-default debug options; `T5X_LIKE_KEEP_XLA_DUMP=FILE.tar.gz` keeps the dump's text files.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import sys
import tarfile
import tempfile
import typing

import numpy as np

from t5x_like.planning import hlo_text
from t5x_like.training import device_memory

# The files of one module's dump; the step is the module with the largest buffer assignment.
_ASSIGNMENT = '-buffer-assignment.txt'
_VALUES = '-buffer-assignment-values.txt'
_LIVE = '-live-range.txt'

CATEGORIES = (
  'master weights (fp32 params)',
  'Adam moments',
  'batch and step scalars',
  'kept stage inputs',
  'kept activations',
  'recomputation workspace',
  'gradient accumulators',
  'backward workspace',
  'weight copies',
  'other temporaries',
  'heap packing (not live at the peak)',
  'outputs not aliased to arguments',
)


class DumpError(RuntimeError):
  """XLA's dump did not hold a buffer assignment this module can read."""


def _versions() -> str:
  import jax

  try:
    import jaxlib.version

    return f'jax {jax.__version__}, jaxlib {jaxlib.version.__version__}'
  except ImportError:
    return f'jax {jax.__version__}'


def _dump_context(dump_dir: str) -> str:
  """What the next reader of a DumpError needs without the (temporary) dump: the files the dump
  holds (LLVM IR and object files counted, not named) and the debug options XLA reports as
  non-default (its `*.debug_options` file)."""
  paths = sorted(
    p for p in glob.glob(os.path.join(dump_dir, '**', '*'), recursive=True) if os.path.isfile(p)
  )
  named = [p for p in paths if not p.endswith(('.ll', '.o'))]
  files = ', '.join(f'{os.path.relpath(p, dump_dir)} ({os.path.getsize(p)} B)' for p in named[:16])
  more = len(named) - 16
  text = f'the dump holds {len(paths)} files, {len(paths) - len(named)} of them .ll/.o: {files}'
  text += f', and {more} more' if more > 0 else ''
  options = [p for p in named if p.endswith('.debug_options')]
  if options:
    with open(options[0]) as f:
      lines = [line.strip() for line in f if line.strip()]
    text += "; XLA's non-default debug options: " + ' | '.join(lines)[:600]
  return text


def _expect(found: bool, path: str, what: str, text: str) -> None:
  """Raises a DumpError naming `what` was not found in the dump file `path` (and how the file
  begins, and what the dump holds), so that a changed dump format is one clear error instead of
  a silently wrong figure."""
  if found:
    return
  head = ' | '.join(line.rstrip() for line in text.splitlines()[:6])[:600]
  raise DumpError(
    f'{os.path.basename(path)}: {what} not found ({_versions()}: its XLA dump no longer '
    f'matches what t5x_like/planning/memory_report.py parses); the file begins: {head!r}; '
    f'{_dump_context(os.path.dirname(path))}'
  )


def _parsed(parse, path: str, text: str):
  """parse(text), a line it cannot read being a DumpError that names the file."""
  try:
    return parse(text)
  except (ValueError, IndexError, KeyError) as e:
    _expect(False, path, f'a line {parse.__name__} can read ({type(e).__name__}: {e})', text)


# The dump options this module relies on, each asked for rather than left to XLA's default
# (DebugOptions fields in openxla/xla's xla/xla.proto; xla/service/dump.cc writes the files).
_DUMP_OPTIONS = {
  'xla_dump_hlo_as_text': True,
  # -buffer-assignment-values.txt and -live-range.txt are written only under this option (field
  # 466; true by default from jaxlib 0.10.2's XLA to the XLA of 2026-08-22 at least).
  'xla_dump_buffer_assignment_analysis': True,
  # One flat directory; true puts the files under <dump>/<module>/<host>_<pid>/ (field 502).
  'xla_dump_hlo_to_subfolder': False,
  # Every get-tuple-element printed, with its metadata: XLA 0b695bff (2026-07-13) made compact
  # GTEs ('%while.3#1', no GTE line) the default. jaxlib 0.10.2's XLA predates the option (field
  # 495) and refuses it; it prints the same form by itself.
  'xla_dump_compact_gte': False,
}


def compile_with_buffer_dump(lowered, options: dict | None = None, compile=None):
  """(compiled, dump directory) for `lowered` compiled with XLA's dump on (and `options`, more
  compiler options); the caller removes the directory (a `tempfile.TemporaryDirectory`'s name is
  returned with the object). An option this XLA does not know is dropped. compile(options): what
  compiles (default `lowered.compile(compiler_options=options)`); its result is returned."""
  tmp = tempfile.TemporaryDirectory(prefix='t5x_like_plan_dump_')
  compiler_options = {'xla_dump_to': tmp.name, **_DUMP_OPTIONS, **(options or {})}
  compile = compile or (lambda o: lowered.compile(compiler_options=o))
  while True:
    try:
      return compile(compiler_options), tmp
    except Exception as e:  # jax's JaxRuntimeError: INVALID_ARGUMENT, before any compiling
      unknown = [k for k in _DUMP_OPTIONS if k in compiler_options and f"'{k}'" in str(e)]
      if 'No such compile option' not in str(e) or not unknown:
        tmp.cleanup()
        raise
      del compiler_options[unknown[0]]


@dataclasses.dataclass
class Value:
  id: int
  name: str  # position name as the live-range file spells it, e.g. 'while.285{1}'
  allocation: int
  offset: int
  size: int
  shape: str  # e.g. 'f32[2048,256]'
  opcode: str = ''
  op_name: str = ''
  converts_from_bf16: bool = False
  start: int = -1
  end: int = -1

  @property
  def dtype(self) -> str:
    return self.shape.split('[', 1)[0]

  @property
  def dims(self) -> tuple[int, ...]:
    m = re.match(r'^\w+\[([\d,]*)\]', self.shape)
    return tuple(int(d) for d in m.group(1).split(',') if d) if m else ()


@dataclasses.dataclass
class Allocation:
  index: int
  size: int
  kind: str  # 'parameter', 'temp', 'output', 'constant', 'thread-local'
  parameter: int = -1
  values: list = dataclasses.field(default_factory=list)


def _module_files(dump_dir: str) -> dict[str, str]:
  # In the dump's directory or below it (xla_dump_hlo_to_subfolder's layout).
  candidates = glob.glob(os.path.join(dump_dir, '**', f'*{_ASSIGNMENT}'), recursive=True)
  if not candidates:
    raise DumpError(
      f'no *{_ASSIGNMENT} in {dump_dir} ({_versions()}): the compile wrote no buffer '
      'assignment (a persistent compilation cache hit compiles nothing); '
      f'{_dump_context(dump_dir)}'
    )
  assignment = max(candidates, key=os.path.getsize)
  stem = assignment[: -len(_ASSIGNMENT)]
  files = {'assignment': assignment, 'values': stem + _VALUES, 'live': stem + _LIVE}
  for path in files.values():
    if not os.path.exists(path):
      raise DumpError(
        f'XLA dump lacks {os.path.basename(path)} ({_versions()}; XLA writes it under '
        f'xla_dump_buffer_assignment_analysis, asked for: {_DUMP_OPTIONS}); '
        f'{_dump_context(dump_dir)}'
      )
  return files


def keep_dump(dump_dir: str, archive: str) -> None:
  """Writes the dump's text files (not its LLVM IR or object files) and a list of all its files
  into the .tar.gz `archive`, for reading the dump after its directory is gone."""
  paths = sorted(
    p for p in glob.glob(os.path.join(dump_dir, '**', '*'), recursive=True) if os.path.isfile(p)
  )
  os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
  listing = os.path.join(dump_dir, 'FILES.txt')
  with open(listing, 'w') as f:
    f.writelines(f'{os.path.getsize(p):>12} {os.path.relpath(p, dump_dir)}\n' for p in paths)
  with tarfile.open(archive, 'w:gz') as tar:
    tar.add(listing, arcname='FILES.txt')
    for p in paths:
      if not p.endswith(('.ll', '.o')) and os.path.getsize(p) < 256 * 2**20:
        tar.add(p, arcname=os.path.relpath(p, dump_dir))
  os.remove(listing)


_ALLOCATION = re.compile(r'^allocation (\d+): size (\d+), (.*)$')
_VALUE = re.compile(
  r'^ value: <(\d+) (\S+?)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): '
  r'(\S+)'
)


def _position(name: str) -> str:
  return name if name.endswith('}') else name + '{}'


def parse_assignment(text: str) -> dict[int, Allocation]:
  allocations: dict[int, Allocation] = {}
  current = None
  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      # BufferAllocation::ToString's attributes after the size, in its order: color, page (only
      # when not 0 / -1), parameter, output shape, constant, thread-local, maybe-live-out,
      # preallocated-temp; the kind is the first of parameter, output, constant, temp.
      rest = re.sub(r'^(?:color \d+, )?(?:page \d+, )?', '', m.group(3))
      if rest.startswith('parameter'):
        kind, parameter = 'parameter', int(rest.split()[1].rstrip(','))
      else:
        parameter = -1
        kind = (
          'temp'
          if rest.startswith('preallocated-temp')
          else 'output'
          if rest.startswith('output')
          else 'constant'
          if rest.startswith('constant')
          else rest.split(':')[0].strip()
        )
      current = Allocation(int(m.group(1)), int(m.group(2)), kind, parameter)
      allocations[current.index] = current
      continue
    m = _VALUE.match(line)
    if m and current is not None:
      shape = m.group(5).split('{')[0] if not m.group(5).startswith('(') else 'tuple'
      current.values.append(
        Value(
          int(m.group(1)),
          _position(m.group(2)),
          current.index,
          int(m.group(4)),
          int(m.group(3)),
          shape,
        )
      )
  return allocations


_FROM = re.compile(r'^ from instruction: %(\S+) = (.*)$')


def parse_values(text: str) -> dict[int, tuple[str, str, str]]:
  """value id -> (opcode, JAX op name, the defining instruction's text after its shape)."""
  out = {}
  current = None
  for line in text.splitlines():
    if line.startswith('<'):
      current = int(line[1:].split(' ', 1)[0])
    elif current is not None:
      m = _FROM.match(line)
      if m:
        rhs = m.group(2)
        op_name = re.search(r'op_name="([^"]*)"', rhs)
        out[current] = (
          hlo_text.split_instruction(rhs)[1],
          op_name.group(1) if op_name else '',
          rhs,
        )
  return out


def parse_live_ranges(text: str) -> tuple[dict, int, list[str], list[str]]:
  """(position -> (start, end), the peak's index in the schedule, positions live at the peak,
  the schedule's instruction names)."""
  ranges, peak_at, at_peak, sequence = {}, -1, [], []
  section = None
  for line in text.splitlines():
    if line.startswith('  InstructionSequence:'):
      section = 'sequence'
    elif section == 'sequence' and line.startswith('    '):
      sequence.append(line.strip().split(':', 1)[1])
    elif line.startswith('  BufferLiveRange:'):
      section = 'ranges'
    elif line.startswith('  Live ranges at '):
      section = 'peak'
      peak_at = int(line.split()[3])
    elif line.startswith('  ') and not line.startswith('    '):
      section = None
    elif section == 'ranges':
      name, _, span = line.strip().rpartition(':')
      start, _, end = span.partition('-')
      ranges[name] = (int(start), int(end))
    elif section == 'peak':
      at_peak.append(line.strip().split(': ', 1)[0])
  return ranges, peak_at, at_peak, sequence


def phase(op_name: str) -> str:
  """Which pass of the step computed an op: 'forward', 'backward', 'recompute' or 'update'
  (outside the differentiated function: the optimizer)."""
  innermost, transposed = None, False
  for segment in op_name.split('/'):
    if segment.startswith('transpose('):
      innermost, transposed = 'backward', True
    elif segment.startswith('jvp('):
      innermost = 'recompute' if transposed else 'forward'
    elif segment == 'rematted_computation':
      innermost = 'recompute'
  return innermost or 'update'


# Ops that move data without changing it: a convert from bf16 under one of them still says the
# buffer holds bf16 values.
_MOVES = {
  'bitcast',
  'copy',
  'reshape',
  'transpose',
  'broadcast',
  'slice',
  'dynamic-slice',
  'pad',
  'concatenate',
  'select',
  'dynamic-update-slice',
}


class Hlo:
  """The optimized module, as far as the report needs it: which f32 values are bf16 ones widened,
  and each instruction's JAX op name."""

  def __init__(self, module: hlo_text.Module):
    self.module = module
    self.op_names = {name: i.op_name for name, i in module.by_name.items() if i.op_name}

  def holds_bf16_values(self, name: str, depth: int = 0) -> bool:
    """Whether f32 value `name` (an instruction, the root of the fusion it is, or a compact
    tuple element) is a bf16 value widened: a convert from bf16, possibly moved by data-movement
    ops (what the CPU backend's float normalization inserts around the bf16 ops it cannot run)."""
    instruction = self.module.by_name.get(name)
    if instruction is None or depth > 8:
      return False
    opcode, operands = instruction.opcode, instruction.operands
    calls = instruction.attribute(r'calls=%([\w.\-]+)')
    if opcode == 'fusion' and calls in self.module.roots:
      return self.holds_bf16_values(self.module.roots[calls].name, depth + 1)
    if opcode == 'convert':
      return bool(operands) and self.module.dtype_of(operands[0]) == 'bf16'
    if opcode in _MOVES:
      data = (
        operands[1:2]
        if opcode == 'dynamic-update-slice'
        else (
          operands[1:]
          if opcode == 'select'
          else operands[:1]
          if opcode in ('dynamic-slice', 'pad')
          else operands
        )
      )
      return bool(data) and all(self.holds_bf16_values(o, depth + 1) for o in data)
    return False


def parse_hlo(text: str) -> Hlo:
  return Hlo(hlo_text.parse_module(text))


@dataclasses.dataclass(eq=False)
class Buffer:
  """Values that occupy one offset range of the temp allocation one after another without a gap
  (a while loop's carried value, an in-place update): one piece of memory."""

  values: list
  category: str = 'other temporaries'

  @property
  def size(self) -> int:
    return self.values[0].size

  @property
  def main(self) -> Value:
    """The value named for the buffer: its largest array that an instruction computes."""
    named = [v for v in self.values if v.op_name] or self.values
    return max(named, key=lambda v: (v.shape != 'tuple', v.size, -v.id))


def _temp_buffers(temp: Allocation) -> list[Buffer]:
  by_range: dict[tuple[int, int], list[Value]] = {}
  for v in temp.values:
    by_range.setdefault((v.offset, v.size), []).append(v)
  buffers = []
  for values in by_range.values():
    values.sort(key=lambda v: (v.start, v.end))
    group: list[Value] = []
    end = 0  # the group's last end; set by its first value before it is read
    for v in values:
      if group and v.start > end:
        buffers.append(Buffer(group))
        group = []
      end = v.end if not group else max(end, v.end)
      group.append(v)
    buffers.append(Buffer(group))
  return buffers


def _argument_category(op_name: str) -> str:
  if op_name.startswith('state.params'):
    return 'master weights (fp32 params)'
  if re.match(r'state\.opt_state.*\.(mu|nu)\b', op_name):
    return 'Adam moments'
  return 'batch and step scalars'


def _squeezed(dims: tuple) -> tuple:
  return tuple(d for d in dims if d != 1)


def _weight_shaped(dims: tuple, weights: set, data: int) -> bool:
  """Whether `dims` is a parameter's local shape, or that shape with one dim up to `data` times
  larger (ZeRO-1 splits the state over `data`; the step's gradients are whole until reduced)."""
  dims = _squeezed(dims)
  for w in weights:
    if len(w) == len(dims):
      wider = [(d, v) for d, v in zip(dims, w) if d != v]
      if not wider or (len(wider) == 1 and wider[0][1] < wider[0][0] <= wider[0][1] * data):
        return True
  return False


_PASSES_ON = {'while', 'parameter', 'conditional', 'call', 'bitcast', 'tuple', 'get-tuple-element'}


def _classify(
  buffer: Buffer, at: int | None, runs, stage_input: tuple | None, weights: set, data: int
) -> str:
  """The category of `buffer` at schedule index `at` (None: its largest value), by the value
  that wrote it last. `runs(passes, start, end)`: whether an instruction of one of `passes` is
  scheduled in [start, end]."""
  # Loop and branch results and parameters pass a value on: they do not write the buffer.
  named = sorted(
    (v for v in buffer.values if v.op_name and v.opcode not in _PASSES_ON), key=lambda v: v.start
  )
  if at is None:
    owner = max(named, key=lambda v: (v.size, -v.start), default=None)
  else:
    owner = max((v for v in named if v.start <= at), key=lambda v: v.start, default=None)
  # The owner's reign: until the next value an instruction writes into the buffer.
  start = owner.start if owner else min(v.start for v in buffer.values)
  later = [v.start for v in named if v.start > start]
  end = min(later) - 1 if later else max(v.end for v in buffer.values)
  pass_ = phase(owner.op_name) if owner else 'carried'
  dims = buffer.main.dims
  activation = stage_input is not None and len(dims) >= 4 and dims[-3:] == stage_input[1:]
  weight = _weight_shaped(dims, weights, data)
  backward = runs(('backward', 'recompute'), start, end)
  # The stack of kept stage inputs, [kept, stages on a device, rows, seq, hidden] (GPipe: one per
  # tick, written by the forward pass) or [stages on a device, kept, rows, seq, hidden] (1F1B: a
  # ring of 2P - 1 slots written by each tick's forward half, outside any jvp).
  if (
    activation
    and stage_input is not None
    and stage_input[0] in dims[:-3]
    and pass_ in ('forward', 'update')
    and backward
  ):
    return 'kept stage inputs'
  if pass_ == 'forward' and backward:  # written forward, read in the backward pass
    return 'kept activations'
  if weight and any(v.converts_from_bf16 for v in buffer.values):
    return 'weight copies'  # a weight cast to bf16 (held in f32 by the CPU backend)
  if pass_ == 'recompute':
    return 'recomputation workspace'
  if pass_ in ('backward', 'carried') and backward:
    # f32 and shaped like a weight in the backward pass (or carried into it): a weight gradient.
    if buffer.main.dtype == 'f32' and not activation and weight:
      return 'gradient accumulators'
    return 'backward workspace'
  if pass_ in ('update', 'carried') and weight and runs(('forward', 'backward'), start, end):
    # Made outside the differentiated function and used by it: the weights gathered over
    # `data` (ZeRO-1) or cast to the compute dtype.
    return 'weight copies'
  return 'other temporaries'


class _Dump(typing.NamedTuple):
  """The parts of one module's dump that `breakdown` and `live_at_peak` read, each checked."""

  files: dict
  allocations: dict
  defined: dict
  live: tuple  # parse_live_ranges': (ranges, peak index, positions at the peak, schedule)
  hlo: Hlo


def _read_dump(dump_dir: str) -> _Dump:
  """The step module's buffer assignment, value definitions, live ranges and optimized text."""
  files = _module_files(dump_dir)
  # Each part of the dump is checked as it is read: a format this module no longer matches is a
  # DumpError naming the part, never categories computed from half-read files.
  with open(files['assignment']) as f:
    text = f.read()
  allocations = _parsed(parse_assignment, files['assignment'], text)
  _expect(bool(allocations), files['assignment'], "'allocation N: size S, ...' lines", text)
  _expect(
    any(a.values for a in allocations.values()),
    files['assignment'],
    "' value: <id name @position> (size=S,offset=O): shape' lines",
    text,
  )
  with open(files['values']) as f:
    text = f.read()
  defined = _parsed(parse_values, files['values'], text)
  _expect(
    bool(defined), files['values'], "'<id name @position>' / ' from instruction:' pairs", text
  )
  with open(files['live']) as f:
    text = f.read()
  live = _parsed(parse_live_ranges, files['live'], text)
  ranges, peak_at, at_peak, sequence = live
  _expect(bool(sequence), files['live'], "the '  InstructionSequence:' section", text)
  _expect(
    bool(ranges), files['live'], "the '  BufferLiveRange:' section ('name{}:start-end')", text
  )
  _expect(peak_at >= 0 and bool(at_peak), files['live'], "'  Live ranges at N (peak):'", text)
  hlo_path = files['assignment'][: -len(_ASSIGNMENT)] + '.txt'
  _expect(os.path.exists(hlo_path), hlo_path, 'the optimized module (file)', '')
  with open(hlo_path) as f:
    text = f.read()
  hlo = _parsed(parse_hlo, hlo_path, text)
  _expect(bool(hlo.module.by_name), hlo_path, "instructions ('%name = shape opcode(...)')", text)
  return _Dump(files, allocations, defined, live, hlo)


def breakdown(
  dump_dir: str, memory, *, stage_input: tuple | None = None, data: int = 1, top: int = 10
) -> dict:
  """The step's memory by category (bytes), from the XLA dump in `dump_dir` and its
  `compiled.memory_analysis()`. `stage_input`: (kept, rows, seq, hidden) of a pipeline's kept
  stage inputs on one device (kept: how many), None without a pipeline; `data`: the mesh's data
  size. With T5X_LIKE_KEEP_XLA_DUMP set, the dump's text files are first kept there (a .tar.gz,
  `keep_dump`), readable or not."""
  archive = os.environ.get('T5X_LIKE_KEEP_XLA_DUMP')
  if archive:
    try:
      keep_dump(dump_dir, archive)
    except OSError as e:
      print(f'memory_report: the XLA dump was not kept in {archive}: {e}', file=sys.stderr)
  files, allocations, defined, (ranges, peak_at, at_peak, sequence), hlo = _read_dump(dump_dir)
  for allocation in allocations.values():
    for v in allocation.values:
      v.opcode, v.op_name, rhs = defined.get(v.id, ('', '', ''))
      v.converts_from_bf16 = v.dtype == 'f32' and hlo.holds_bf16_values(v.name.split('{')[0])
      v.start, v.end = ranges.get(v.name, (-1, -1))
  # The files must name the same values: most temporaries defined and with a live range.
  temp_values = [v for a in allocations.values() if a.kind == 'temp' for v in a.values]
  if temp_values:
    unranged = [v.name for v in temp_values if v.start < 0]
    undefined = [v.name for v in temp_values if v.id not in defined]
    _expect(
      len(unranged) <= len(temp_values) // 2,
      files['live'],
      f'live ranges of the temporaries {unranged[:3]} (of {len(unranged)}/{len(temp_values)})',
      '',
    )
    _expect(
      len(undefined) <= len(temp_values) // 2,
      files['values'],
      f'the definitions of {undefined[:3]} (of {len(undefined)}/{len(temp_values)})',
      '',
    )
  _expect(
    sum(name in hlo.op_names for name in sequence) > 0,
    files['assignment'][: -len(_ASSIGNMENT)] + '.txt',  # the optimized module
    "op names (metadata={op_name=...}) of the schedule's instructions",
    '',
  )
  temps = [a for a in allocations.values() if a.kind == 'temp']
  if len(temps) != 1 or temps[0].size != memory.temp_size_in_bytes:
    raise DumpError(
      "the dump's temp allocation does not match XLA's memory analysis "
      f'({[a.size for a in temps]} vs {memory.temp_size_in_bytes} bytes)'
    )
  temp = temps[0]

  totals = dict.fromkeys(CATEGORIES, 0)
  weights = set()
  for allocation in allocations.values():
    if allocation.kind == 'parameter':
      argument = next((v for v in allocation.values if v.opcode == 'parameter'), None)
      category = _argument_category(argument.op_name if argument else '')
      totals[category] += allocation.size
      if argument and category == 'master weights (fp32 params)':
        weights.add(_squeezed(argument.dims))
  if sum(totals.values()) != memory.argument_size_in_bytes:
    raise DumpError("the dump's parameter allocations do not add up to XLA's argument size")
  totals['outputs not aliased to arguments'] = (
    memory.output_size_in_bytes - memory.alias_size_in_bytes
  )

  # counts[p][i]: how many of the first i scheduled instructions belong to pass p.
  counts = {p: [0] for p in ('forward', 'backward', 'recompute', 'update')}
  for name in sequence:
    this = phase(hlo.op_names[name]) if name in hlo.op_names else None
    for p, running in counts.items():
      running.append(running[-1] + (this == p))
  last = len(sequence) - 1

  def runs(passes, start, end):
    start, end = max(start, 0), min(end, last)
    return start <= end and any(counts[p][end + 1] > counts[p][start] for p in passes)

  # The pass of the last instruction with an op name scheduled at or before the peak.
  named_at = [hlo.op_names[n] for n in sequence[: peak_at + 1] if n in hlo.op_names]
  peak_phase = phase(named_at[-1]) if named_at else 'unknown'
  buffers = _temp_buffers(temp)
  live_names = set(at_peak)
  live = [
    b
    for b in buffers
    if any(v.name in live_names and v.start <= peak_at <= v.end for v in b.values)
  ]
  for b in buffers:
    b.category = _classify(b, peak_at if b in live else None, runs, stage_input, weights, data)
  live_bytes = 0
  widened = 0
  for b in live:
    totals[b.category] += b.size
    live_bytes += b.size
    if b.main.dtype == 'f32' and any(v.converts_from_bf16 for v in b.values):
      widened += b.size // 2
  totals['heap packing (not live at the peak)'] = temp.size - live_bytes
  peak = device_memory.peak_bytes(memory)
  largest = sorted(buffers, key=lambda b: -b.size)[:top]
  return {
    'bytes': totals,
    'peak_bytes': peak,
    'peak_phase': peak_phase,
    'live_at_peak_bytes': live_bytes,
    'largest_temporaries': [
      {
        'shape': b.main.shape,
        'bytes': b.size,
        'category': b.category,
        'live_at_peak': b in live,
        'op': b.main.op_name or b.main.opcode,
        'widened_from_bf16': any(v.converts_from_bf16 for v in b.values),
      }
      for b in largest
    ],
    'cpu_overstatement_bytes': widened,
  }


def live_bytes_by_position(
  values: list[tuple[int, int, int, int, int]], positions: int, max_cells: int = 2**24
):
  """The bytes live at each position of a schedule of `positions` instructions: `values` are
  (allocation, offset, size, start, end) with their live range [start, end]; values that share
  bytes of an allocation (a loop's value and its body's parameter, a conditional's result and its
  operand's copy) count them once. Memory: about `max_cells` counters at a time, whatever the
  schedule's length (an unrolled step's runs to hundreds of thousands of positions)."""
  live = np.zeros(positions, np.int64)
  by_allocation: dict[int, list] = {}
  for value in values:
    by_allocation.setdefault(value[0], []).append(value[1:])
  for spans in by_allocation.values():
    # The allocation cut at every slice's ends: each value covers a run of segments for a run of
    # positions, counted with a 2-D difference array, a block of positions at a time.
    cuts = np.unique([e for offset, size, *_ in spans for e in (offset, offset + size)])
    segments = np.diff(cuts)
    changes: dict[int, list] = {}
    for offset, size, start, end in spans:
      first, last = np.searchsorted(cuts, [offset, offset + size])
      changes.setdefault(start, []).append((first, last, 1))
      changes.setdefault(end + 1, []).append((first, last, -1))
    rows = max(1, max_cells // len(cuts))
    covered_before = np.zeros(len(cuts), np.int32)  # the per-cut difference row so far
    for block in range(0, positions, rows):
      stop = min(block + rows, positions)
      delta = np.zeros((stop - block, len(cuts)), np.int32)
      for position in range(block, stop):
        for first, last, sign in changes.get(position, ()):
          delta[position - block, first] += sign
          delta[position - block, last] -= sign
      delta = delta.cumsum(axis=0) + covered_before
      covered_before = delta[-1]
      live[block:stop] += (delta.cumsum(axis=1)[:, :-1] > 0) @ segments
  return live


def live_at_peak(dump_dir: str, top: int = 15) -> dict:
  """XLA's own account of a compile's peak, read from its dump without the categories of
  `breakdown` (fitted to CPU programs; a GPU program's schedule, copies and hoisted zero-fills
  differ): the instruction where the most bytes are live and its op name, and the largest buffers
  live there, each with its bytes, shape, whether it is an argument, and what defines it (an
  argument's tree path, the op that computes it, or XLA's own opcode: a copy it inserted, a
  loop's value)."""
  files, allocations, defined, (ranges, _, _, sequence), hlo = _read_dump(dump_dir)
  # Not the position the live-range file calls the peak: it adds up values, and a loop's values
  # share their bytes with its body's (on tr11's GPU step it named a point with 32.8 GiB live,
  # where 46.5 GiB are live inside the loop's body).
  values = [
    (a, v)
    for a in allocations.values()
    for v in a.values
    if v.name in ranges and ranges[v.name][0] <= ranges[v.name][1] < len(sequence)
  ]
  _expect(bool(values), files['live'], "live ranges of the buffer assignment's values", '')
  live_bytes = live_bytes_by_position(
    [(a.index, v.offset, v.size, *ranges[v.name]) for a, v in values], len(sequence)
  )
  peak_at = int(live_bytes.argmax())
  # Values that occupy the same slice at the peak are one buffer: one row each.
  slices: dict[tuple[int, int, int], dict] = {}
  for allocation, value in values:
    start, end = ranges[value.name]
    if not start <= peak_at <= end:
      continue
    opcode, op_name, _ = defined.get(value.id, ('', '', ''))
    row = slices.setdefault(
      (allocation.index, value.offset, value.size),
      {
        'bytes': value.size,
        'shape': value.shape,
        'argument': allocation.kind == 'parameter',
        'defined_by': [],
        'values': [],
      },
    )
    if (op_name or opcode) not in row['defined_by']:
      row['defined_by'].append(op_name or opcode)
    row['values'].append(value.name)
  live = sorted(
    (
      dict(r, defined_by=' / '.join(r['defined_by']), values=', '.join(r['values']))
      for r in slices.values()
    ),
    key=lambda r: -r['bytes'],
  )
  at = sequence[peak_at]
  return {
    'peak_instruction': at,
    'peak_op': hlo.op_names.get(at, ''),
    'live_bytes': int(live_bytes[peak_at]),
    'largest': live[:top],
  }


OVERSTATEMENT_NOTE = (
  "XLA's CPU backend computes bf16 slices, pads and updates in f32; the f32 buffers live at the "
  'peak whose values are converted from bf16 (possibly moved since) would be bf16 on a GPU, so '
  'half their bytes is subtracted from the peak. An estimate: a GPU compile schedules and '
  'packs its buffers differently, and has not been measured here.'
)
