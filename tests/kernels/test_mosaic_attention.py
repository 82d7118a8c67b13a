"""model.attention_impl='mosaic': the Mosaic GPU flash-attention kernels for Hopper.

On CPU the kernels run in Mosaic GPU's interpret mode (shared memory, TMA copies, barriers and
warpgroups simulated; the tile matmuls as XLA dots, kernels/mosaic_attention.py says why) and
their GPU path is lowered for CUDA (not run); the GPU suite runs this file on a GPU, where the
same cases compile and run the real kernels.
"""

import dataclasses
import importlib
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir as mlir_ir
from jax.interpreters import mlir as jax_mlir
from test_flash_attention import TOLERANCE, inputs
from test_model_integration import check_bf16_model_against_xla
from test_tokamax_attention import A100, H100, LARGE_SLOPE, check_against_reference

from t5x_like.config import ConfigError, ModelConfig
from t5x_like.kernels import MosaicAttentionConstraintError, MosaicBlocks, mosaic_attention
from t5x_like.kernels.mosaic_attention import (
  forward_item_order,
  heaviest_first,
  unmet_constraints,
)
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib
from t5x_like.model.attention import Device
from t5x_like.model.transformer import alibi_slopes

INTERPRET = jax.default_backend() == 'cpu'
# The module (the package exports its function under the same name).
mosaic_attention_module = importlib.import_module('t5x_like.kernels.mosaic_attention')
# 64-row tiles everywhere: in both kernels' programs the two warpgroups need different numbers of
# tiles (the forward's and dQ's first warpgroup stops a key tile early, dK/dV's second starts a
# query tile late), so the drain and skip loops run.
SMALL = MosaicBlocks(block_q=64, block_kv=64, block_kv_dkv=64, block_kv_dq=64)
ONE_WARPGROUP = MosaicBlocks(compute_wgs=1, block_kv=64)
# The options of the kernels (MosaicBlocks' docstring) on top of SMALL's unequal warpgroups. At seq
# 256 the persistent forward has 4 items (2 query tiles x 2 heads) for INTERPRET_PROGRAMS = 3
# programs: the first runs two (4 key tiles, then 2 from the key ring's second slot of 3), the
# others one each. (no_auto_barriers changes only the compiled kernels: on a GPU this case runs
# the persistent forward, whose output buffer is reused, without Mosaic GPU's own barriers.)
OPTIONS = dataclasses.replace(
  SMALL,
  stages=3,
  persistent=True,
  early_handoff=True,
  paired_backward=True,
  no_auto_barriers=True,
)
# tokamax's order of the hand-over and the refills, on the same items and ring; and its 0.0.17
# form, a turn barrier per warpgroup, on SMALL's unequal warpgroups (their drain keeps turns).
ISSUE_HANDOFF = dataclasses.replace(SMALL, stages=3, persistent=True, issue_handoff=True)
OWN_TURNS = dataclasses.replace(SMALL, issue_handoff=True, own_turn_barriers=True)
# FlashAttention-3's intra-warpgroup overlap on SMALL's unequal warpgroups, in a ring of 3: each
# key tile's softmax and P V beneath the next tile's Q K^T, the diagonal tile's alone, the drain.
INTRA_OVERLAP = dataclasses.replace(SMALL, stages=3, intra_overlap=True)
# FlashAttention-3's turns on SMALL's unequal warpgroups in the default ring of 2: each key tile's
# Q K^T issued with the previous tile's P V, the first tile's Q K^T and the last one's P V in
# turns of their own, the drain's turns (a turn left out deadlocks here; a P V of the wrong tile,
# or of an accumulator not rescaled for it, fails).
PAIRED_TURNS = dataclasses.replace(SMALL, paired_turns=True)
# And in persistent programs, on ISSUE_HANDOFF's items and ring: the turns go on across items.
PAIRED_TURNS_PERSISTENT = dataclasses.replace(SMALL, stages=3, persistent=True, paired_turns=True)
# The ALiBi rows added by the tensor cores, on SMALL's unequal warpgroups; and with the persistent
# forward's tokamax order (its ones are copied once a program, not once an item) and the paired
# backward products (dQ's Q K^T and the rows' product issued with dO V^T).
BIAS_IN_PRODUCT = dataclasses.replace(SMALL, bias_in_product=True)
BIAS_IN_PRODUCT_PAIRED = dataclasses.replace(
  ISSUE_HANDOFF, bias_in_product=True, paired_backward=True
)
B200 = Device('gpu', 'NVIDIA B200', '10.0')


