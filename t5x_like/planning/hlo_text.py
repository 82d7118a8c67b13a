"""The text of an optimized HLO module (`compiled.as_text()`, or a module of XLA's dump), parsed
once for every tool that reads XLA's output: the memory report (memory_report.py: what the
buffers live at the peak hold) and the GPU step's profile and HBM traffic
(benchmarks/profile_trace.py and hbm_traffic.py).

The text is computations, `[ENTRY ]%name (params) -> TYPE {`, each a line per instruction,
`[ROOT ]%name = TYPE opcode(operands), attributes`, then `}`. A TYPE is an array
(`bf16[4,8]{1,0}`) or a tuple of types. An operand of a tuple's element is printed compactly by
newer XLA (openxla/xla 0b695bff): `%while.3#1` for the get-tuple-element it no longer prints;
`Module.type_of` reads its type out of the tuple's.
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {
  'pred': 1,
  's8': 1,
  'u8': 1,
  'f8e4m3fn': 1,
  'f8e5m2': 1,
  's16': 2,
  'u16': 2,
  'f16': 2,
  'bf16': 2,
  's32': 4,
  'u32': 4,
  'f32': 4,
  's64': 8,
  'u64': 8,
  'f64': 8,
}
_ARRAY = re.compile(r'\b(' + '|'.join(DTYPE_BYTES) + r')\[([\d,]*)\]')
_HEADER = re.compile(r'^(ENTRY )?%?([\w.\-]+) (?:\(.*\) -> .*)?\{\s*$')
_OPCODE = re.compile(r'^[a-z][\w\-]*$')
_LINE = re.compile(r'^\s*(ROOT )?%?([\w.\-]+) = (.*)$')
# An operand: a name, or a tuple's name and an element index per level ('param.2#0#4').
_OPERAND = re.compile(r'%([\w.\-]+(?:#\d+)*)')
_CALLED = re.compile(
  r'\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)'
)


def arrays(hlo_type: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, shape) of each array of an HLO type, in order (a tuple's too)."""
  return [
    (dtype, tuple(int(d) for d in dims.split(',') if d)) for dtype, dims in _ARRAY.findall(hlo_type)
  ]


def array_bytes(hlo_type: str) -> int:
  """Bytes of an HLO type: an array, or every array of a tuple."""
  return sum(DTYPE_BYTES[dtype] * math.prod(shape) for dtype, shape in arrays(hlo_type))


