"""The train and evaluation steps: pure functions of (state, batch), jitted with explicit
shardings and donated state, compiled ahead of time by the trainer and by `plan`.

Per iteration: the global batch is split into `num_microbatches` micro-batches of
`micro_batch_size x data` rows; gradients are accumulated over them in fp32 (each data rank its
whole gradient, reduce-scattered into the ZeRO layout once a step, under grad_sync 'step';
into the ZeRO (data-split) layout each micro-batch under 'tick'; hybrid sharding's copies each
their own, added once a step: `own_gradient_axes`; added in place where a loop without a
pipeline holds its whole gradient: `add_microbatch_grads`), clipped at a global norm (the
pre-clip norm is logged), and AdamW updates the fp32 master params with a learning rate the host
computes from the consumed samples (or tokens).
An iteration whose loss or gradient norm is not finite leaves params and Adam state, including
its step count, unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.config import Config, ConfigError
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib
from t5x_like.optim import adamw as optim
from t5x_like.parallel import pipeline
from t5x_like.parallel.train_state import StateLayout, TrainState
from t5x_like.training import batches, device_memory, schedule


def compute_params_of(params, layout: StateLayout, dtype):
  """The master params cast to the compute dtype, in `layout.step_compute_shardings`: under
  ZeRO-1 this all-gathers the compute-dtype copy of the split fp32 params once a step
  (DeepSpeed's bf16 weights), not the fp32 ones; under ZeRO-3 the copy stays split and the model
  gathers each weight where it uses it."""
  return jax.tree.map(
    lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s),
    params,
    layout.step_compute_shardings,
  )


def compute_bits_of(params, layout: StateLayout, dtype):
  """`compute_params_of` as `pipeline.as_bits`: what the pipeline's stages read."""
  return jax.tree.map(
    jax.lax.with_sharding_constraint,
    pipeline.as_bits(params, dtype),
    layout.step_compute_shardings,
  )


def gathered_params(params, layout: StateLayout):
  """The fp32 params where the pipeline accumulates its fp32 gradients: under ZeRO-1 in the rule
  sharding (without ZeRO's `data` split; the stages compute from `compute_bits_of`'s copy, so
  this gather's value is never used and XLA removes it), under ZeRO-3 split as they are."""
  return jax.tree.map(jax.lax.with_sharding_constraint, params, layout.step_compute_shardings)


def fp32_zeros(params, shardings):
  """An fp32 gradient accumulator: zeros of params' shapes in `shardings` (the ZeRO layout)."""
  return jax.tree.map(
    lambda p, s: jax.lax.with_sharding_constraint(jnp.zeros(p.shape, jnp.float32), s),
    params,
    shardings,
  )


def add_grads(accumulated, grads, shardings):
  """accumulated + grads in fp32, constrained to `shardings` (the ZeRO layout): each addition's
  gradient is reduce-scattered into the data-split accumulator."""
  return jax.tree.map(
    lambda a, g, s: jax.lax.with_sharding_constraint(a + g.astype(jnp.float32), s),
    accumulated,
    grads,
    shardings,
  )


def accumulate_grads(
  grads_into: Callable, params, xs, *, shardings, num_real=None, unroll: bool = False
):
  """(sum of the losses, fp32 sum of the gradients) over the leading dim of `xs` (a tree: the
  micro-batches, or the pipeline's groups of them), accumulated in `shardings` (the ZeRO
  layout): `grads_into(x, index, grads)` returns x's loss and `grads` plus x's gradients
  (`adding` makes one of a function that returns them).

  num_real: None runs them all (a scan); a traced count runs only the first num_real (a
  fori_loop): under the ramp-up's rounded-up micro-batch count (train.rampup_microbatch_multiple)
  the ones after the real ones are padding only, and a loop of as many iterations as there are
  real ones never computes them. (Nothing differentiates through this loop, so its trip count
  may be a traced value; a cond per micro-batch instead cost bloom_1b3 2.3 GiB per device.)"""

  def add(index, x, carry):
    grads_acc, loss_acc = carry
    loss, grads = grads_into(x, index, grads_acc)
    constrain = lambda g, s: jax.lax.with_sharding_constraint(g, s)
    return jax.tree.map(constrain, grads, shardings), loss_acc + loss

  carry = (fp32_zeros(params, shardings), jnp.float32(0.0))
  if num_real is not None:
    take = lambda m: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, m, 0, False), xs)
    grads, loss = jax.lax.fori_loop(0, num_real, lambda m, c: add(m, take(m), c), carry)
  else:
    count = jax.tree.leaves(xs)[0].shape[0]
    (grads, loss), _ = jax.lax.scan(
      lambda c, index_x: (add(*index_x, c), None), carry, (jnp.arange(count), xs), unroll=unroll
    )
  return loss, grads