@pytest.mark.parametrize(
  'seq, head_dim, dtype, alibi, blocks',
  [
    pytest.param(256, 64, 'bfloat16', True, SMALL, id='unequal-warpgroups'),
    # 200 is padded to the default blocks' multiple, 128 (ALiBi's slopes are BLOOM's for 2
    # heads; LARGE_SLOPE is BLOOM-176B's first).
    pytest.param(200, 64, 'float16', True, None, id='default-blocks-tail'),
    pytest.param(128, 128, 'bfloat16', False, ONE_WARPGROUP, id='one-warpgroup-d128-no-alibi'),
    pytest.param(256, 64, 'bfloat16', True, OPTIONS, id='persistent-early-handoff-paired'),
    pytest.param(256, 64, 'bfloat16', True, ISSUE_HANDOFF, id='persistent-issue-handoff'),
    pytest.param(
      200, 64, 'bfloat16', True, MosaicBlocks(issue_handoff=True), id='issue-handoff-tail'
    ),
    pytest.param(256, 64, 'bfloat16', True, OWN_TURNS, id='own-turn-barriers'),
    pytest.param(256, 64, 'bfloat16', True, INTRA_OVERLAP, id='intra-overlap'),
    pytest.param(256, 64, 'bfloat16', True, PAIRED_TURNS, id='paired-turns'),
    pytest.param(256, 64, 'bfloat16', True, PAIRED_TURNS_PERSISTENT, id='paired-turns-persistent'),
    pytest.param(256, 64, 'bfloat16', True, BIAS_IN_PRODUCT, id='bias-in-product'),
    pytest.param(
      256, 64, 'bfloat16', True, BIAS_IN_PRODUCT_PAIRED, id='bias-in-product-persistent-paired'
    ),
  ],
)
def test_forward_and_gradients_match_the_reference(seq, head_dim, dtype, alibi, blocks):
  q, k, v, do, _ = inputs(1, seq, 2, head_dim, jnp.dtype(dtype), segments=False)
  slopes = np.array([LARGE_SLOPE, 0.5], np.float32) if alibi else None

  def kernel(q, k, v):
    return mosaic_attention(q, k, v, alibi_slopes=slopes, blocks=blocks, interpret=INTERPRET)

  check_against_reference(kernel, q, k, v, do, slopes, TOLERANCE['bfloat16'])


def test_the_kernels_fail_a_wrong_alibi_row():
  """The check above sees ALiBi: with the slopes of the heads swapped, it fails."""
  q, k, v, do, _ = inputs(1, 128, 2, 64, jnp.bfloat16, segments=False)
  slopes = np.array([LARGE_SLOPE, 0.0625], np.float32)

  def swapped(q, k, v):
    return mosaic_attention(q, k, v, alibi_slopes=slopes[::-1], interpret=INTERPRET)

  with pytest.raises(AssertionError, match='relative error'):
    check_against_reference(swapped, q, k, v, do, slopes, TOLERANCE['bfloat16'])


def test_a_cpu_mesh_is_refused_with_the_reason():
  """Interpret mode simulates one GPU: per shard of a CPU mesh its kernels would run at once and
  deadlock in the simulation, so the model says so instead (on GPUs the shards are the
  `_per_shard` of every fused implementation, tested with tokamax and pallas)."""
  # CPU devices named explicitly: the GPU suite runs this file with CPU devices beside the GPU.
  cpus = np.array(jax.devices('cpu')[:4]).reshape(2, 1, 2)
  mesh = jax.sharding.Mesh(cpus, partitioning.MESH_AXES)
  x = jnp.zeros((2, 40, 4, 64), jnp.bfloat16)
  cfg = ModelConfig(hidden_size=256, num_heads=4, dtype='bfloat16', attention_impl='mosaic')
  with pytest.raises(ConfigError, match='cannot run per shard of a 4-device mesh'):
    attention_lib.attention(x, x, x, cfg=cfg, mesh=mesh, alibi_slopes=alibi_slopes(4))


