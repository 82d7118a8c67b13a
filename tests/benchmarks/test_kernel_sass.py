"""benchmarks/kernel_sass.py: the Mosaic GPU kernels' machine code, read without a GPU.

The compile test runs what a GPU session would (XLA's CUDA compiler for an abstract H100, ptxas
on each kernel, nvdisasm on the result): the machine's CUDA ptxas, the test extras' nvdisasm.
"""

import json
import os
import sys

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


def test_bias_in_product_takes_the_alibi_rows_work_out_of_the_forwards_loop(tmp_path, capsys):
  """The forward compiled for an H100 (ptxas's machine code): with bias_in_product the hot loop
  issues one more product (the ALiBi row's, 9 for Q K^T instead of 8), loads no ALiBi row from
  shared memory, and does at least 60 fewer float32 instructions a key tile (a thread's 64
  scores: the row's add), and neither forward spills. The backward kernels are the same."""
  out = tmp_path / 'sass.json'
  assert (
    kernel_sass.main(['--only', 'default,bias_in_product', '--seq', '2048', '--json', str(out)])
    == 0
  )
  table = capsys.readouterr().out
  assert 'attention_forward' in table and 'bias_in_product' in table
  report = json.loads(out.read_text())
  assert report['arch'] == 'sm_90a' and report['seq'] == 2048
  default, in_product = (
    {r['candidate']: r['kernels'] for r in report['rows']}[n]
    for n in (
      'default',
      'bias_in_product',
    )
  )
  assert set(default) == set(in_product) == set(kernel_sass.KERNELS)
  for forward in (default['attention_forward'], in_product['attention_forward']):
    assert forward['spill_store_bytes'] == forward['spill_load_bytes'] == 0, forward
    assert forward['hot_loops'], forward
    assert all(loop['counts'].get('local', 0) == 0 for loop in forward['hot_loops'])
  # The first hot loop is the unmasked key tiles' (the masked one, the diagonal, comes after).
  before = default['attention_forward']['hot_loops'][0]['counts']
  after = in_product['attention_forward']['hot_loops'][0]['counts']
  assert (before['product'], after['product']) == (16, 17)
  assert before['shared'] > 0 and after.get('shared', 0) == 0
  assert after['fp32'] <= before['fp32'] - 60, (before, after)
  for kernel in ('attention_dq', 'attention_dkv'):
    assert default[kernel]['hot_loops'] == in_product[kernel]['hot_loops']