def adding(loss_and_grads: Callable, shardings) -> Callable:
  """`accumulate_grads`' grads_into from `loss_and_grads(x, index)` -> (loss, gradients): each
  gradient added to the accumulator in fp32 (`add_grads`)."""

  def grads_into(x, index, grads):
    loss, x_grads = loss_and_grads(x, index)
    return loss, add_grads(grads, x_grads, shardings)

  return grads_into


def microbatch_loss_and_grads(model, params, tokens, rng, index, *, deterministic, scale=None):
  """The mean loss of the micro-batch `tokens` (times `scale`, where given) and its gradient
  with respect to `params`, the dropout masks drawn from `rng` folded with the micro-batch's
  `index`. 'dense', 'chunked' or 'fused' cross-entropy (model.cross_entropy_impl, losses.py)."""

  def loss_fn(p):
    loss = losses.mean_loss(
      model,
      p,
      tokens,
      deterministic=deterministic,
      rngs={'dropout': jax.random.fold_in(rng, index)},
    )
    return loss if scale is None else scale * loss

  return jax.value_and_grad(loss_fn)(params)


def holds_whole_gradient(layout: StateLayout, axes: tuple[str, ...]) -> bool:
  """Whether the no-pipeline loop adds each micro-batch's gradients into its fp32 accumulator
  in place (`add_microbatch_grads`): where the loop's accumulator is not split over `data` (one
  data rank, or one in each hybrid copy, or each rank its own loop under grad_sync 'step'), and
  no weight is gathered where it is used (ZeRO-3 runs the Flax model,
  `microbatch_loss_and_grads`)."""
  return layout.model.gathers is None and ('data' in axes or layout.mesh.shape['data'] == 1)


# The primitives that read a layer's weights from the stacked compute copy, `jnp` indexing and
# `pipeline.compute_copy` (a custom VJP, whose primitive jax has named custom_vjp_call_jaxpr
# and custom_vjp_call): under remat_policy 'none' the in-place loop saves none of their
# outputs for the backward pass (it recomputes them from the copy, which is not stacked again).
_WEIGHT_READS = ('dynamic_slice', 'squeeze', 'custom_vjp_call')