def test_remat_with_interpret_mode_is_a_config_error():
  cfg = ModelConfig(
    hidden_size=256, num_heads=4, dtype='bfloat16', attention_impl='mosaic', remat_policy='full'
  )
  with pytest.raises(ConfigError, match="model.remat_policy='full' needs 'none' there"):
    attention_lib.choose(cfg, 'cpu')
  assert attention_lib.choose(cfg, H100)[0] == 'mosaic'


def test_the_bf16_model_through_mosaic_matches_xla():
  check_bf16_model_against_xla('mosaic', hidden_size=128, num_heads=2)  # head_dim 64


# ------------------------------------------------------------ the GPU path, lowered for CUDA


@pytest.mark.parametrize(
  'blocks',
  [
    pytest.param(None, id='defaults'),
    # At head_dim 128 the forward's buffers leave room for 2 stages of 128-key tiles, not 3.
    pytest.param(dataclasses.replace(OPTIONS, stages=2), id='early-handoff-options'),
    pytest.param(dataclasses.replace(ISSUE_HANDOFF, stages=2), id='issue-handoff-persistent'),
    pytest.param(MosaicBlocks(issue_handoff=True), id='issue-handoff'),
    pytest.param(MosaicBlocks(issue_handoff=True, own_turn_barriers=True), id='own-turns'),
    pytest.param(MosaicBlocks(intra_overlap=True, no_auto_barriers=True), id='intra-overlap'),
    pytest.param(MosaicBlocks(paired_turns=True), id='paired-turns'),
    pytest.param(
      MosaicBlocks(paired_turns=True, persistent=True, bias_in_product=True),
      id='paired-turns-persistent-bias-in-product',
    ),
    # The ALiBi row's product beside each order's Q K^T: in turns, issued early, overlapped.
    pytest.param(MosaicBlocks(bias_in_product=True), id='bias-in-product'),
    pytest.param(
      dataclasses.replace(OPTIONS, stages=2, bias_in_product=True),
      id='early-handoff-options-bias-in-product',
    ),
    pytest.param(
      MosaicBlocks(intra_overlap=True, bias_in_product=True), id='intra-overlap-bias-in-product'
    ),
  ],
)
def test_the_gpu_kernels_lower_for_cuda_with_alibi_as_key_rows(blocks):
  """Forward, dQ and dK/dV: three Mosaic GPU kernels (wgmma, TMA, the register layouts: none of
  interpret mode's stand-ins), with every option. ALiBi reaches them as a float32 [heads, seq]
  row per key (with bias_in_product as [heads, seq, 16] bfloat16 parts of it, beside a [64, 16]
  tile of ones for the queries), the forward saves a float32 [batch, heads, seq] log-sum-exp,
  and no [seq, seq] tensor exists."""
  x = jax.ShapeDtypeStruct((1, 384, 2, 128), jnp.bfloat16)
  slopes = np.array([LARGE_SLOPE, 0.5], np.float32)

  def loss(q, k, v):
    return mosaic_attention(q, k, v, alibi_slopes=slopes, blocks=blocks).astype(jnp.float32).sum()

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  text = grads.trace(x, x, x).lower(lowering_platforms=('cuda',)).as_text()
  calls = re.findall(r'custom_call @(\S+)\((.*?)\).*: \((.*?)\) -> (.*)', text)
  assert [target for target, *_ in calls] == ['mosaic_gpu_v2'] * 3, text[:2000]
  qkv = 'tensor<1x384x2x128xbf16>'
  forward, dq, dkv = (operands.split(', ') + [results] for _, _, operands, results in calls)
  in_product = blocks is not None and blocks.bias_in_product
  row, ones, lse = 'tensor<2x384xf32>', 'tensor<64x16xbf16>', 'tensor<1x2x384xf32>'
  if in_product:
    row = 'tensor<2x384x16xbf16>'
  assert forward[:5] == [qkv, qkv, qkv, row, ones]
  assert forward[5] == f'({qkv}, {lse})'
  assert dq[4:] == [row, ones, lse, lse, qkv]
  assert dkv[4:8] == [row, ones, lse, lse]
  assert dkv[-1] == f'({qkv}, {qkv})'
  assert not re.search(r'tensor<[^>]*384x384', text)


