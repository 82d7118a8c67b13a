"""benchmarks/kernel_sass.py: the Mosaic GPU kernels' machine code, read without a GPU.

The compile tests run what a GPU session would (XLA's CUDA compiler for an abstract H100, ptxas
on each kernel, nvdisasm on the result): the machine's CUDA ptxas, the test extras' nvdisasm.
"""

import contextlib
import io
import json
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import kernel_sass  # noqa: E402  (a script, not a package module)

# A kernel's shape in nvdisasm's listing: a loop (0x20-0x80) issuing a product inside an outer
# loop, a loop without products (0xa0-0xb0), an epilogue product outside any loop (0xc0), and a
# barrier wait's retry laid out after the end, whose unconditional jump back (0xf0) closes no loop.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R6 ;
        /*0040*/              @!P1 BRA `(.L_x_9) ;
.L_x_2:
        /*0050*/                   FFMA R3, R24, 0.5, R4 ;
        /*0060*/                   MUFU.EX2 R3, R3 ;
        /*0070*/                   LDL R5, [R1] ;
        /*0080*/               @P0 BRA `(.L_x_1) ;
        /*0090*/               @P2 BRA `(.L_x_0) ;
.L_x_3:
        /*00a0*/                   FADD R1, R1, R1 ;
        /*00b0*/               @P3 BRA `(.L_x_3) ;
        /*00c0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*00d0*/                   EXIT ;