def add_microbatch_grads(
  ctx: model_lib.Context, compute_params, grads, tokens, rng, *, deterministic: bool, scale=None
):
  """(the mean loss of the micro-batch `tokens` (times `scale`, where given), `grads` (the fp32
  accumulators) plus its gradients), the gradients added in place: the layer scan carries
  the accumulator of the stacked layers, so that its transpose adds each layer's gradient into
  it (`pipeline.compute_copy` widens it to fp32), and the looked-up rows' cotangents are
  scattered into the token table's (as 1F1B does). The other weights' gradients (the
  LayerNorms, the table's use by the head) come out in the compute dtype and are widened as
  they are added. Returned stacked in bf16 and added after, the layers' gradient cost
  bloom_1b3 2.25 GiB per GPU beside the accumulator, and the lookup's fp32 table gradient a
  zero-filled [vocab, hidden] buffer each micro-batch (docs/benchmarks.md). The functions are
  the Flax model's (`model_lib.apply_block`, `losses.head_loss`); with dropout the masks are
  drawn per layer from `rng` (not the Flax model's stream)."""
  mcfg = ctx.cfg
  inputs, labels, weights = losses.split_tokens(tokens)
  compute_layers = compute_params['layers']
  others = {k: v for k, v in compute_params.items() if k != 'layers'}
  rows = model_lib.lookup_tokens(others, inputs, ctx)
  dropout_key = lambda stream: None if deterministic else jax.random.fold_in(rng, stream)

  def layer(masters, x, i):
    # Named so that no remat policy saves them (not even remat_policy 'none'): the scan would
    # stack a copy of every layer's weights for the backward pass.
    master, compute = checkpoint_name(
      jax.tree.map(lambda a: a[i], (masters, compute_layers)), 'layer_weights'
    )
    weights = checkpoint_name(
      jax.tree.map(lambda m, c: pipeline.compute_copy(m, c, ctx.dtype), master, compute),
      'layer_weights',
    )
    return model_lib.apply_block(weights, x, ctx, deterministic, dropout_key(i))

  policy = model_lib.remat_policy(mcfg.remat_policy)
  if policy is None:
    # 'none': every value but the reads of the layer's weights from the compute copy, whose
    # every step (the slice, the squeeze, the widening custom VJP, the name) would otherwise be
    # saved: a stacked copy of the weights.
    policy = lambda prim, *_, **__: not prim.name.startswith(_WEIGHT_READS)
  device = attention_lib.Device.of(
    jax.devices()[0] if ctx.mesh is None else ctx.mesh.devices.flat[0]
  )
  # Mosaic GPU's emulation on CPU cannot be checkpointed (there only 'none' runs, and the
  # weights' copy is stacked).
  if attention_lib.rematerialisable(
    attention_lib.resolve_impl(mcfg, device, quiet=True), device.platform
  ):
    layer = jax.checkpoint(
      layer, policy=partitioning.never_save(['layer_weights'], policy), prevent_cse=False
    )

  def forward(masters, others, rows):
    x = model_lib.embed_rows(others, rows, mcfg, ctx)
    x = model_lib.dropout(
      x, 0.0 if deterministic else mcfg.hidden_dropout, dropout_key(mcfg.num_layers)
    )

    unroll = mcfg.scan_unroll or mcfg.unroll_layers
    x, masters = pipeline.scan_carrying_masters(layer, masters, x, mcfg.num_layers, unroll)
    loss = losses.head_loss(others, x, labels, weights, weights.sum(), mcfg, ctx)
    return (loss if scale is None else scale * loss), masters

  (loss, _), pullback = jax.vjp(forward, grads['layers'], others, rows)
  layer_grads, other_grads, row_cotangents = pullback((jnp.ones_like(loss), grads['layers']))
  widened_sum = lambda total, g: total + g.astype(total.dtype)
  grads = dict(
    grads,
    layers=layer_grads,
    **{k: jax.tree.map(widened_sum, grads[k], g) for k, g in other_grads.items()},
  )
  table = grads['word_embeddings']
  # Each use of a row adds its fp32 cotangent, as `model_lib.lookup_rows`' own gradient does.
  grads['word_embeddings'] = table.at[inputs].add(row_cotangents.astype(table.dtype))
  return loss, grads


def microbatched_loss_and_grads(cfg: Config, layout: StateLayout, params, batch, rng):
  """No pipeline: the mean loss and gradients of the micro-batches, run one after another from
  one compute-dtype copy of the params, their gradients accumulated in fp32. Where ranks add
  their own gradients up (`own_gradient_axes`: each data rank under grad_sync 'step', each
  hybrid copy always) the loop runs in a shard_map over them (`per_rank_loss_and_grads`);
  otherwise each micro-batch's gradient is reduce-scattered into the ZeRO-split accumulator."""
  compute_params = compute_params_of(params, layout, jnp.dtype(cfg.model.dtype))  # once a step
  num_real = None
  num_micro = batch.shape[0]
  if cfg.train.rampup_microbatch_multiple > 0:
    num_real = losses.real_microbatches(batch).sum()
    num_micro = num_real.astype(jnp.float32)
  axes = own_gradient_axes(cfg, layout)
  if axes:
    loss_sum, grads = per_rank_loss_and_grads(
      cfg, layout, compute_params, batch, num_real, rng, axes
    )
  else:
    shardings = layout.shardings.params
    loss_sum, grads = accumulate_grads(
      microbatch_grads_into(cfg, layout, layout.mesh, compute_params, rng, shardings, axes),
      params,
      (batch, None),
      shardings=shardings,
      num_real=num_real,
      unroll=cfg.model.scan_unroll,
    )
  return loss_sum / num_micro, jax.tree.map(lambda g: g / num_micro, grads)


def microbatch_grads_into(
  cfg: Config, layout: StateLayout, mesh, compute_params, rng, shardings, axes: tuple[str, ...]
) -> Callable:
  """The no-pipeline loop's `accumulate_grads` grads_into on `mesh` (the step's, or inside
  `per_rank_loss_and_grads`' shard_map the mesh with `axes` manual), for x = (a micro-batch's
  tokens, the scale of its loss or None): added in place where the loop holds its whole
  gradient (`add_microbatch_grads`), else the Flax model's gradient added to the accumulator in
  `shardings`."""
  deterministic = not _has_dropout(cfg)
  if holds_whole_gradient(layout, axes):
    ctx = model_lib.Context(cfg.model, mesh)

    def grads_into(tokens_and_scale, index, grads):
      tokens, scale = tokens_and_scale
      rng_m = jax.random.fold_in(rng, index)
      return add_microbatch_grads(
        ctx, compute_params, grads, tokens, rng_m, deterministic=deterministic, scale=scale
      )

    return grads_into
  gathers = layout.model.gathers
  model = layout.model.clone(mesh=mesh, gathers=None if gathers is None else gathers.on(mesh))

  def loss_and_grads(tokens_and_scale, index):
    tokens, scale = tokens_and_scale
    return microbatch_loss_and_grads(
      model, compute_params, tokens, rng, index, deterministic=deterministic, scale=scale
    )

  return adding(loss_and_grads, shardings)