def kernel_texts(lowered) -> list[str]:
  """The MLIR text of each Mosaic GPU kernel in a lowered program, in program order: the module
  each `mosaic_gpu_v2` custom call carries (MLIR bytecode in its backend config; its Mosaic GPU
  ops print in the generic form, LLVM's and NVVM's as they are)."""
  calls: list = []

  def visit(op) -> None:
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if inner.operation.name == 'stablehlo.custom_call':
            calls.append(inner)
          visit(inner.operation)

  visit(lowered.compiler_ir('stablehlo').operation)
  context = jax_mlir.make_ir_context()
  context.allow_unregistered_dialects = True
  texts = []
  for call in calls:
    config = mlir_ir.DictAttr(call.attributes['mhlo.backend_config'])
    with context, mlir_ir.Location.unknown():
      module = mlir_ir.Module.parse(mlir_ir.StringAttr(config['module']).value_bytes)
      texts.append(str(module))
  return texts


def test_each_kernel_ends_once_its_output_copies_have_read_shared_memory():
  """Every wait for the kernels' output copies (TMA stores) is for their reads of shared memory
  (`cp.async.bulk.wait_group.read`), not for their writes to HBM, which the kernel's end makes
  visible: the SM starts its next program a write's latency sooner. Persistent forward too."""
  x = jax.ShapeDtypeStruct((1, 384, 2, 128), jnp.bfloat16)
  slopes = np.ones(2, np.float32)
  for blocks in (MosaicBlocks(), MosaicBlocks(persistent=True)):

    def loss(q, k, v, blocks=blocks):
      return mosaic_attention(q, k, v, alibi_slopes=slopes, blocks=blocks).astype(jnp.float32).sum()

    lowered = (
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=('cuda',))
    )
    for text in kernel_texts(lowered):
      waits = re.findall(r'nvvm\.cp\.async\.bulk\.wait_group"\(\) \{([^}]*)\}', text)
      assert waits and all(w.endswith(', read') for w in waits), (blocks, waits)


def test_no_auto_barriers_leaves_each_kernel_only_the_barriers_it_asks_for():
  """With MosaicBlocks.no_auto_barriers each kernel keeps two warpgroup barriers (`bar.sync`,
  128 threads), the epilogue's own: `commit_smem` before the output's copy and the wait for that
  copy; by default Mosaic GPU adds its own around every shared-memory store and before each copy
  a warpgroup issues."""
  x = jax.ShapeDtypeStruct((1, 384, 2, 128), jnp.bfloat16)
  slopes = np.ones(2, np.float32)

  def barriers(blocks):
    def loss(q, k, v):
      return mosaic_attention(q, k, v, alibi_slopes=slopes, blocks=blocks).astype(jnp.float32).sum()

    lowered = (
      jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=('cuda',))
    )
    return [text.count('"bar.sync $0, 128;"') for text in kernel_texts(lowered)]

  with_auto = barriers(MosaicBlocks(issue_handoff=True, own_turn_barriers=True))
  assert len(with_auto) == 3 and min(with_auto) > 2, with_auto
  assert barriers(
    MosaicBlocks(issue_handoff=True, own_turn_barriers=True, no_auto_barriers=True)
  ) == [2, 2, 2]


# ------------------------------------------------------------------------------ constraints


def options_refused(blocks: MosaicBlocks, rule: str):
  """A case of options MosaicBlocks.problems refuses together (the id names them), at a shape
  they would run."""
  options = '+'.join(name for name, value in dataclasses.asdict(blocks).items() if value is True)
  return pytest.param((1, 128, 2, 64), jnp.bfloat16, blocks, rule, id=options)