.L_x_9:
        /*00e0*/                   SYNCS.PHASECHK.TRANS64 P1, [UR5], R6 ;
        /*00f0*/                   BRA `(.L_x_2) ;
"""


def test_hot_loops_are_the_innermost_loops_that_issue_products():
  instructions, labels = kernel_sass.parse_sass(LISTING)
  assert len(instructions) == 16 and labels['.L_x_9'] == 0xE0
  assert kernel_sass.loops(instructions, labels) == [(0x20, 0x80), (0x10, 0x90), (0xA0, 0xB0)]
  (loop,) = kernel_sass.hot_loops(instructions, labels)
  assert (loop.start, loop.end) == (0x20, 0x80)
  assert loop.counts == {
    'product': 1,
    'sync': 1,
    'branch': 2,
    'fp32': 1,
    'exp2': 1,
    'local': 1,
    'total': 7,
  }
  assert loop.opcodes['BRA'] == 2
  assert loop.product_waits == 0  # one product: nothing issued after a wait


def test_waits_among_products_are_counted():
  """A wait between two products of an iteration counts; one after its last does not."""
  listing = """
.L_x_1:
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0020*/                   MUFU.EX2 R3, R24 ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR8], R88, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0050*/               @P0 BRA `(.L_x_1) ;
"""
  (loop,) = kernel_sass.hot_loops(*kernel_sass.parse_sass(listing))
  assert loop.product_waits == 1


def test_ptxas_resources_and_warnings_are_read():
  text = (
    "ptxas warning : Registers are spilled to local memory in function 'k', 12 bytes spill "
    'stores, 24 bytes spill loads\n'
    "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
    '    16 bytes stack frame, 12 bytes spill stores, 24 bytes spill loads\n'
    'ptxas info    : Used 168 registers, used 16 barriers, 16 bytes cumulative stack size\n'
  )
  resources = kernel_sass.parse_ptxas(text)
  assert (resources.registers, resources.spill_store_bytes, resources.spill_load_bytes) == (
    168,
    12,
    24,
  )
  assert resources.stack_bytes == 16
  assert resources.warnings == (
    "Registers are spilled to local memory in function 'k', 12 bytes spill stores, 24 bytes "
    'spill loads',
  )


# The candidates the compile tests read, compiled once (about 9 s each).
COMPILED = (
  'default',
  'bias_in_product',
  'bias_in_product_copy24',
  'paired_turns',
  'paired_turns_bias_in_product',
)


@pytest.fixture(scope='module')
def compiled(tmp_path_factory):
  """(kernel_sass.py's table and JSON report of COMPILED at seq 2048, the /tmp/mosaic-gpu-*
  folders that were there before and are there after)."""
  temp = kernel_sass.MOSAIC_TEMP
  before = set(temp.parent.glob(temp.name))
  out = tmp_path_factory.mktemp('sass') / 'sass.json'
  table = io.StringIO()
  with contextlib.redirect_stdout(table):
    status = kernel_sass.main(['--only', ','.join(COMPILED), '--seq', '2048', '--json', str(out)])
  assert status == 0
  after = set(temp.parent.glob(temp.name))
  return table.getvalue(), json.loads(out.read_text()), (before, after)


def test_bias_in_product_takes_the_alibi_rows_work_out_of_the_kernels_loops(compiled):
  """The kernels compiled for an H100 (ptxas's machine code): with bias_in_product each one's
  unmasked loop (the shorter of its two hot loops: the diagonal's builds its mask) issues one
  more product (the ALiBi rows'), loads no ALiBi row from shared memory, and does a float32
  instruction less for each of a thread's scores: at least 60 of the forward's 64 (64 x 128
  tiles), 30 of the backward's 32 (64 x 64). Neither forward spills. With copy_registers=24 the
  math warpgroups' 240 registers keep dK/dV's loops free of local memory (at 232 its masked loop
  spills), with fewer bytes spilled in all. Mosaic GPU's binaries are not left in /tmp."""
  table, report, (before, after) = compiled
  assert after <= before
  assert 'attention_forward' in table and 'bias_in_product_copy24' in table
  names = 'default,bias_in_product,bias_in_product_copy24'
  assert report['arch'] == 'sm_90a' and report['seq'] == 2048
  rows = {row['candidate']: row['kernels'] for row in report['rows']}
  default, in_product, lean = (rows[name] for name in names.split(','))
  assert set(default) == set(in_product) == set(lean) == set(kernel_sass.KERNELS)
  for forward in (default['attention_forward'], in_product['attention_forward']):
    assert forward['spill_store_bytes'] == forward['spill_load_bytes'] == 0, forward
    assert forward['hot_loops'], forward
    assert all(loop['counts'].get('local', 0) == 0 for loop in forward['hot_loops'])
  # kernel: (its products a tile by default, float32 instructions it saves at least)
  expected = {'attention_forward': (16, 60), 'attention_dq': (20, 30), 'attention_dkv': (24, 30)}
  for kernel, (products, saved) in expected.items():
    before, after = unmasked_loop(default[kernel]), unmasked_loop(in_product[kernel])
    assert (before['product'], after['product']) == (products, products + 1), kernel
    assert after['fp32'] <= before['fp32'] - saved, (kernel, before, after)
  for kernel in ('attention_forward', 'attention_dq'):  # dK/dV reads its rows once a program
    before, after = unmasked_loop(default[kernel]), unmasked_loop(in_product[kernel])
    assert before['shared'] > 0 and after.get('shared', 0) == 0, kernel
  lean_dkv, dkv = lean['attention_dkv'], in_product['attention_dkv']
  assert all(loop['counts'].get('local', 0) == 0 for loop in lean_dkv['hot_loops']), lean_dkv
  assert lean_dkv['spill_store_bytes'] < dkv['spill_store_bytes'], (lean_dkv, dkv)


def test_paired_turns_issue_both_products_of_a_turn_without_a_wait(compiled):
  """The forward compiled for an H100: by default each iteration of its unmasked loop waits for
  its Q K^T before it issues the P V; with paired_turns (FlashAttention-3's turns) a turn's Q K^T
  and P V go to the tensor cores back to back, with the ALiBi rows' product too, and ptxas
  serialises none of them (it warns where it does, and then waits after every product)."""
  names = 'default,paired_turns,paired_turns_bias_in_product'
  rows = {row['candidate']: row['kernels'] for row in compiled[1]['rows']}
  forwards = {name: rows[name]['attention_forward'] for name in names.split(',')}
  waits = {name: unmasked_loop(kernel, 'product_waits') for name, kernel in forwards.items()}
  assert waits == {'default': 1, 'paired_turns': 0, 'paired_turns_bias_in_product': 0}, waits
  for name, kernel in forwards.items():
    assert not [w for w in kernel['warnings'] if 'serialized' in w], (name, kernel['warnings'])
  products = {name: unmasked_loop(kernel)['product'] for name, kernel in forwards.items()}
  assert products == {'default': 16, 'paired_turns': 16, 'paired_turns_bias_in_product': 17}


def unmasked_loop(kernel: dict, field: str = 'counts'):
  """`field` of a kernel's unmasked loop (the shorter of its two hot loops): by default its
  instruction counts."""
  assert len(kernel['hot_loops']) == 2, kernel['hot_loops']
  return min(kernel['hot_loops'], key=lambda loop: loop['counts']['total'])[field]