def rank_shares(batch, ranks: int):
  """[M, ranks]: each rank's share of each micro-batch's real targets (the ranks hold
  consecutive blocks of the rows); a rank's mean loss weighted by its share sums, over the
  ranks, to the micro-batch's mean (0 where it has no target, as `losses.weighted_mean`)."""
  weights = losses.split_tokens(batch)[2]
  counts = weights.reshape(batch.shape[0], ranks, -1).sum(axis=2)
  return counts / jnp.maximum(counts.sum(axis=1, keepdims=True), 1.0)


def per_rank_loss_and_grads(
  cfg: Config, layout: StateLayout, compute_params, batch, num_real, rng, axes: tuple[str, ...]
):
  """No pipeline, where the ranks of `axes` add their own gradients up: (sum of the
  micro-batches' mean losses, fp32 sum of their gradients, in the ZeRO layout) as
  `accumulate_grads`, with the gradient crossing those ranks once a step instead of once a
  micro-batch. The micro-batch loop runs in a shard_map over `axes`: each rank runs the model on
  its own rows and adds each micro-batch's gradient to its own accumulator, and after the loop
  `sum_over_ranks` sums the ranks' accumulators once. Over `data` (grad_sync 'step', ZeRO-1)
  each rank holds the whole fp32 gradient (Megatron-DeepSpeed's fp32 gradient accumulation) and
  the sum is one reduce-scatter into ZeRO's split; over hybrid sharding's `replica` alone each
  copy's accumulator is split over its group's data ranks as without copies (each micro-batch's
  gradient reduce-scattered within the group) and the copies' shards are all-reduced (torch
  FSDP's HYBRID_SHARD under no_sync, DeepSpeed's hpZ). Each rank's loss is weighted by its share
  of the micro-batch's targets (`rank_shares`), so the sums are the one-device run's. With
  dropout each rank draws its own masks for its rows (independent draws, not the slices of the
  one-device run's masks: without dropout the run is the one-device run's)."""
  shares = rank_shares(batch, math.prod(layout.mesh.shape[a] for a in axes))
  num_real = jnp.int32(batch.shape[0]) if num_real is None else num_real
  fori = cfg.train.rampup_microbatch_multiple > 0

  def run(inner, shardings, rng, params, batch, shares, num_real):
    return accumulate_grads(
      microbatch_grads_into(cfg, layout, inner, params, rng, shardings, axes),
      params,
      (batch, shares[:, 0]),
      shardings=shardings,
      num_real=num_real if fori else None,
      unroll=cfg.model.scan_unroll,
    )

  ranks = P(None, axes)
  return summed_over_ranks(
    layout, axes, run, rng, (compute_params, batch, shares, num_real), (P(), ranks, ranks, P())
  )


def summed_over_ranks(
  layout: StateLayout, axes: tuple[str, ...], run: Callable, rng, args, in_specs
):
  """(loss, fp32 gradients in the ZeRO layout) of `run(inner, shardings, rng, *args)` run in a
  shard_map over `axes` (`args` split by `in_specs`), which returns one rank's (loss, gradient
  sum in `shardings`): `inner` is the mesh with `axes` manual, `shardings` where each rank
  holds its gradient on it (the whole, the rule sharding, where `axes` include `data`; else the
  ZeRO split over its copy's data ranks), and `rng` is folded with the rank's index, so that with
  dropout each rank draws its own masks for its own rows. The losses and gradients are summed
  over the ranks once (`sum_over_ranks`)."""
  held = layout.step_compute_shardings if 'data' in axes else layout.shardings.params
  inner = partitioning.manual_mesh(layout.mesh, axes)
  shardings = jax.tree.map(lambda s: NamedSharding(inner, s.spec), held)

  def rank_sums(rng, *args):
    loss, grads = run(inner, shardings, jax.random.fold_in(rng, jax.lax.axis_index(axes)), *args)
    # Each rank's own sum, stacked over the ranks: summed once, below.
    return jax.lax.psum(loss, axes), jax.tree.map(lambda g: g[None], grads)

  # check_vma=False: inside, the params are each rank's own values and their gradient is the
  # rank's own (with the varying-axes check the gradient with respect to params that are the
  # same on every rank would be summed over the ranks at once, at each use).
  loss, stacked = jax.shard_map(
    rank_sums,
    mesh=layout.mesh,
    in_specs=(P(), *in_specs),
    out_specs=(P(), P(axes)),
    axis_names=set(axes),
    check_vma=False,
  )(rng, *args)
  grads = jax.tree.map(
    functools.partial(sum_over_ranks, layout.mesh, axes), stacked, held, layout.shardings.params
  )
  return loss, grads


