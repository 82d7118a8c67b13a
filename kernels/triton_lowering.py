"""Lower the Pallas kernels to CUDA's Triton IR on any machine, and verify that IR.

A GPU is only needed to compile Triton IR to PTX and run it. Lowering a function for CUDA
(`jit(f).trace(...).lower(lowering_platforms=('cuda',))`) runs the whole Pallas -> Triton
lowering on a CPU-only machine (a login node, CI); every Pallas kernel becomes an
`__gpu$xla.gpu.triton` custom call that carries its Triton module as MLIR bytecode. This module
extracts those modules, parses them with the Triton dialect and runs MLIR's verifier, which
catches what interpret mode cannot: ops the Triton lowering rejects, tile shapes Triton's `dot`
refuses, mismatched types between Triton ops.

    python -m t5x_like.kernels.triton_lowering --seq 2048 --heads 16 --head_dim 128

prints one line per kernel (name, launch grid, warps, stages, verified) for the forward and the
backward pass, and exits 1 if any module fails to verify.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib import triton as jax_triton
from jax._src.lib.mlir import ir

TRITON_CALL_TARGET = '__gpu$xla.gpu.triton'


@dataclasses.dataclass(frozen=True)
class TritonKernel:
  """One Pallas kernel as lowered for CUDA."""

  name: str
  grid: tuple[int, int, int]
  num_warps: int
  num_stages: int
  triton_ir: str  # the Triton module, as MLIR text
  verified: bool  # MLIR's verifier accepted the module


def lower_for_cuda(fn, *args) -> ir.Module:
  """The StableHLO module of jit(fn)(*args) lowered for CUDA (args may be ShapeDtypeStructs)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=('cuda',)).compiler_ir('stablehlo')


def triton_kernels(module: ir.Module) -> list[TritonKernel]:
  """Every Triton kernel in a module lowered for CUDA, parsed and verified with Triton's dialect."""
  kernels = []
  context = jax_mlir.make_ir_context()
  jax_triton.dialect.register_dialect(context)
  for op in _triton_calls(module.operation):
    config = ir.DictAttr(op.attributes['mhlo.backend_config'])
    integer = lambda key: ir.IntegerAttr(config[key]).value
    with context:
      triton_module = ir.Module.parse(ir.StringAttr(config['ir']).value_bytes)
      verified = bool(triton_module.operation.verify())
      kernels.append(
        TritonKernel(
          name=ir.StringAttr(config['name']).value,
          grid=(integer('grid_x'), integer('grid_y'), integer('grid_z')),
          num_warps=integer('num_warps'),
          num_stages=integer('num_stages'),
          triton_ir=str(triton_module),
          verified=verified,
        )
      )
  return kernels


def _triton_calls(operation):
  for region in operation.regions:
    for block in region.blocks:
      for op in block.operations:
        op = op.operation
        if (
          op.name == 'stablehlo.custom_call'
          and ir.StringAttr(op.attributes['call_target_name']).value == TRITON_CALL_TARGET
        ):
          yield op
        yield from _triton_calls(op)


def flash_attention_kernels(
  *,
  batch: int,
  seq: int,
  heads: int,
  head_dim: int,
  dtype,
  causal: bool = True,
  alibi: bool = True,
  segments: bool = False,
  block_sizes=None,
) -> list[TritonKernel]:
  """The forward and backward flash-attention kernels of one shape, lowered for CUDA."""
  from t5x_like.kernels.flash_attention import flash_attention

  x = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), dtype)
  segment_ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32) if segments else None
  slopes = jnp.linspace(0.5, 0.01, heads) if alibi else None

  def loss(q, k, v, segment_ids):
    out = flash_attention(
      q, k, v, alibi_slopes=slopes, causal=causal, segment_ids=segment_ids, block_sizes=block_sizes
    )
    return out.astype(jnp.float32).sum()

  grads = jax.value_and_grad(loss, argnums=(0, 1, 2))
  return triton_kernels(lower_for_cuda(grads, x, x, x, segment_ids))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--heads', type=int, default=16)
  parser.add_argument('--head_dim', type=int, default=128)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--no_causal', action='store_true')
  parser.add_argument('--segments', action='store_true')
  args = parser.parse_args(argv)
  kernels = flash_attention_kernels(
    batch=args.batch,
    seq=args.seq,
    heads=args.heads,
    head_dim=args.head_dim,
    dtype=jnp.dtype(args.dtype),
    causal=not args.no_causal,
    segments=args.segments,
  )
  for kernel in kernels:
    print(
      f'{kernel.name:<28} grid={kernel.grid} warps={kernel.num_warps} '
      f'stages={kernel.num_stages} verified={kernel.verified}'
    )
  return 0 if kernels and all(k.verified for k in kernels) else 1


if __name__ == '__main__':
  sys.exit(main())
