"""What ptxas makes of the Mosaic GPU attention kernels, read on a machine with no GPU.

    python benchmarks/kernel_sass.py [--only NAME,...] [--seq 4096] [--gpu h100-80gb]
        [--json OUT] [--keep DIR]

For each candidate of `mosaic_sweep.CANDIDATES` (or `--only`'s), the forward and backward of
`attention.py`'s workload (causal ALiBi, 16 heads of 128, bf16, batch x seq = 16384 tokens) are
compiled for `--gpu` on the CPU: jax's CUDA plugin compiles for an abstract GPU, and Mosaic GPU
runs ptxas on each kernel's PTX as it would on a GPU, dumping the PTX on request. This script
assembles each dumped PTX again (`ptxas -v`: the ptxas on PATH, the machine's CUDA) for its
resources, and disassembles the result (nvdisasm, from PATH or the `nvidia-cuda-nvdisasm` wheel)
into the machine code the GPU would run.

Per kernel the table gives the registers per thread at launch, the bytes spilled to local memory
and ptxas's warnings (such as wgmma serialised for want of registers), then the kernel's hot
loops: the innermost loops that issue tensor-core products (HGMMA), with one iteration's
instructions by kind. A spill inside a hot loop costs every key tile a trip to local memory, and
the softmax's instructions beside the products are what FlashAttention-3's schedules hide.
ptxas's decisions are the GPU's, so this screens the sweep's candidates before a GPU session;
only a GPU can time them (mosaic_sweep.py).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import mosaic_sweep  # a script beside this one (benchmarks/)

from t5x_like.kernels import MosaicBlocks, mosaic_attention
from t5x_like.planning import gpu_target

TOKENS, HEADS, HEAD_DIM = 16384, 16, 128
# The Mosaic GPU kernels are Hopper's: the architecture ptxas assembles them for (wgmma and
# setmaxnreg are sm_90a's), and the GPU kinds of gpu_target with it.
SM_ARCH = 'sm_90a'
HOPPER_KINDS = tuple(
  kind for kind in sorted(gpu_target.DEVICES) if gpu_target.compute_capability(kind) == '9.0'
)
# Mosaic GPU's compile (jax 0.10.2's CUDA plugin) leaves each kernel's binary behind in a directory
# of its own, /tmp/mosaic-gpu-XXXXXX/kernel.bin (the path is fixed in jax's CUDA plugin): those
# the children made are removed.
MOSAIC_TEMP = Path('/tmp/mosaic-gpu-*')
# The kernels' Python names (kernels/mosaic_attention.py); Mosaic GPU names its dumps after them.
KERNELS = ('attention_forward', 'attention_dkv', 'attention_dq')

# Instruction kinds by SASS opcode (its first dot-separated part).
KINDS: dict[str, tuple[str, ...]] = {
  'product': ('HGMMA', 'HMMA'),
  'exp2': ('MUFU',),  # the special-function unit: exp2 in these loops, its rcp and lg2 after
  'fp32': ('FADD', 'FMUL', 'FFMA', 'FMNMX', 'FSEL', 'FSETP', 'FCHK', 'FSWZADD'),
  'convert': ('F2FP', 'F2F', 'I2F', 'F2I', 'I2FP'),
  'shuffle': ('SHFL',),
  'shared': ('LDS', 'STS', 'LDSM', 'STSM'),
  'local': ('LDL', 'STL'),
  'sync': ('SYNCS', 'BAR', 'WARPGROUP', 'DEPBAR', 'WARPSYNC', 'NANOSLEEP', 'MEMBAR', 'FENCE'),
  'copy': ('UTMALDG', 'UTMASTG', 'UTMACMDFLUSH', 'UBLKCP'),
  'branch': ('BRA', 'EXIT', 'RET', 'CALL', 'BSSY', 'BSYNC'),
}
_KIND_OF = {opcode: kind for kind, opcodes in KINDS.items() for opcode in opcodes}
TABLE_KINDS = (
  'product',
  'exp2',
  'fp32',
  'convert',
  'integer',
  'uniform',
  'shared',
  'local',
  'sync',
)

_INSTRUCTION = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;')
_LABEL = re.compile(r'^\s*(\.L_x_\d+):')
_PREDICATE = re.compile(r'^@!?U?P[T\d]+\s+')
_BRANCH_TARGET = re.compile(r'BRA\s+(?:[A-Z.]+\s+)?`\((\.L_x_\d+)\)')


@dataclasses.dataclass(frozen=True)
class Instruction:
  address: int
  opcode: str  # with its modifiers: 'HGMMA.64x128x16.F32.BF16'
  predicated: bool
  text: str

  @property
  def kind(self) -> str:
    root = self.opcode.split('.', 1)[0]
    if root in _KIND_OF:
      return _KIND_OF[root]
    if root.startswith('U') or root in ('R2UR', 'S2UR', 'VOTEU'):
      return 'uniform'  # the warp-wide scalar datapath: addresses, loop counters, barriers
    return 'integer'


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
  """nvdisasm's listing -> (its instructions in address order, each label's address)."""
  instructions: list[Instruction] = []
  labels: dict[str, int] = {}
  pending: list[str] = []
  for line in text.splitlines():
    label = _LABEL.match(line)
    if label:
      pending.append(label.group(1))
      continue
    match = _INSTRUCTION.search(line)
    if not match:
      continue
    address, body = int(match.group(1), 16), match.group(2)
    for name in pending:
      labels[name] = address
    pending = []
    predicate = _PREDICATE.match(body)
    unpredicated = body[predicate.end() :] if predicate else body
    instructions.append(Instruction(address, unpredicated.split()[0], bool(predicate), body))
  return instructions, labels


@dataclasses.dataclass(frozen=True)
class Loop:
  start: int  # the address of its first instruction
  end: int  # its backward branch's
  counts: dict[str, int]  # its instructions by kind, 'total' too
  opcodes: dict[str, int]  # by opcode root, most frequent first
  # Waits for products (WARPGROUP.DEPBAR) between its first product's issue and its last's: the
  # times the tensor cores may run dry within an iteration (one a product where ptxas serialises)
  product_waits: int


def loops(instructions: Sequence[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
  """(start, end) of each loop: a conditional branch back to an earlier address. ptxas lays a
  barrier wait's retry out of line, after the kernel's end, and jumps back from there
  unconditionally; those jumps close no loop of the program."""
  spans = []
  for instruction in instructions:
    target = _BRANCH_TARGET.search(instruction.text)
    if not (target and instruction.predicated and instruction.opcode.startswith('BRA')):
      continue
    start = labels.get(target.group(1))
    if start is not None and start <= instruction.address:
      spans.append((start, instruction.address))
  return spans


def hot_loops(instructions: Sequence[Instruction], labels: dict[str, int]) -> list[Loop]:
  """The innermost loops that issue tensor-core products, in address order."""

  def body(span):
    return [i for i in instructions if span[0] <= i.address <= span[1]]

  with_products = [
    s for s in loops(instructions, labels) if any(i.kind == 'product' for i in body(s))
  ]
  innermost = [
    s
    for s in with_products
    if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in with_products)
  ]
  result = []
  for span in sorted(set(innermost)):
    members = body(span)
    counts = collections.Counter(i.kind for i in members)
    counts['total'] = len(members)
    opcodes = collections.Counter(i.opcode.split('.', 1)[0] for i in members)
    products = [n for n, i in enumerate(members) if i.kind == 'product']
    waits = sum(
      i.opcode.startswith('WARPGROUP.DEPBAR') for i in members[products[0] : products[-1]]
    )
    result.append(Loop(span[0], span[1], dict(counts), dict(opcodes.most_common()), waits))
  return result


@dataclasses.dataclass(frozen=True)
class Resources:
  """What `ptxas -v` says of one kernel."""

  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  stack_bytes: int
  warnings: tuple[str, ...]


def parse_ptxas(text: str) -> Resources:
  def number(pattern: str) -> int:
    match = re.search(pattern, text)
    if match is None:
      raise ValueError(f'ptxas -v printed no {pattern!r}: {text[:400]}')
    return int(match.group(1))

  warnings = tuple(
    line.split(':', 1)[1].strip()
    for line in text.splitlines()
    if line.startswith('ptxas warning') or 'Potential Performance Loss' in line
  )
  return Resources(
    registers=number(r'Used (\d+) registers'),
    spill_store_bytes=number(r'(\d+) bytes spill stores'),
    spill_load_bytes=number(r'(\d+) bytes spill loads'),
    stack_bytes=number(r'(\d+) bytes stack frame'),
    warnings=warnings,
  )


def tool(name: str) -> str:
  """The path of a CUDA tool: PATH first, then NVIDIA's wheels (nvidia/cu13/bin)."""
  found = shutil.which(name)
  if found:
    return found
  for entry in sys.path:
    candidate = Path(entry) / 'nvidia' / 'cu13' / 'bin' / name
    if candidate.is_file():
      return str(candidate)
  wheel = {'nvdisasm': 'nvidia-cuda-nvdisasm', 'ptxas': 'nvidia-cuda-nvcc'}[name]
  raise SystemExit(
    f'{name} not found on PATH or in an NVIDIA wheel; install CUDA 13 or: pip install {wheel}'
  )