def pipelined_loss_and_grads(cfg: Config, layout: StateLayout, params, batch, rng):
  """Pipeline: one schedule over all micro-batches (`pipeline.loss_and_grads`, GPipe or 1F1B as
  pipeline.schedule says), or, with pipeline.microbatch_group = G, one per group of G
  micro-batches, one group after another, accumulated as `accumulate_grads` does. Where ranks run
  schedules of their own (`own_gradient_axes`: each data rank under grad_sync 'step', each
  hybrid copy always) their gradients cross those ranks once a step."""
  compute = compute_bits_of(params, layout, jnp.dtype(cfg.model.dtype))
  gathered = gathered_params(params, layout)  # once per step, not per group
  axes = own_gradient_axes(cfg, layout)
  if not axes:
    loss, grads = schedules_loss_and_grads(
      cfg, layout, layout.mesh, gathered, compute, batch, rng, layout.shardings.params, ()
    )
    return loss, jax.tree.map(jax.lax.with_sharding_constraint, grads, layout.shardings.params)

  def run(inner, shardings, rng, gathered, compute, batch):
    return schedules_loss_and_grads(
      cfg, layout, inner, gathered, compute, batch, rng, shardings, axes
    )

  return summed_over_ranks(
    layout, axes, run, rng, (gathered, compute, batch), (P(), P(), P(None, axes))
  )


def sum_over_ranks(mesh, axes: tuple[str, ...], stacked, held: NamedSharding, zero: NamedSharding):
  """The sum of `stacked` [ranks, ...] (each rank's gradient, in the `held` layout otherwise) in
  the `zero` layout. Over `data` (grad_sync 'step') a reduce-scatter into the dim that ZeRO
  splits over it, each device reducing its own pipeline and tensor block; over hybrid sharding's
  copies then an all-reduce of each device's shard."""
  spec = tuple(held.spec) + (None,) * (stacked.ndim - 1 - len(held.spec))
  axes_of = lambda entry: entry if isinstance(entry, tuple) else (entry,) if entry else ()
  out, dim = list(spec), None
  if 'data' in axes:
    dim = next((d for d, a in enumerate(zero.spec) if 'data' in axes_of(a)), None)
  if dim is not None:
    within = axes_of(spec[dim])
    block = stacked.shape[1 + dim] // math.prod(mesh.shape[a] for a in within)
    if block % mesh.shape['data']:
      dim = None  # a split that pads (partitioning.zero_split): summed whole, then cut
    else:
      out[dim] = (*within, 'data')  # `data` splits each device's block: the minor axis

  def reduce(block):
    block = block[0]
    if 'data' in axes:
      if dim is None:
        block = jax.lax.psum(block, 'data')
      else:
        block = jax.lax.psum_scatter(block, 'data', scatter_dimension=dim, tiled=True)
    # The copies' sum after the data ranks' scatter: each device all-reduces its own shard.
    return jax.lax.psum(block, 'replica') if 'replica' in axes else block

  summed = jax.shard_map(
    reduce, mesh=mesh, in_specs=P(axes, *spec), out_specs=P(*out), check_vma=False
  )(stacked)
  return jax.lax.with_sharding_constraint(summed, zero)


