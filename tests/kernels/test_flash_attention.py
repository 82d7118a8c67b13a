"""Pallas flash attention against the plain-JAX reference: compiled through Triton on a GPU, in
interpret mode on CPU (the same kernel bodies run through XLA).

Each case jits the kernel's forward and its vjp (the Pallas dQ and dK/dV kernels) once; 16-row
tiles keep several blocks per sequence so block skipping, tails and the online softmax all run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.kernels import (
  BlockSizes,
  FlashAttentionConstraintError,
  attention_reference,
  flash_attention,
)
from t5x_like.model.transformer import alibi_slopes

SMALL = BlockSizes(
  block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16
)
# Unequal tiles: the causal ranges must still cover exactly the diagonal band.
UNEQUAL = BlockSizes(
  block_q=32, block_k=16, block_q_dkv=16, block_k_dkv=32, block_q_dq=32, block_k_dq=16
)
# max |error| / max |reference| per output; bf16 inputs are compared with the fp32 reference.
TOLERANCE = {'float32': 2e-5, 'bfloat16': 2.5e-2}
# The GPU suite (docs/tests.md) runs this file on a GPU: the Triton kernels themselves.
INTERPRET = jax.default_backend() == 'cpu'


def inputs(batch, seq, heads, head_dim, dtype, segments, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k, v, do = (
    jax.random.normal(key, (batch, seq, heads, head_dim), jnp.float32) for key in keys[:4]
  )
  segment_ids = None
  if segments:
    # Packed documents of random lengths: a boundary every ~seq/3 tokens, different per row.
    starts = jax.random.bernoulli(keys[4], 3.0 / seq, (batch, seq)).astype(jnp.int32)
    segment_ids = jnp.cumsum(starts, axis=1)
  cast = lambda x: x.astype(dtype)
  return cast(q), cast(k), cast(v), do, segment_ids


def assert_close(actual, expected, tolerance, what):
  actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
  assert np.isfinite(actual).all(), f'{what}: non-finite values'
  error = np.abs(actual - expected).max() / np.abs(expected).max()
  print(f'{what}: max error / max reference {error:.2e}')  # the GPU suite's log keeps these
  assert error <= tolerance, f'{what}: relative error {error:.2e} > {tolerance:.0e}'


CASES = [
  # batch, seq, heads, head_dim, causal, segments, alibi, dtype, blocks (sm_scale 0.3 where
  # the slopes are off: the default 1/sqrt(head_dim) is everywhere else). 'tail': seq is not a
  # multiple of the largest block; 64 and 96 are.
  pytest.param(2, 50, 3, 64, True, False, True, 'float32', SMALL, id='3-heads-tail'),
  pytest.param(1, 45, 6, 16, False, False, False, 'float32', SMALL, id='noncausal-tail-scale'),
  pytest.param(2, 48, 3, 16, True, True, True, 'float32', SMALL, id='segments-causal'),
  pytest.param(1, 40, 4, 16, False, True, True, 'float32', SMALL, id='segments-noncausal-tail'),
  pytest.param(1, 96, 2, 16, True, False, True, 'float32', UNEQUAL, id='pow2-heads-unequal'),
  pytest.param(1, 70, 3, 16, False, True, True, 'float32', UNEQUAL, id='unequal-blocks-segments'),
  pytest.param(1, 64, 2, 128, True, True, True, 'bfloat16', SMALL, id='bf16-d128-segments'),
  pytest.param(2, 37, 5, 64, False, False, True, 'bfloat16', SMALL, id='bf16-noncausal-tail'),
  pytest.param(1, 24, 4, 32, True, False, True, 'float32', None, id='default-blocks-short-seq'),
]


@pytest.mark.parametrize(
  'batch, seq, heads, head_dim, causal, segments, alibi, dtype, blocks', CASES
)
def test_forward_and_gradients_match_the_reference(
  batch, seq, heads, head_dim, causal, segments, alibi, dtype, blocks
):
  q, k, v, do, segment_ids = inputs(batch, seq, heads, head_dim, jnp.dtype(dtype), segments)
  slopes = alibi_slopes(heads) if alibi else None
  sm_scale = None if alibi else 0.3

  def kernel(q, k, v):
    return flash_attention(
      q,
      k,
      v,
      alibi_slopes=slopes,
      causal=causal,
      segment_ids=segment_ids,
      sm_scale=sm_scale,
      block_sizes=blocks,
      interpret=INTERPRET,
    )

  def reference(q, k, v):
    return attention_reference(
      q, k, v, alibi_slopes=slopes, causal=causal, segment_ids=segment_ids, sm_scale=sm_scale
    )

  def out_and_grads(f, q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do.astype(out.dtype)))

  got = jax.jit(lambda q, k, v: out_and_grads(kernel, q, k, v))(q, k, v)
  f32 = lambda x: x.astype(jnp.float32)
  want = jax.jit(lambda q, k, v: out_and_grads(reference, q, k, v))(f32(q), f32(k), f32(v))
  for name, a, b in zip(('out', 'dq', 'dk', 'dv'), got, want):
    assert a.dtype == q.dtype, name
    assert_close(a, b, TOLERANCE[dtype], name)


def test_causal_blocks_above_the_diagonal_are_never_read():
  """Keys and values past the first 16-row block are NaN: rows 0-15 only stay finite (in the output
  and in dQ) if no program of theirs touches a tile above the diagonal."""
  q, k, v, do, _ = inputs(1, 64, 2, 16, jnp.float32, False)
  poison = lambda x: x.at[:, 16:].set(jnp.nan)
  k, v = poison(k), poison(v)

  def run(q, k, v):
    attend = lambda q, k, v: flash_attention(q, k, v, block_sizes=SMALL, interpret=INTERPRET)
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(do)[0]

  out, dq = jax.jit(run)(q, k, v)
  assert np.isfinite(np.asarray(out[:, :16])).all()
  assert np.isfinite(np.asarray(dq[:, :16])).all()
  want = attention_reference(q[:, :16], k[:, :16], v[:, :16])
  np.testing.assert_allclose(out[:, :16], want, atol=2e-6)


def test_block_sizes_shrink_to_short_sequences():
  fitted = BlockSizes.for_head_dim(128).fitted_to(40)
  assert fitted.blocks() == (64,) * 6
  assert BlockSizes.for_head_dim(64).fitted_to(3).blocks() == (16,) * 6
  assert BlockSizes.for_head_dim(128).fitted_to(4096) == BlockSizes.for_head_dim(128)


@pytest.mark.parametrize(
  'shape, dtype, kwargs, constraint',
  [
    ((1, 32, 2, 8), jnp.float32, {}, 'head_dim must be one of'),
    ((1, 32, 2, 96), jnp.float32, {}, 'head_dim must be one of'),
    ((1, 32, 2, 16), jnp.int32, {}, 'dtype must be one of'),
    ((1, 32, 2, 16), jnp.float32, {'alibi_slopes': np.ones(3)}, 'alibi_slopes must have shape'),
    (
      (1, 32, 2, 16),
      jnp.float32,
      {'segment_ids': jnp.zeros((1, 31), jnp.int32)},
      'segment_ids must be integers of shape',
    ),
    (
      (1, 32, 2, 16),
      jnp.float32,
      {'block_sizes': BlockSizes(block_q=24)},
      'block sizes must be powers of two',
    ),
  ],
)
def test_unsupported_inputs_name_the_constraint(shape, dtype, kwargs, constraint):
  x = jnp.zeros(shape, dtype)
  with pytest.raises(FlashAttentionConstraintError, match=constraint):
    flash_attention(x, x, x, interpret=INTERPRET, **kwargs)


def test_q_k_v_must_match():
  q = jnp.zeros((1, 32, 2, 16))
  with pytest.raises(FlashAttentionConstraintError, match='same shape'):
    flash_attention(q, q[:, :16], q[:, :16], interpret=INTERPRET)