def compile_kernels(blocks: MosaicBlocks, seq: int, kind: str, dump_dir: Path) -> dict[str, Path]:
  """{kernel name: its PTX} of the attention's forward and backward, compiled for `kind` in a
  process whose environment asks Mosaic GPU to dump into dump_dir (`compile_in_child`'s)."""
  device = gpu_target.devices(kind, 1)[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  tokens = jax.ShapeDtypeStruct(
    (TOKENS // seq, seq, HEADS, HEAD_DIM), jnp.bfloat16, sharding=sharding
  )
  slopes = jax.ShapeDtypeStruct((HEADS,), jnp.float32, sharding=sharding)

  def loss(q, k, v, alibi_slopes):
    out = mosaic_attention(q, k, v, alibi_slopes=alibi_slopes, blocks=blocks, interpret=False)
    return out.astype(jnp.float32).sum()

  lowered = (
    jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    .trace(tokens, tokens, tokens, slopes)
    .lower(lowering_platforms=('cuda',))
  )
  gpu_target.compile_without_cache(lowered, kind)
  # Mosaic GPU dumps its passes' IR too (tens of MB a kernel): removed at once.
  for log in dump_dir.glob('*.mlir-passes.log'):
    log.unlink()
  return dumped_ptx(dump_dir)


def dumped_ptx(dump_dir: Path) -> dict[str, Path]:
  """{kernel name: its PTX} of what Mosaic GPU dumped into dump_dir."""
  ptx = {}
  for path in sorted(dump_dir.glob('*.ptx')):
    name = re.sub(r'_\d+$', '', path.stem)
    if name in ptx:
      raise RuntimeError(f'two kernels named {name} in {dump_dir}')
    ptx[name] = path
  if set(ptx) != set(KERNELS):
    raise RuntimeError(f'{dump_dir} holds the PTX of {sorted(ptx)}, not of {list(KERNELS)}')
  return ptx


def assemble(ptx: Path, arch: str) -> tuple[Resources, str]:
  """(ptxas -v's resources, nvdisasm's listing) of one kernel's PTX."""
  cubin = ptx.with_suffix('.cubin')
  ptxas = subprocess.run(
    [tool('ptxas'), f'-arch={arch}', '-v', str(ptx), '-o', str(cubin)],
    capture_output=True,
    text=True,
    check=True,
  )
  listing = subprocess.run(
    [tool('nvdisasm'), '-c', str(cubin)], capture_output=True, text=True, check=True
  ).stdout
  ptx.with_suffix('.sass').write_text(listing)
  return parse_ptxas(ptxas.stdout + ptxas.stderr), listing


def kernel_report(ptx: Path, arch: str) -> dict[str, Any]:
  resources, listing = assemble(ptx, arch)
  instructions, labels = parse_sass(listing)
  return {
    **dataclasses.asdict(resources),
    'instructions': len(instructions),
    'hot_loops': [dataclasses.asdict(loop) for loop in hot_loops(instructions, labels)],
  }


def compile_in_child(name: str, seq: int, kind: str, dump_dir: Path) -> dict[str, Path]:
  """`compile_kernels` of one candidate in a process of its own: Mosaic GPU compiles a kernel
  once a process, so a kernel that an earlier candidate shares would not be dumped again."""
  shutil.rmtree(dump_dir, ignore_errors=True)  # an earlier run's dumps
  dump_dir.mkdir(parents=True)
  command = [sys.executable, __file__, '--compile_only', name, '--seq', str(seq), '--gpu', kind]
  before = set(MOSAIC_TEMP.parent.glob(MOSAIC_TEMP.name))
  try:
    child = subprocess.run(
      [*command, '--keep', str(dump_dir)],
      capture_output=True,
      text=True,
      env=_child_environment(dump_dir),
    )
  finally:
    for left in set(MOSAIC_TEMP.parent.glob(MOSAIC_TEMP.name)) - before:
      if {p.name for p in left.iterdir()} <= {'kernel.bin'}:
        shutil.rmtree(left, ignore_errors=True)
  if child.returncode:
    raise RuntimeError(f'compiling {name} failed:\n{child.stderr[-3000:]}')
  return dumped_ptx(dump_dir)


def _child_environment(dump_dir: Path) -> dict[str, str]:
  """The child's: on the CPU, this script's folder importable, and Mosaic GPU asked to dump
  each kernel's PTX into dump_dir (it reads these as it compiles)."""
  here = str(Path(__file__).resolve().parent)
  path = os.environ.get('PYTHONPATH', '')
  return {
    **os.environ,
    'JAX_PLATFORMS': 'cpu',
    'PYTHONPATH': f'{here}:{path}' if path else here,
    'MOSAIC_GPU_DUMP_PTX': '1',
    'MOSAIC_GPU_DUMP_TO': str(dump_dir),
  }


def report(names: Sequence[str], seq: int, kind: str, keep: Path | None = None) -> dict:
  rows = []
  with tempfile.TemporaryDirectory(prefix='kernel_sass_') as scratch:
    root = keep or Path(scratch)
    for name in names:
      ptx = compile_in_child(name, seq, kind, root / name)
      kernels = {kernel: kernel_report(path, SM_ARCH) for kernel, path in ptx.items()}
      rows.append({'candidate': name, 'kernels': kernels})
  return {
    'gpu': kind,
    'arch': SM_ARCH,
    'seq': seq,
    'jax': jax.__version__,
    'ptxas': _version(tool('ptxas')),
    'rows': rows,
  }


def _version(path: str) -> str:
  out = subprocess.run([path, '--version'], capture_output=True, text=True).stdout
  match = re.search(r'release [\d.]+, V([\d.]+)', out)
  return match.group(1) if match else out.strip().splitlines()[-1]


def format_table(result: dict) -> str:
  lines = [
    f'{result["gpu"]} ({result["arch"]}), seq {result["seq"]}, jax {result["jax"]}, '
    f'ptxas {result["ptxas"]}',
    'hot loop: one iteration, instructions per thread by kind; waits: for products, among them',
    f'{"candidate":30s} {"kernel":18s} {"regs":>4s} {"spill":>7s} {"loop":>13s} '
    + ' '.join(f'{k:>7s}' for k in ('total', *TABLE_KINDS))
    + f' {"waits":>7s}',
  ]
  for row in result['rows']:
    for kernel, info in row['kernels'].items():
      spill = f'{info["spill_store_bytes"]}/{info["spill_load_bytes"]}'
      head = f'{row["candidate"]:30s} {kernel:18s} {info["registers"]:4d} {spill:>7s}'
      for loop in info['hot_loops'] or [None]:
        if loop is None:
          lines.append(f'{head} {"(none)":>13s}')
          continue
        span = f'{loop["start"]:#06x}-{loop["end"]:#06x}'
        counts = ' '.join(f'{loop["counts"].get(k, 0):7d}' for k in ('total', *TABLE_KINDS))
        lines.append(f'{head} {span:>13s} {counts} {loop["product_waits"]:7d}')
        head = ' ' * len(head)
      for warning in info['warnings']:
        lines.append(f'{"":30s} ptxas: {warning}')
  return '\n'.join(lines)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n', 1)[0])
  parser.add_argument('--only', default='', help='candidates, comma-separated (default: all)')
  parser.add_argument('--seq', type=int, default=4096)
  parser.add_argument('--gpu', default='h100-80gb', choices=HOPPER_KINDS)
  parser.add_argument('--json', type=Path, help='write the report here too')
  parser.add_argument('--keep', type=Path, help='keep the PTX, cubins and listings here')
  parser.add_argument('--compile_only', help=argparse.SUPPRESS)  # one candidate, into --keep
  args = parser.parse_args(argv)
  names = [n for n in args.only.split(',') if n] or list(mosaic_sweep.CANDIDATES)
  for name in names:
    mosaic_sweep.blocks_of(name)  # an unknown name is refused before any compile
  if TOKENS % args.seq or args.seq % 256:
    parser.error(f'--seq {args.seq}: it must be a multiple of 256 that divides {TOKENS}')
  args.names = names
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.compile_only:
    compile_kernels(mosaic_sweep.blocks_of(args.compile_only), args.seq, args.gpu, args.keep)
    return 0
  tool('ptxas'), tool('nvdisasm')  # both found before any compile
  result = report(args.names, args.seq, args.gpu, args.keep)
  print(format_table(result))
  if args.json:
    args.json.write_text(json.dumps(result, indent=1))
  return 0


if __name__ == '__main__':
  sys.exit(main())