def own_gradient_axes(cfg: Config, layout: StateLayout) -> tuple[str, ...]:
  """The mesh axes whose ranks each run the micro-batch loop (or the pipeline's schedule) on
  their own rows, in a shard_map over them, and add their micro-batches' fp32 gradients up on
  their own, the ranks' sums added once, after the loop (`summed_over_ranks`); () for one loop
  over the mesh.

  - grad_sync 'step' (ZeRO-1) with more than one data rank: the batch axes, `data` and
    `replica` (Megatron-DeepSpeed's fp32 gradient accumulation, reduced once an iteration).
    The data ranks then hold the whole fp32 gradient (a pipeline stage's), where one loop
    over the mesh reduce-scatters each micro-batch's gradient over them, and one schedule
    all-reduces each tick's (BLOOM-176B: 150 ticks a step).
  - Otherwise, under hybrid sharding (`replica` > 1): `replica`. Each copy's data ranks share
    one loop or schedule and its ZeRO split as without copies (ZeRO-3 gathers each layer over
    them where it is used), the copies' accumulators are all-reduced once a step instead of
    each micro-batch's or tick's gradient across them: the same memory, fewer collectives.

  With dropout each rank draws its own masks for its rows (independent draws, not the slices of
  the one-device run's masks: without dropout the run is the one-device run's)."""
  shape = layout.mesh.shape
  if shape.get('data', 1) * shape.get('replica', 1) > 1 and cfg.grad_sync == 'step':
    axes = partitioning.batch_axes(layout.mesh)
    return axes if isinstance(axes, tuple) else (axes,)
  return ('replica',) if shape.get('replica', 1) > 1 else ()


def schedules_loss_and_grads(
  cfg: Config, layout: StateLayout, mesh, gathered, compute, batch, rng, shardings, loss_axes
):
  """The pipeline's (loss, fp32 gradients) of `batch` on `mesh` (the step's, or inside
  `own_gradient_axes`' shard_map its copy with those axes manual): one schedule, or one per
  group of micro-batches accumulated in `shardings`."""
  # ZeRO-3: the top-level weights (embedding, norms) gathered at use; the stages' layers are
  # gathered by the partitioner where their matmuls need them.
  gathers = None if layout.model.gathers is None else layout.model.gathers.on(mesh)
  kwargs = dict(
    cfg=cfg,
    placement=layout.placement,
    ctx=model_lib.Context(cfg.model, mesh, gathers),
    deterministic=not _has_dropout(cfg),
    compute_params=compute,
    loss_axes=loss_axes,
  )
  group, num_micro = cfg.pipeline.microbatch_group, batch.shape[0]
  if not group or group >= num_micro:
    return pipeline.loss_and_grads(gathered, batch, rng, **kwargs)
  groups = batch.reshape((num_micro // group, group) + batch.shape[1:])
  # pipeline_loss is a group's mean over its real micro-batches (all G without the ramp-up's
  # padding); weighted by its share of the step's, the groups add up to the step's mean.
  num_real = None
  if cfg.train.rampup_microbatch_multiple > 0:
    real = losses.real_microbatches(batch).reshape(groups.shape[0], group).sum(axis=1)
    weights = real / jnp.maximum(real.sum(), 1)
    # Groups of padding only (after the real micro-batches) are not run: their mean would be
    # 0 / 0.
    num_real = (real > 0).sum()
  else:
    weights = jnp.full((groups.shape[0],), group / num_micro, jnp.float32)

  def loss_and_grads(group_and_weight, index):
    tokens, weight = group_and_weight
    return pipeline.loss_and_grads(
      gathered, tokens, jax.random.fold_in(rng, index), loss_scale=weight, **kwargs
    )

  return accumulate_grads(
    adding(loss_and_grads, shardings),
    gathered,
    (groups, weights),
    shardings=shardings,
    num_real=num_real,
    unroll=cfg.model.scan_unroll,
  )


def loss_and_grads(cfg: Config, layout: StateLayout, params, batch, rng):
  """The step's mean loss and fp32 gradients (ZeRO layout), pipelined or not."""
  if cfg.mesh.pipeline > 1:
    return pipelined_loss_and_grads(cfg, layout, params, batch, rng)
  return microbatched_loss_and_grads(cfg, layout, params, batch, rng)


def count_zeros(tree) -> jax.Array:
  """How many elements of the float arrays in `tree` are zero (+0 or -0; a subnormal is not),
  Megatron's 'num zeros'. Compared as bit patterns without the sign bit: `g == 0` broadcasts a
  float zero fill of g's shape, which XLA merged with the gradient accumulator's initial zeros
  and kept live through the whole tick or micro-batch loop (tr11 under 'tick': 1.4 GiB at the
  peak; the 1.3B step on one H100: 6.42 GiB; docs/benchmarks.md)."""
  total = jnp.zeros((), jnp.int32)
  for g in jax.tree.leaves(tree):
    bits = jnp.dtype(f'uint{8 * g.dtype.itemsize}')
    magnitude = jax.lax.bitcast_convert_type(g, bits) & jnp.asarray(jnp.iinfo(bits).max >> 1, bits)
    total += jnp.sum(magnitude == 0, dtype=jnp.int32)
  return total


def apply_update(cfg: Config, layout: StateLayout, state: TrainState, loss, grads, lr):
  """(new state, stats): grads clipped at cfg.optimizer.clip_grad's global norm, then the
  optimizer's update at learning rate lr, unless the loss or the gradient norm is not finite."""
  grads, grad_norm = optim.clip_by_global_norm(grads, cfg.optimizer.clip_grad)
  num_zeros = count_zeros(grads)

  updates, new_opt_state = layout.optimizer.update(grads, state.opt_state, state.params)
  new_params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
  # A non-finite loss or gradient skips the update: params, moments and Adam's count keep their
  # values. A select of new against old, fused into the update's one in-place pass over each
  # tensor: under a lax.cond jax 0.10.2's XLA copied the whole state into the GPU program's
  # branch and out again, and jax 0.11.2's moved 14 GB more a step (docs/benchmarks.md).
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  new_state = jax.tree.map(
    lambda new, old: jnp.where(finite, new, old), TrainState(new_params, new_opt_state), state
  )
  stats = {
    'lm_loss': loss,
    'grad_norm': grad_norm,
    'num_zeros': num_zeros.astype(jnp.float32),
    'finite': finite,
    'loss_finite': jnp.isfinite(loss),
  }
  return new_state, stats


def _has_dropout(cfg: Config) -> bool:
  return cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0


def make_train_step(cfg: Config, layout: StateLayout):
  """The pure step function: (state, batch [M, rows, S+1], learning rate, iteration) ->
  (state, stats); the learning rate is `schedule.learning_rate`'s, a float32 scalar.
  `loss_and_grads` (`accumulate_grads` over the micro-batches, or the pipeline's schedule),
  then `apply_update`."""

  def step(state: TrainState, batch, lr, iteration):
    rng = jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), iteration)
    state = layout.unpad(state, None)  # ZeRO's padding (partitioning.zero_split) stays outside
    loss, grads = loss_and_grads(cfg, layout, state.params, batch, rng)
    new_state, stats = apply_update(cfg, layout, state, loss, grads, lr)
    return layout.pad(new_state, None), stats

  return step


