"""The flash-attention kernels lower to valid Triton IR for CUDA, checked without a GPU.

Interpret mode (test_flash_attention.py) checks what the kernels compute; it cannot see what only
the Triton lowering rejects (non-power-of-two arrays, ops without a Triton rule, ill-typed Triton
ops). Here forward + backward are lowered for CUDA on this CPU machine and every Triton module is
parsed and verified with Triton's MLIR dialect. PTX compilation and the run need a GPU
(`benchmarks/attention.py`, docs/benchmarks.md).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from t5x_like.kernels import BlockSizes
from t5x_like.kernels.triton_lowering import flash_attention_kernels, lower_for_cuda, triton_kernels

KERNELS = ('flash_attention_forward', 'flash_attention_dkdv', 'flash_attention_dq')


@pytest.mark.parametrize(
  'seq, heads, head_dim, dtype, causal, segments, alibi',
  [
    pytest.param(2048, 16, 128, jnp.bfloat16, True, False, True, id='benchmark-shape-bf16-d128'),
    pytest.param(2000, 3, 64, jnp.float16, True, True, True, id='tail-fp16-d64-segments'),
    pytest.param(300, 5, 128, jnp.float32, False, True, False, id='fp32-noncausal-no-alibi'),
    pytest.param(96, 2, 256, jnp.bfloat16, True, False, True, id='d256-short-seq'),
  ],
)
def test_forward_and_backward_lower_to_verified_triton(
  seq, heads, head_dim, dtype, causal, segments, alibi
):
  batch = 2
  kernels = flash_attention_kernels(
    batch=batch,
    seq=seq,
    heads=heads,
    head_dim=head_dim,
    dtype=dtype,
    causal=causal,
    alibi=alibi,
    segments=segments,
  )
  assert sorted(k.name for k in kernels) == sorted(KERNELS)
  assert all(k.verified for k in kernels)
  # The launch grids are (blocks along the sequence, batch, heads), with the tiles the kernels
  # were configured with, fitted to the sequence and padded up to the largest block.
  blocks = BlockSizes.for_head_dim(head_dim).fitted_to(seq)
  padded = -(-seq // max(blocks.blocks())) * max(blocks.blocks())
  grids = {k.name: k.grid for k in kernels}
  assert grids['flash_attention_forward'] == (padded // blocks.block_q, batch, heads)
  assert grids['flash_attention_dkdv'] == (padded // blocks.block_k_dkv, batch, heads)
  assert grids['flash_attention_dq'] == (padded // blocks.block_q_dq, batch, heads)
  expected_warps = blocks.num_warps or (4 if head_dim <= 64 else 8)
  assert {k.num_warps for k in kernels} == {expected_warps}
  forward = next(k for k in kernels if k.name == 'flash_attention_forward').triton_ir
  assert 'tt.dot' in forward and 'tt.func public @flash_attention_forward' in forward


def test_a_kernel_that_only_interpret_mode_accepts_is_caught():
  """A 24 x 24 tile runs in interpret mode but Triton needs power-of-two arrays."""

  def square(x_ref, o_ref):
    o_ref[...] = plgpu.dot(x_ref[...], x_ref[...])

  def call(x, interpret=False):
    return pl.pallas_call(
      square,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=plgpu.CompilerParams(),
      interpret=interpret,
    )(x)

  x = jnp.ones((24, 24), jnp.float32)
  assert float(call(x, interpret=True)[0, 0]) == 24.0
  with pytest.raises(ValueError, match='power of 2'):
    lower_for_cuda(call, x)
  # The same kernel on a 32 x 32 tile lowers and verifies.
  ok = triton_kernels(lower_for_cuda(call, jnp.ones((32, 32), jnp.float32)))
  assert [k.verified for k in ok] == [True]