def _closing(text: str, start: int) -> int:
  """The index of the bracket that closes the one opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] in '([{'
    depth -= text[i] in ')]}'
    if depth == 0:
      return i
  raise ValueError(f'unbalanced brackets in {text[start : start + 80]!r}')


def tuple_elements(hlo_type: str) -> list[str]:
  """The top-level element types of a tuple type '(s32[], bf16[4,8]{1,0}, (f32[2]{0}))'."""
  inner = re.sub(r'/\*[^*]*\*/', '', hlo_type)[1:-1]
  elements, depth, start = [], 0, 0
  for i, ch in enumerate(inner):
    depth += ch in '([{'
    depth -= ch in ')]}'
    if ch == ',' and depth == 0:
      elements.append(inner[start:i].strip())
      start = i + 1
  if inner.strip():
    elements.append(inner[start:].strip())
  return elements


def split_instruction(rhs: str) -> tuple[str, str, str]:
  """(TYPE, opcode, the text after the opcode's '(') of an instruction's right-hand side
  'TYPE opcode(operands), attributes'."""
  end = _closing(rhs, 0) + 1 if rhs.startswith('(') else rhs.find(' ')
  opcode, paren, arguments = rhs[max(end, 0) :].strip().partition('(')
  if end <= 0 or not paren or not _OPCODE.match(opcode):
    raise ValueError(f'no opcode after the type in {rhs[:80]!r}')
  return rhs[:end], opcode, arguments


@dataclasses.dataclass
class Instruction:
  name: str
  type: str  # the result's HLO type
  opcode: str
  operands: tuple[str, ...]  # names, or compact tuple elements ('while.3#1')
  text: str  # after the opcode's '(': operands, attributes, metadata, backend config
  computation: str

  def attribute(self, pattern: str) -> str:
    """Group 1 of `pattern`'s first match in the instruction's text ('' if none)."""
    m = re.search(pattern, self.text)
    return m.group(1) if m else ''

  @property
  def dtype(self) -> str:
    return 'tuple' if self.type.startswith('(') else self.type.split('[')[0]

  @property
  def op_name(self) -> str:
    """The JAX op that made it (its metadata's op_name), '' if none."""
    return self.attribute(r'op_name="([^"]*)"')

  @property
  def called(self) -> tuple[str, ...]:
    """The computations it calls: a fusion's or call's body, a loop's body and condition, a
    reduction's function, a conditional's branches."""
    names = _CALLED.findall(self.text)
    for branches in re.findall(r'branch_computations=\{([^}]*)\}', self.text):
      names += [b.strip().lstrip('%') for b in branches.split(',') if b.strip()]
    return tuple(names)


@dataclasses.dataclass
class Module:
  name: str
  entry: str
  computations: dict[str, list[Instruction]]  # in the text's order
  roots: dict[str, Instruction]
  by_name: dict[str, Instruction]
  sources: dict[int, tuple[str, str]]  # stack frame id -> (file, function): stack_sources

  def type_of(self, operand: str) -> str:
    """The HLO type of an operand: an instruction's, or a compact tuple element's ('' if the
    module has neither)."""
    name, *indices = operand.split('#')
    instruction = self.by_name.get(name)
    hlo_type = instruction.type if instruction is not None else ''
    for i in indices:
      elements = tuple_elements(hlo_type) if hlo_type.startswith('(') else []
      hlo_type = elements[int(i)] if int(i) < len(elements) else ''
    return hlo_type

  def dtype_of(self, operand: str) -> str:
    hlo_type = self.type_of(operand)
    return 'tuple' if hlo_type.startswith('(') else hlo_type.split('[')[0]

  def source_of(self, instruction: Instruction) -> tuple[str, str] | None:
    """(file, function) of the innermost Python frame that made the instruction, if recorded."""
    frame = instruction.attribute(r'stack_frame_id=(\d+)')
    return self.sources.get(int(frame)) if frame else None


def _operands(arguments: str) -> tuple[str, ...]:
  """The operand names inside the opcode's parentheses (which close at depth 0)."""
  return tuple(_OPERAND.findall(arguments[: _closing('(' + arguments, 0) - 1]))


def _section(text: str, title: str) -> list[str]:
  """The numbered lines of one of the module's tables (FileNames, FunctionNames, ...)."""
  m = re.search(rf'^{title}\n((?:\d+ .*\n)+)', text, re.M)
  return m.group(1).splitlines() if m else []


def stack_sources(text: str) -> dict[int, tuple[str, str]]:
  """stack_frame_id -> (file, function) of that frame, from the module text's FileNames,
  FunctionNames, FileLocations and StackFrames tables ({} if it has none)."""

  def table(title: str) -> dict[int, str]:
    out = {}
    for line in _section(text, title):
      number, _, rest = line.partition(' ')
      out[int(number)] = rest.strip()
    return out

  files = {k: v.strip('"') for k, v in table('FileNames').items()}
  functions = {k: v.strip('"') for k, v in table('FunctionNames').items()}
  locations = {}
  for number, rest in table('FileLocations').items():
    fields = dict(re.findall(r'(\w+)=(\d+)', rest))
    if 'file_name_id' in fields and 'function_name_id' in fields:
      locations[number] = (
        files.get(int(fields['file_name_id']), ''),
        functions.get(int(fields['function_name_id']), ''),
      )
  frames = {}
  for number, rest in table('StackFrames').items():
    fields = dict(re.findall(r'(\w+)=(\d+)', rest))
    if 'file_location_id' in fields and int(fields['file_location_id']) in locations:
      frames[number] = locations[int(fields['file_location_id'])]
  return frames


def parse_module(text: str) -> Module:
  """The module's computations and instructions; a ValueError if the text has no ENTRY
  computation or an instruction line it cannot split."""
  name = re.match(r'\s*HloModule ([\w.\-]+)', text)
  computations: dict[str, list[Instruction]] = {}
  roots: dict[str, Instruction] = {}
  by_name: dict[str, Instruction] = {}
  entry, current = '', None
  for line in text.splitlines():
    header = _HEADER.match(line)
    if header and ' = ' not in line:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
      continue
    if line.startswith('}'):
      current = None
      continue
    m = _LINE.match(line)
    if not m or current is None:
      continue
    hlo_type, opcode, arguments = split_instruction(m.group(3))
    instruction = Instruction(
      m.group(2), hlo_type, opcode, _operands(arguments), arguments, current
    )
    computations[current].append(instruction)
    by_name[instruction.name] = instruction
    if m.group(1):
      roots[current] = instruction
  if not entry:
    raise ValueError('no ENTRY computation: not the text of an optimized HLO module')
  return Module(
    name.group(1) if name else '', entry, computations, roots, by_name, stack_sources(text)
  )