def make_eval_step(cfg: Config, layout: StateLayout):
  """The pure evaluation step: (params, batch [M, rows, S+1]) -> mean fp32 loss, no dropout.

  The same model, loss, micro-batching and pipeline schedule as training, forward only."""
  dtype = jnp.dtype(cfg.model.dtype)

  def step(params, batch):
    params = layout.unpad(params, 'params')
    if cfg.mesh.pipeline > 1:
      ctx = model_lib.Context(cfg.model, layout.mesh)
      return pipeline.pipeline_loss(
        params,
        batch,
        jax.random.PRNGKey(0),
        cfg=cfg,
        placement=layout.placement,
        ctx=ctx,
        deterministic=True,
        compute_params=compute_bits_of(params, layout, dtype),
      )
    compute_params = compute_params_of(params, layout, dtype)

    def add_micro_batch(total, tokens):
      return total + losses.mean_loss(layout.model, compute_params, tokens), None

    total, _ = jax.lax.scan(add_micro_batch, jnp.float32(0.0), batch, unroll=cfg.model.scan_unroll)
    return total / batch.shape[0]  # equal micro-batches: the mean of the means

  return step


def batch_sharding(layout: StateLayout) -> NamedSharding:
  """Batches [micro-batches, rows, S + 1] are split over `data` on their rows (and `replica`
  under hybrid sharding)."""
  return NamedSharding(layout.mesh, P(None, partitioning.batch_axes(layout.mesh), None))


def jit_train_step(cfg: Config, layout: StateLayout):
  """The train step, jitted with explicit input/output shardings and donated state."""
  return jax.jit(
    make_train_step(cfg, layout),
    in_shardings=(layout.shardings, batch_sharding(layout), None, None),
    out_shardings=(layout.shardings, None),
    donate_argnums=(0,),
  )


def lower_train_step(
  cfg: Config, layout: StateLayout, num_microbatches: int, seq_len: int | None = None
):
  """The jitted step lowered for abstract (shape-only) state and batch (default: train.seq_len)."""
  step = jit_train_step(cfg, layout)
  rows = cfg.train.micro_batch_size * cfg.mesh.data
  seq_len = cfg.train.seq_len if seq_len is None else seq_len
  batch = jax.ShapeDtypeStruct(
    (num_microbatches, rows, seq_len + 1), jnp.int32, sharding=batch_sharding(layout)
  )
  return step.lower(
    layout.abstract,
    batch,
    jax.ShapeDtypeStruct((), jnp.float32),
    jax.ShapeDtypeStruct((), jnp.int32),
  )