@pytest.mark.parametrize(
  'shape, dtype, blocks, rule',
  [
    pytest.param((1, 128, 2, 80), jnp.bfloat16, None, 'head_dim must be one of', id='head-dim'),
    pytest.param((1, 128, 2, 64), jnp.float32, None, 'bfloat16 or float16', id='float32'),
    pytest.param(
      (1, 128, 2, 64), jnp.bfloat16, MosaicBlocks(block_kv=96), 'multiple of 64', id='block'
    ),
    pytest.param((1, 128, 2, 64), jnp.bfloat16, MosaicBlocks(stages=1), 'at least 2', id='stages'),
    pytest.param(
      (1, 128, 2, 64),
      jnp.bfloat16,
      MosaicBlocks(copy_registers=20),
      "from 24 \\(setmaxnreg's least\\)",
      id='copy-registers',
    ),
    options_refused(MosaicBlocks(early_handoff=True, issue_handoff=True), 'two orders of the'),
    options_refused(MosaicBlocks(own_turn_barriers=True), 'a form of issue_handoff'),
    options_refused(
      MosaicBlocks(issue_handoff=True, own_turn_barriers=True, persistent=True),
      'does not run with persistent',
    ),
    options_refused(
      MosaicBlocks(intra_overlap=True, issue_handoff=True), 'runs without turns on the tensor'
    ),
    options_refused(
      MosaicBlocks(paired_turns=True, own_turn_barriers=True), 'paired_turns is an order of its'
    ),
    pytest.param(
      (1, 128, 2, 64),
      jnp.float16,
      MosaicBlocks(bias_in_product=True),
      'bias_in_product needs bfloat16',
      id='bias-in-product-float16',
    ),
  ],
)
def test_unsupported_inputs_name_the_rule_before_tracing(shape, dtype, blocks, rule):
  x = jnp.zeros(shape, dtype)
  with pytest.raises(MosaicAttentionConstraintError, match=rule):
    mosaic_attention(x, x, x, blocks=blocks)


@pytest.mark.parametrize(
  'device, overrides, constraint',
  [
    pytest.param(A100, {}, 'compute capability 9.x, got 8.0', id='ampere'),
    pytest.param(B200, {}, 'compute capability 9.x, got 10.0', id='blackwell'),
    pytest.param(H100, {'dtype': 'float32'}, 'bfloat16 or float16', id='float32'),
    pytest.param(H100, {'hidden_size': 2560, 'num_heads': 32}, 'head_dim', id='head-dim-80'),
  ],
)
def test_mosaic_constraints_are_config_errors_naming_the_fix(device, overrides, constraint):
  cfg = ModelConfig(
    **{'hidden_size': 2048, 'num_heads': 16, 'dtype': 'bfloat16', **overrides},
    attention_impl='mosaic',
  )
  with pytest.raises(ConfigError, match=re.escape(constraint)):
    attention_lib.choose(cfg, device)
  fallback = dataclasses.replace(cfg, attention_fallback=True)
  assert attention_lib.choose(fallback, device)[0] == 'xla'


def test_mosaic_runs_blooms_attention_on_hopper_and_in_interpret_mode_on_cpu():
  cfg = ModelConfig(hidden_size=2048, num_heads=16, dtype='bfloat16', attention_impl='mosaic')
  assert attention_lib.choose(cfg, H100)[0] == 'mosaic'
  assert attention_lib.choose(cfg, 'cpu')[0] == 'mosaic'