class CompiledSteps:
  """The run's compiled train steps: one per (micro-batch count the step runs with,
  `schedule.step_microbatches`, and sequence length), compiled when first needed, each
  compilation's time logged. A step that needs more memory than `memory_limit` (bytes, device
  kind: `device_memory.accelerator_memory()`) is a ConfigError naming the fixes, before it runs."""

  def __init__(
    self,
    cfg: Config,
    layout: StateLayout,
    log: Callable[[str], None],
    compiling: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    memory_limit: tuple[int, str] | None = None,
  ):
    # `compiling`: the context a compilation runs in (the trainer's: its hang watchdog paused).
    self.cfg, self.layout, self.log, self.compiling = cfg, layout, log, compiling
    self.memory_limit = memory_limit
    self.programs: dict[tuple[int, int], Any] = {}  # (micro-batches, length + 1) -> compiled

  def shape(self, global_batch_size: int, seq_len: int) -> tuple[int, int, int]:
    """The batch [micro-batches, rows, length + 1] the step runs on at this global batch size
    and sequence length."""
    micro = schedule.step_microbatches(self.cfg, global_batch_size)
    return batches.batch_shape(self.cfg, global_batch_size, seq_len, micro)

  def compiled(self, global_batch_size: int, seq_len: int) -> bool:
    """Whether that step is compiled already."""
    shape = self.shape(global_batch_size, seq_len)
    return (shape[0], shape[2]) in self.programs

  def get(self, global_batch_size: int, seq_len: int):
    """The compiled step for this global batch size and sequence length."""
    shape = self.shape(global_batch_size, seq_len)
    key = (shape[0], shape[2])
    if key not in self.programs:
      self.programs[key] = self.compile(shape)
    return self.programs[key]

  def compile(self, batch_shape: tuple[int, int, int]):
    """The step compiled for batches [micro-batches, rows, length + 1], its time logged."""
    cfg, start = self.cfg, time.perf_counter()
    with self.compiling():
      compiled = lower_train_step(cfg, self.layout, batch_shape[0], batch_shape[2] - 1).compile()
    bubble = ''
    if cfg.mesh.pipeline > 1:
      fraction = self.layout.placement.bubble_fraction(
        batch_shape[0], cfg.pipeline.microbatch_group
      )
      bubble = f', pipeline bubble {fraction:.3f}'
    self.log(
      f'> compiled the train step for {batch_shape[0]} micro-batch(es) of '
      f'{batch_shape[1]}x{batch_shape[2]} tokens in {time.perf_counter() - start:.1f} s'
      f'{bubble}'
    )
    self.check_fits(compiled, batch_shape)
    return compiled

  def check_fits(self, compiled, batch_shape: tuple[int, int, int]) -> None:
    """A ConfigError when XLA's peak for the compiled step is more than `memory_limit`: the run
    would otherwise fail at the step's first allocation with XLA's out-of-memory report."""
    memory = compiled.memory_analysis()
    if self.memory_limit is None or memory is None:
      return
    limit, kind = self.memory_limit
    peak = device_memory.peak_bytes(memory)
    if peak <= limit:
      return
    cfg = self.cfg
    fixes = [f'a smaller train.micro_batch_size (now {cfg.train.micro_batch_size})']
    if cfg.model.remat_policy != 'full':
      fixes.append("model.remat_policy='full'")
    if cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == 'gpipe':
      fixes.append("pipeline.schedule='1f1b' (GPipe keeps every micro-batch in flight)")
    if 'data' in own_gradient_axes(cfg, self.layout):
      fixes.append(
        "pipeline.grad_sync='tick' (under 'step' each data rank holds its whole fp32 gradient)"
      )
    fixes.append('more devices (mesh.tensor, mesh.pipeline, or mesh.zero_stage=3 over mesh.data)')
    gib = 2**30
    raise ConfigError(
      f'the train step for {batch_shape[0]} micro-batch(es) of {batch_shape[1]}x'
      f"{batch_shape[2]} tokens needs {peak / gib:.2f} GiB per device (XLA's figure), more "
      f'than the {limit / gib:.2f} GiB JAX may use of one {kind}. Use '
      f'{", ".join(fixes)}; python -m t5x_like.plan --config CFG --search --gpus N --gpu KIND '
      'ranks the layouts that fit'
    )