@pytest.mark.parametrize(
  'version, refused', [(12060, False), (12080, True), (12090, True), (13000, False)]
)
def test_cuda_runtimes_whose_ptxas_miscompiles_causal_masks_are_refused(
  monkeypatch, version, refused
):
  """jax's own Hopper attention refuses causal masks on CUDA 12.8 to 12.9.0 (a ptxas
  miscompilation): so does 'mosaic', at config time on a GPU, naming the fix."""
  problems = unmet_constraints(head_dim=128, dtype='bfloat16', cuda_version=version)
  assert bool(problems) == refused
  monkeypatch.setattr(attention_lib, 'mosaic_cuda_runtime_version', lambda: version)
  cfg = ModelConfig(hidden_size=2048, num_heads=16, dtype='bfloat16', attention_impl='mosaic')
  if refused:
    with pytest.raises(ConfigError, match=r'ptxas .* use CUDA >= 12\.9\.1'):
      attention_lib.choose(cfg, H100)
  else:
    assert attention_lib.choose(cfg, H100)[0] == 'mosaic'


def test_query_tiles_run_longest_first():
  """Under the causal mask the last query tile has the most keys: program 0 takes it."""
  assert [heaviest_first(i, 4) for i in range(4)] == [3, 2, 1, 0]


@pytest.mark.parametrize(
  'batch, heads, tiles, seq, group',
  [
    pytest.param(2, 3, 4, 65536, 1, id='one-pair-a-group'),  # a pair's keys and values: 32 MiB
    pytest.param(2, 3, 4, 8192, 4, id='groups-of-4-last-of-2'),  # 4 MiB a pair
    pytest.param(1, 2, 3, 512, 2, id='one-group'),
  ],
)
def test_the_persistent_forward_runs_every_item_once_longest_first_by_l2_group(
  batch, heads, tiles, seq, group
):
  """forward_item_order: every (batch row, head, query tile) exactly once, in groups of pairs
  whose keys and values fit L2_GROUP_BYTES (head_dim 128 in bf16: 512 KiB a pair per 1024 tokens),
  each group's tiles the longest first."""
  order = forward_item_order(batch, heads, tiles, seq, 128, 2)
  items = [tuple(int(x) for x in order(jnp.int32(i))) for i in range(batch * heads * tiles)]
  assert sorted(items) == [
    (b, h, t) for b in range(batch) for h in range(heads) for t in range(tiles)
  ]
  pairs = [b * heads + h for b, h, _ in items]
  starts = [
    0,
    *itertools.accumulate(
      min(group, batch * heads - g) * tiles for g in range(0, batch * heads, group)
    ),
  ]
  for start, end in itertools.pairwise(starts):
    assert len({p // group for p in pairs[start:end]}) == 1, pairs
    assert [t for *_, t in items[start:end]] == sorted(
      (t for *_, t in items[start:end]), reverse=True
    )


def test_interpret_mode_is_refused_where_it_would_hang_for_want_of_cpu_threads(monkeypatch):
  """Interpret mode holds compute_wgs + 2 of XLA's CPU threads at once (the warpgroups, waiting
  for each other at barriers, and the computation that started them), and the CPU client has
  max(cores, CPU devices): on a 2-core machine 1 or 2 devices hung every run, 3 some
  (docs/benchmarks.md). Where it would, the call is refused before anything runs."""
  x = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
  monkeypatch.setattr(mosaic_attention_module, 'cpu_client_threads', lambda: 3)
  with pytest.raises(MosaicAttentionConstraintError, match=r'needs 4 of them; this process has 3'):
    mosaic_attention(x, x, x, blocks=SMALL, interpret=True)
  mosaic_attention_module.check_interpret_threads(ONE_WARPGROUP)  # 3 are enough for one
  # The suite's devices and the benchmarks' --smoke runs give every MosaicBlocks its threads.
  monkeypatch.undo()
  assert mosaic_attention_module.cpu_client_threads() >= jax.local_device_count() >= 4
  largest = MosaicBlocks(compute_wgs=mosaic_attention_module.MAX_COMPUTE_WGS)
  assert mosaic_attention_module.interpret_threads_needed(largest) == 4
  assert mosaic_attention_module.INTERPRET_CPU_DEVICES == 4
  assert MosaicBlocks(compute_wgs=3).problems() == [
    'MosaicBlocks.compute_wgs=3 must be from 1 to 2'
  ]
  # XLA's default pool size is NPROC where that is set.
  monkeypatch.setenv('NPROC', '64')
  assert mosaic_attention_module.cpu_client_threads() == 64
