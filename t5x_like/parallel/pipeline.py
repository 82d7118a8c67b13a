"""Pipeline parallelism over the `pipeline` mesh axis: one SPMD program, a circular schedule.

Layer placement. The L layers are cut into chunks of `chunk` layers; chunk c = r * P + s runs on
stage s in repeat r (R repeats: the circular/interleaved schedule). When P * R does not divide L,
some stages get one padding slot (an identity layer): never more than one per stage, first and
last stages first (BLOOM-176B put 5 blocks + the embedding on those and 6 on the others).

Storage. In memory, layer params are stacked in *stage-major* order [P * R * chunk, ...] so that
splitting the leading dim over `pipeline` gives every stage exactly its own slots. Checkpoints use
the canonical order [L, ...]; `to_storage` / `to_canonical` convert (the identity when P = R = 1),
so a checkpoint saved with any P and R restores with any other.

Schedule. Micro-batch k enters stage 0 at time k (k < M * R; repeat r = k // M of micro-batch
k % M) and stage s works on injection t - s at time t, for T = M * R + P - 1 steps. Stage outputs
move to the next stage with a roll over the stage dim (a collective permute); with R > 1 the last
stage's outputs wait in a buffer until their micro-batch re-enters stage 0 (this needs M >= P). The
bubble is (P - 1) / (M * R + P - 1). The backward pass is the transpose of the same scan.

Embedding and head. The vocabulary is split over `tensor` x `pipeline` when they divide it (see
partitioning), so the 250k-row embedding is spread over every stage instead of sitting on the first
and last. The lookup of the micro-batch entering stage 0 runs at every tick (kept only while
micro-batches enter). The head + loss of the micro-batch leaving the last stage run in the same
tick, computed by all stages together (vocab-parallel), so the last stage's outputs are never
stacked over the T ticks. In the first P - 1 ticks no micro-batch leaves: under 'full' the head
is skipped; otherwise it runs on placeholder activations and its result is dropped ((P - 1) / M
more head work, against [T, rows, S, h] activations kept).

Memory under remat_policy='full'. Only each tick's stage inputs are kept (as raw bits, see
`recompute_in_backward`); the backward pass recomputes the tick, and inside that recomputation
each layer keeps only its matmul outputs, not all `chunk` layers' attention probabilities.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AxisType

from t5x_like.config import Config
from t5x_like.kernels.residuals import LOSS_RESIDUALS
from t5x_like.mesh import partitioning
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib


@dataclasses.dataclass(frozen=True)
class LayerPlacement:
  num_layers: int
  stages: int
  repeats: int
  chunk: int
  slot_layer: np.ndarray  # [stages, repeats, chunk] logical layer of each slot, -1 for padding

  @property
  def slots_per_stage(self) -> int:
    return self.repeats * self.chunk

  @property
  def num_slots(self) -> int:
    return self.stages * self.slots_per_stage

  @property
  def is_identity(self) -> bool:
    return self.num_slots == self.num_layers and self.repeats == 1

  @property
  def storage_slots(self) -> np.ndarray:
    """Logical layer of each storage position (stage-major order), -1 for padding."""
    return self.slot_layer.reshape(-1)

  @property
  def storage_position(self) -> np.ndarray:
    """Storage position of each logical layer."""
    position = np.empty(self.num_layers, np.int32)
    for pos, layer in enumerate(self.storage_slots):
      if layer >= 0:
        position[layer] = pos
    return position

  def layers_per_stage(self) -> list[int]:
    return [int((self.slot_layer[s] >= 0).sum()) for s in range(self.stages)]

  def bubble_fraction(self, num_microbatches: int, microbatch_group: int = 0) -> float:
    """The idle share of the stages' ticks. `microbatch_group` G > 0 (pipeline.microbatch_group):
    the schedule runs over groups of G micro-batches, each with its own fill and drain."""
    per_schedule = microbatch_group or num_microbatches
    return (self.stages - 1) / (per_schedule * self.repeats + self.stages - 1)

  def describe(self) -> str:
    padding = self.num_slots - self.num_layers
    cost = (
      (
        f'{padding} padding slot(s) (identity layers on stages '
        f'{[s for s in range(self.stages) if (self.slot_layer[s] < 0).any()]}), costing '
        f'{padding / self.num_slots:.1%} of the layer compute'
      )
      if padding
      else 'no padding'
    )
    return (
      f'{self.num_layers} layers on {self.stages} stages x {self.repeats} repeat(s) of '
      f'{self.chunk} layer(s): layers per stage {self.layers_per_stage()}; {cost}'
    )


def place_layers(num_layers: int, stages: int, repeats: int = 1) -> LayerPlacement:
  chunk = math.ceil(num_layers / (stages * repeats))
  padding = stages * repeats * chunk - num_layers
  if padding > stages:
    raise ValueError(
      f'{num_layers} layers on {stages} stages x {repeats} repeats would need more '
      'than one padding slot per stage'
    )
  # One padding slot (the last slot of the last repeat) on the outermost stages first.
  order = [s for pair in zip(range(stages), reversed(range(stages))) for s in pair]
  padded = set(list(dict.fromkeys(order))[:padding])
  slot_layer = np.full((stages, repeats, chunk), -1, np.int32)
  layer = 0
  for r in range(repeats):
    for s in range(stages):
      for i in range(chunk):
        if s in padded and r == repeats - 1 and i == chunk - 1:
          continue
        slot_layer[s, r, i] = layer
        layer += 1
  assert layer == num_layers
  return LayerPlacement(num_layers, stages, repeats, chunk, slot_layer)


def placement_for(cfg: Config) -> LayerPlacement:
  return place_layers(cfg.model.num_layers, cfg.mesh.pipeline, cfg.pipeline.repeats)


# ----------------------------------------------------------------------------- layout conversion


def is_layer_leaf(path) -> bool:
  return any(getattr(k, 'key', None) == 'layers' for k in path)


def map_layer_leaves(fn, tree):
  """Applies fn to every array under a `layers` key (params and the Adam moments alike)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: fn(x) if is_layer_leaf(path) and getattr(x, 'ndim', 0) else x, tree
  )


def to_storage(placement: LayerPlacement, tree):
  """Canonical [L, ...] layer stacks -> stage-major storage [P * R * chunk, ...] (zero padding)."""
  if placement.is_identity:
    return tree
  slots = jnp.asarray(np.maximum(placement.storage_slots, 0))
  real = jnp.asarray(placement.storage_slots >= 0)

  def convert(x):
    taken = jnp.take(x, slots, axis=0)
    return jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), taken, jnp.zeros_like(taken))

  return map_layer_leaves(convert, tree)


def to_canonical(placement: LayerPlacement, tree):
  """Storage [P * R * chunk, ...] -> canonical [L, ...] layer order."""
  if placement.is_identity:
    return tree
  position = jnp.asarray(placement.storage_position)
  return map_layer_leaves(lambda x: jnp.take(x, position, axis=0), tree)


def storage_shape(placement: LayerPlacement, path, shape: tuple[int, ...]) -> tuple[int, ...]:
  if is_layer_leaf(path) and len(shape) and not placement.is_identity:
    return (placement.num_slots,) + tuple(shape[1:])
  return tuple(shape)


# ----------------------------------------------------------------------------------- schedule


def as_bits(tree, dtype):
  """A compute-dtype tree as raw bits (uint16) when the dtype is 16-bit, else as it is: the same
  bytes, but XLA's CPU backend, which moves bf16 as f32, keeps them at their size, so that
  `python -m t5x_like.plan` on a CPU reports the weight memory a GPU needs."""
  if jnp.dtype(dtype).itemsize != 2:
    return tree
  return jax.tree.map(lambda x: jax.lax.bitcast_convert_type(x.astype(dtype), jnp.uint16), tree)


def scan_carrying_masters(layer, masters, x, count: int, unroll: bool):
  """(x after layer(masters, x, i) for i in [0, count), masters): the layers scanned with the
  masters passed through the carry, so that the transposed scan's cotangent of the masters is
  an accumulator: a pullback handed the fp32 accumulator as that cotangent adds each layer's
  gradient into it in place (1F1B's ticks and the loop without a pipeline)."""

  def one_layer(carry, i):
    x, masters = carry
    # Through a barrier: a carry passed through unchanged is forwarded past the scan by JAX,
    # and its gradient is then summed from zeros and added to the accumulator afterwards.
    return (layer(masters, x, i), jax.lax.optimization_barrier(masters)), None

  (x, masters), _ = jax.lax.scan(one_layer, (x, masters), jnp.arange(count), unroll=unroll)
  return x, masters


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def compute_copy(master, compute, dtype):
  """`compute` (a compute-dtype copy of `master`, possibly as `as_bits`) for the forward pass;
  the gradient goes to `master`, in master's dtype. Used inside the schedule's scan, each use's
  gradient is widened before the scan's transpose adds it up: the micro-batches' gradients
  accumulate in fp32 while the stage computes from a gathered bf16 copy (Megatron's bf16 weights
  with an fp32 main_grad), and no fp32 copy of a stage's weights is ever gathered."""
  del master
  if compute.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
    return jax.lax.bitcast_convert_type(compute, dtype)
  return compute.astype(dtype)


def _compute_copy_forward(master, compute, dtype):
  # An empty residual that carries master's dtype to the backward pass.
  return compute_copy(master, compute, dtype), jnp.zeros((0,), master.dtype)


def _compute_copy_backward(dtype, master_dtype, cotangent):
  return cotangent.astype(master_dtype.dtype), None


compute_copy.defvjp(_compute_copy_forward, _compute_copy_backward)


def _never_save_weights(policy):
  """`policy` (None: save everything), except the per-layer compute-dtype weights (and under
  ZeRO-3 their gathered copies)."""
  return partitioning.never_save(['stage_weights', partitioning.GATHERED_WEIGHTS], policy)


def recompute_in_backward(fn, dtype):
  """`jax.checkpoint(fn, policy=nothing_saveable)` written as a custom VJP: fn's inputs are kept,
  and the backward pass runs fn again from them. fn must take every traced value it uses as an
  argument (a custom VJP cannot close over them). Inputs in a 16-bit compute dtype are kept as
  their raw bits (uint16): the same bytes, but XLA's CPU backend, which has no bf16 data movement,
  would otherwise widen the whole [ticks, ...] bf16 stack of kept stage inputs to f32, and
  `python -m t5x_like.plan` on a CPU would report twice the activation memory a GPU needs."""
  narrow = jnp.dtype(dtype).itemsize == 2

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    as_bits = [narrow and leaf.dtype == dtype for leaf in leaves]

    def keep(args):
      return [
        jax.lax.bitcast_convert_type(leaf, jnp.uint16) if bits else leaf
        for leaf, bits in zip(jax.tree.leaves(args), as_bits)
      ]

    def restore(kept):
      return treedef.unflatten(
        [
          jax.lax.bitcast_convert_type(leaf, dtype) if bits else leaf
          for leaf, bits in zip(kept, as_bits)
        ]
      )

    @jax.custom_vjp
    def recomputed(*args):
      return fn(*args)

    def forward(*args):
      return fn(*args), keep(args)

    def backward(kept, cotangents):
      _, fn_vjp = jax.vjp(fn, *restore(kept))
      return fn_vjp(cotangents)

    recomputed.defvjp(forward, backward)
    return recomputed(*args)

  return call


_EMBED_DROPOUT_ID = 1 << 20  # rng stream of the embedding dropout, apart from the layers' ids


class Schedule:
  """What both schedules share: the layer placement, the master params and their compute copy in
  storage layout, and the functions a tick runs (a stage, the embedding, the head and loss).

  `params` hold the fp32 master values in storage layout, `compute_params` their compute-dtype
  copy, possibly `as_bits` (default: cast here). The stages compute from the copy and every use
  sends its gradient to `params` in fp32 (`compute_copy`), so gradients accumulate over
  micro-batches in fp32 while only the compute copy is gathered.

  `loss_axes`: inside a shard_map over mesh axes that split the batch's rows (each data rank's
  or hybrid copy's own schedule, training/step.py's `own_gradient_axes`), those axes: each
  micro-batch's loss is then this rank's rows' sum over the targets of all the ranks' rows, so
  that the ranks' losses and gradients sum to the whole batch's.
  """

  def __init__(
    self,
    params,
    batch,
    rng,
    *,
    cfg: Config,
    placement: LayerPlacement,
    ctx: model_lib.Context,
    deterministic: bool,
    compute_params=None,
    loss_axes: tuple[str, ...] = (),
  ):
    P, R, chunk = placement.stages, placement.repeats, placement.chunk
    self.cfg, self.placement, self.ctx, self.batch, self.rng = cfg, placement, ctx, batch, rng
    # Under ZeRO-3 `ctx` gathers the top-level weights (embedding, norms) where they are used;
    # the stages' layers, vmapped over `pipeline`, are gathered by the partitioner.
    self.stage_ctx = model_lib.Context(cfg.model, ctx.mesh)
    self.deterministic = deterministic
    self.loss_axes = loss_axes
    self.num_microbatches = batch.shape[0]
    self.activation_shape = (batch.shape[1], batch.shape[2] - 1, cfg.model.hidden_size)
    self.dtype = ctx.dtype
    if compute_params is None:
      compute_params = as_bits(params, self.dtype)
    compute_params = jax.lax.stop_gradient(compute_params)
    self.params, self.compute_params = params, compute_params
    by_stage = lambda tree: jax.tree.map(lambda w: w.reshape((P, R, chunk) + w.shape[1:]), tree)
    # (master, compute) pairs, read together at each use.
    self.layers = (by_stage(params['layers']), by_stage(compute_params['layers']))
    self.head_params = tuple(
      {k: tree[k] for k in ('word_embeddings', 'final_ln')} for tree in (params, compute_params)
    )
    self.embedding_params = tuple(
      {k: v for k, v in tree.items() if k != 'layers'} for tree in (params, compute_params)
    )
    self.slot_is_real = jnp.asarray(placement.slot_layer >= 0)
    self.slot_layer = jnp.asarray(placement.slot_layer)
    self.full = cfg.model.remat_policy == 'full'
    # Under 'full' a whole tick is recomputed in the backward pass; inside that recompute each
    # layer still keeps only its matmul outputs for its own backward, not the attention
    # probabilities and dropout bits of all `chunk` layers at once.
    self.policy = model_lib.remat_policy('save_dots' if self.full else cfg.model.remat_policy)
    self.hidden_dropout = 0.0 if deterministic else cfg.model.hidden_dropout
    self.unroll = cfg.model.scan_unroll or cfg.model.unroll_layers  # the stage's layer scan
    self.buffer_names = ('stages',) + ctx.residual_names  # split along seq under sequence_parallel
    # All stages at once: the stage dim is split over `pipeline`.
    vmap_stages = lambda run: jax.vmap(
      run, in_axes=(0, 0, 0, 0, 0, 0, None), spmd_axis_name='pipeline'
    )
    self.stages = vmap_stages(self.run_stage)
    self.stages_carrying_masters = vmap_stages(self.run_stage_carrying_masters)

  def read(self, master, compute):
    """Inside the scan, so that each tick's gradient is widened before it is accumulated."""
    return jax.tree.map(lambda m, c: compute_copy(m, c, self.dtype), master, compute)

  def keyed(self, rng, *ids):
    if self.deterministic:
      return None
    return jax.random.fold_in(jax.random.fold_in(rng, ids[0]), ids[1])

  def run_stage(self, stage_layers, x, repeat, injection, stage_real, stage_ids, rng):
    """One stage's `chunk` layers of its `repeat` on x, the activations of `injection`."""
    masters, computes = stage_layers
    layer = self._layer(computes, repeat, injection, stage_real, stage_ids, rng)
    body = lambda x, i: (layer(masters, x, i), None)
    x, _ = jax.lax.scan(body, x, jnp.arange(self.placement.chunk), unroll=self.unroll)
    return x

  def run_stage_carrying_masters(
    self, stage_layers, x, repeat, injection, stage_real, stage_ids, rng
  ):
    """`run_stage` with the masters passed through the layer scan's carry: (x, masters). The
    cotangent of that carry is the transposed scan's gradient accumulator: a pullback handed
    the fp32 accumulator as the masters' cotangent adds each layer's gradient into it in
    place, and no stage-sized gradient of the tick is held beside it."""
    masters, computes = stage_layers
    layer = self._layer(computes, repeat, injection, stage_real, stage_ids, rng)
    return scan_carrying_masters(layer, masters, x, self.placement.chunk, self.unroll)

  def _layer(self, computes, repeat, injection, stage_real, stage_ids, rng):
    """(masters, x, i) -> layer i of the stage's `repeat` on x, recomputed in the backward
    pass as the remat policy says."""
    ctx = self.stage_ctx
    real = jax.lax.dynamic_index_in_dim(stage_real, repeat, 0, False)
    ids = jax.lax.dynamic_index_in_dim(stage_ids, repeat, 0, False)

    def layer(masters, x, i):
      master, compute = jax.tree.map(lambda a: a[repeat, i], (masters, computes))
      # Named so that no remat policy saves it: a per-tick copy of the weights would make the
      # scan keep T copies of the stage for the backward pass.
      weights = checkpoint_name(self.read(master, compute), 'stage_weights')
      y = model_lib.apply_block(
        weights, x, ctx, self.deterministic, self.keyed(rng, injection, ids[i])
      )
      return jnp.where(real[i], y, x)

    if self.cfg.model.remat_policy == 'none':
      return layer
    return jax.checkpoint(layer, policy=_never_save_weights(self.policy), prevent_cse=False)

  def input_tokens(self, m):
    """Micro-batch m's input token ids [rows, S]."""
    return losses.split_tokens(jax.lax.dynamic_index_in_dim(self.batch, m, 0, False))[0]

  def embed_with(self, embedding_params, m):
    """Micro-batch m's embedded (and dropped-out) tokens."""
    return self.embed_rows_with(embedding_params, self.lookup_with(embedding_params, m), m)

  def lookup_with(self, embedding_params, m):
    """Micro-batch m's rows of the token table, in the compute dtype."""
    embedding = self.ctx.gather_top(self.read(*embedding_params))
    return model_lib.lookup_tokens(embedding, self.input_tokens(m), self.ctx)

  def embed_rows_with(self, embedding_params, rows, m):
    """`embed_with` from micro-batch m's looked-up `rows`: its embedding_params need no token
    table."""
    embedding = self.ctx.gather_top(self.read(*embedding_params))
    x = model_lib.embed_rows(embedding, rows, self.cfg.model, self.ctx)
    return model_lib.dropout(x, self.hidden_dropout, self.keyed(self.rng, m, _EMBED_DROPOUT_ID))

  def head_loss(self, head_params, x, tokens):
    """The mean loss of the micro-batch `tokens` from the last stage's output x."""
    _, labels, weights = losses.split_tokens(tokens)
    count = weights.sum()
    if self.loss_axes:  # one scalar all-reduce per micro-batch: the targets of all its rows
      count = jax.lax.psum(count, self.loss_axes)
    head_params = self.ctx.gather_top(self.read(*head_params))
    return losses.head_loss(head_params, x, labels, weights, count, self.cfg.model, self.ctx)

  def loss_denominator(self):
    """Micro-batches the step's mean is over: the real ones under the ramp-up's padding (those
    after the real ones are padding only: a loss of 0 and no gradient)."""
    if self.cfg.train.rampup_microbatch_multiple:
      return losses.real_microbatches(self.batch).sum()
    return self.num_microbatches

  def zero_buffer(self, leading: int):
    return self.ctx.constrain(
      jnp.zeros((leading,) + self.activation_shape, self.dtype), self.buffer_names
    )


def loss_and_grads(
  params,
  batch,
  rng,
  *,
  cfg: Config,
  placement: LayerPlacement,
  ctx: model_lib.Context,
  deterministic: bool = True,
  compute_params=None,
  loss_scale=None,
  loss_axes: tuple[str, ...] = (),
):
  """The pipelined model's mean loss of batch [M, rows, S + 1] (`pipeline_loss`) and its fp32
  gradient w.r.t. `params`, in the schedule of `pipeline.schedule`: 'gpipe' differentiates
  `pipeline_loss`, '1f1b' computes its gradients itself (`one_f_one_b_loss_and_grads`).

  loss_scale (a traced scalar, not differentiated): the loss and gradients of
  `loss_scale x pipeline_loss`, for the step's groups of micro-batches (pipeline.microbatch_group,
  'gpipe' only). loss_axes: see `Schedule`."""
  kwargs = dict(
    cfg=cfg,
    placement=placement,
    ctx=ctx,
    deterministic=deterministic,
    compute_params=compute_params,
    loss_axes=loss_axes,
  )
  if cfg.pipeline.schedule == '1f1b':
    if loss_scale is not None:
      raise ValueError("pipeline.schedule='1f1b' runs no groups of micro-batches (no loss_scale)")
    return one_f_one_b_loss_and_grads(params, batch, rng, **kwargs)
  if loss_scale is None:
    return jax.value_and_grad(lambda p: pipeline_loss(p, batch, rng, **kwargs))(params)
  return jax.value_and_grad(lambda p: loss_scale * pipeline_loss(p, batch, rng, **kwargs))(params)


def pipeline_loss(
  params,
  batch,
  rng,
  *,
  cfg: Config,
  placement: LayerPlacement,
  ctx: model_lib.Context,
  deterministic: bool = True,
  compute_params=None,
  loss_axes: tuple[str, ...] = (),
):
  """Mean next-token loss of batch [M, rows, S + 1] through the pipelined model (the GPipe
  order: all forwards, then the scan's transpose runs all backwards): the mean of the
  micro-batches' means over their targets that are not padding (`losses.PAD_ID`), over the
  micro-batches that hold any. Differentiate it for the gradients; see `Schedule` for the
  params."""
  sched = Schedule(
    params,
    batch,
    rng,
    cfg=cfg,
    placement=placement,
    ctx=ctx,
    deterministic=deterministic,
    compute_params=compute_params,
    loss_axes=loss_axes,
  )
  P, R = placement.stages, placement.repeats
  M = sched.num_microbatches
  full, stages, buffer_names = sched.full, sched.stages, sched.buffer_names

  # Computed at every tick (a lookup and a LayerNorm, cheap next to a stage) and recomputed in
  # the backward pass: only the token ids are kept per tick, and the table, a loop invariant of
  # the scan, is never copied. (Under a cond the table would be saved once per tick.)
  embed = jax.checkpoint(
    lambda m: sched.embed_with(sched.embedding_params, m),
    policy=jax.checkpoint_policies.nothing_saveable,
    prevent_cse=False,
  )
  head_loss = sched.head_loss
  if not full:
    # Keep only the head's input per tick and recompute [rows, S, V] logits in backward; and
    # the chunked loss's log-sum-exp ([rows, S]), without which the backward pass would run its
    # vocabulary loop twice (kernels/residuals.py).
    head_loss = jax.checkpoint(
      head_loss,
      policy=jax.checkpoint_policies.save_only_these_names(LOSS_RESIDUALS),
      prevent_cse=False,
    )

  def stage_tick(
    layers, head_params, inputs, repeat, injection, t, batch, rng, slot_is_real, slot_layer
  ):
    """All stages' work at tick t, and the loss of the micro-batch that leaves the last stage in
    its last repeat (micro-batch m at tick (R - 1) * M + m + P - 1; 0 while none does)."""
    outputs = stages(layers, inputs, repeat, injection, slot_is_real, slot_layer, rng)
    outputs = ctx.constrain(outputs, buffer_names)
    m_out = t - (P - 1) - (R - 1) * M
    leaving = jax.lax.dynamic_index_in_dim(batch, jnp.clip(m_out, 0, M - 1), 0, False)
    # The head runs in the tick on the last stage's outputs, so nothing [T, rows, S, h] is ever
    # stacked: under 'full' the backward pass recomputes them from the stage inputs it keeps
    # anyway. In the P - 1 ticks before the first micro-batch leaves there is no loss: under
    # 'full' a cond skips the head (the tick keeps only its inputs whatever it contains); without
    # the tick-level recomputation a cond would keep its branch's residuals, the head's weights
    # among them, once per tick, so the head runs on placeholder activations and `where` drops
    # its value and gradient.
    if full:
      return outputs, jax.lax.cond(
        m_out >= 0, head_loss, lambda *_: jnp.float32(0.0), head_params, outputs[P - 1], leaving
      )
    loss = head_loss(head_params, outputs[P - 1], leaving)
    return outputs, jnp.where(m_out >= 0, loss, 0.0)

  if full:
    # Megatron's full recomputation: keep only each stage's input per tick and recompute the
    # stage's forward (and the head's) once in the backward pass. (A custom VJP cannot close
    # over traced values, so the tick takes them all as arguments.)
    stage_tick = recompute_in_backward(stage_tick, sched.dtype)

  def tick(carry, t):
    buffer, waiting = carry
    injection = t - jnp.arange(P)
    repeat = jnp.clip(injection // M, 0, R - 1)
    m_in = t % M
    zeros = jnp.zeros(sched.activation_shape, sched.dtype)
    later = jax.lax.dynamic_index_in_dim(waiting, m_in, 0, False) if R > 1 else zeros
    entering = jnp.where(t < M, embed(m_in), later)
    # Stage 0's slot replaced by a select, not `.at[0].set`: the scatter's transpose is a gather,
    # on which jaxlib 0.11.2's SPMD partitioner aborts when the buffer is split along the sequence
    # and a manual data axis (sequence parallelism with a per-rank pipeline;
    # spmd_partitioner_util.cc, ExpandDeviceGroupsWithIota). The select's transpose is a masked
    # sum over the stages; a dynamic update's, a dynamic slice, made XLA all-gather the buffer
    # over `pipeline` (tests/test_sequence_parallel.py).
    first = (jnp.arange(P) == 0).reshape((P,) + (1,) * entering.ndim)
    inputs = ctx.constrain(jnp.where(first, entering[None], buffer), buffer_names)
    outputs, loss = stage_tick(
      sched.layers,
      sched.head_params,
      inputs,
      repeat,
      injection,
      t,
      batch,
      rng,
      sched.slot_is_real,
      sched.slot_layer,
    )
    if R > 1:
      last, done = outputs[P - 1], t - (P - 1)
      m_out = jnp.mod(done, M)
      waiting = jax.lax.dynamic_update_index_in_dim(
        waiting, jnp.where(done >= 0, last, waiting[m_out]), m_out, 0
      )
    return (jnp.roll(outputs, 1, axis=0), waiting), loss

  waiting = jnp.zeros((M if R > 1 else 1,) + sched.activation_shape, sched.dtype)
  waiting = ctx.constrain(waiting, (None,) + ctx.residual_names)  # sequence_parallel: split too
  _, tick_losses = jax.lax.scan(
    tick, (sched.zero_buffer(P), waiting), jnp.arange(M * R + P - 1), unroll=cfg.model.scan_unroll
  )
  # Padding micro-batches of the ramp-up add 0. (Not skipped: within a tick the stages run under
  # vmap, where a cond becomes a select. A cond that skipped the ticks after the last real
  # micro-batch had left worked, but its per-tick weight-gradient output cost BLOOM-176B
  # 16.7 GiB more per device, docs/benchmarks.md.)
  return tick_losses.sum() / sched.loss_denominator()


def one_f_one_b_loss_and_grads(
  params,
  batch,
  rng,
  *,
  cfg: Config,
  placement: LayerPlacement,
  ctx: model_lib.Context,
  deterministic: bool = True,
  compute_params=None,
  loss_axes: tuple[str, ...] = (),
):
  """`pipeline_loss` and its gradient w.r.t. `params` in the 1F1B order (pipeline.schedule =
  '1f1b', one repeat): a micro-batch's backward pass starts as soon as it has left the last
  stage, so a stage keeps the inputs of at most 2P - 1 micro-batches, not of all M.

  A scan of ticks, not differentiated: at tick t stage s runs the forward of micro-batch t - s
  and the backward of micro-batch t - (2P - 2) + s, recomputing its forward from the kept input
  (every remat policy is stage-level recomputation here). The last stage's forward, the head's
  forward and backward and that stage's backward of the same micro-batch run in one tick;
  cotangents move one stage down per tick. The fill (P - 1 ticks of forwards only, a scan of
  their own) and drain (P - 1 ticks of backwards only) skip the idle half, so the step does
  GPipe's work: the bubble is the same (P - 1) / (M + P - 1), and the gradients accumulate in
  fp32 in the scan's carry."""
  sched = Schedule(
    params,
    batch,
    rng,
    cfg=cfg,
    placement=placement,
    ctx=ctx,
    deterministic=deterministic,
    compute_params=compute_params,
    loss_axes=loss_axes,
  )
  P, M = placement.stages, sched.num_microbatches
  slots = 2 * P - 1  # a stage keeps micro-batches t - (2P - 2) + s .. t - s: at most 2P - 1
  stage_ids = jnp.arange(P)
  scale = 1.0 / sched.loss_denominator()
  masters, computes = sched.layers
  head_master, head_compute = sched.head_params
  embedding_master, embedding_compute = sched.embedding_params
  zero_repeat = jnp.zeros((P,), jnp.int32)

  # Each layer's gradient is added into the stage's fp32 accumulator by the backward's own layer
  # scan (`backward_stages_into`), not returned as a tick's stage-sized gradient and added after
  # (tr11 under 'step': 6.89 GiB of bf16 gradient beside the accumulator; docs/benchmarks.md).
  # The backward then runs outside any conditional, in ticks of their own after the fill's:
  # a conditional that passes the accumulator through made XLA hold it twice.
  # Where this schedule's rank holds its stage's whole fp32 gradient (each data rank its own
  # schedule, or no data split), the weights outside the stages are differentiated w.r.t.
  # compute-dtype stand-ins for the masters, whose values are never read (`compute_copy`): a
  # tick's gradient of them comes out in the compute dtype, half the bytes of fp32, and is
  # widened as it is added, as DeepSpeed's BF16 optimizer adds each micro-batch's bf16 gradient
  # to its fp32 accumulator. Where the data ranks share the schedule, the accumulators are split
  # over `data`, and each gradient is reduce-scattered into its split as it is computed.
  own_gradient = 'data' in loss_axes or ctx.mesh is None or ctx.mesh.shape.get('data', 1) == 1
  # Where one schedule runs over the whole mesh (no shard_map over ranks with schedules of their
  # own), the stage inputs are kept outside the forward's conditional: kept inside it, XLA copied
  # them for the branch that passes them through (tr8_104b: 3.9 GiB). Inside a shard_map the
  # write outside moved XLA's schedule to a higher peak (docs/benchmarks.md). A drain tick's
  # write is safe: it lands in the slot of a micro-batch whose backward has run.
  keep_outside_forward = not loss_axes
  # The cotangents of the rows the embedding looked up are scattered straight into the token
  # table's accumulator. A tick's whole-table gradient, a scatter-add into zeros, cost tr11 5 GiB
  # at the step's peak under 'step', and under 'tick' XLA all-reduced it unsplit, 13.4 GiB a tick
  # (docs/benchmarks.md). Not inside hybrid sharding's manual `replica` when the accumulator is
  # split over `data`: XLA's partitioner aborts on that scatter-add (ExpandDeviceGroupsWithIota;
  # `partitioning.lookup_table` takes the whole-table gradient there).
  mesh = ctx.mesh
  scatter_rows = own_gradient or mesh is None or AxisType.Manual not in mesh.axis_types

  def differentiated(tree):
    """The embedding weights its backward differentiates: with scatter_rows all but the table."""
    return {k: v for k, v in tree.items() if not (scatter_rows and k == 'word_embeddings')}

  if own_gradient:
    stand_in = lambda compute: jax.tree.map(lambda c: jnp.zeros(c.shape, sched.dtype), compute)
    head_stand_ins = stand_in(head_compute)
    embedding_stand_ins = stand_in(differentiated(embedding_compute))
  else:
    head_stand_ins = head_master
    embedding_stand_ins = differentiated(embedding_master)

  def backward_stages_into(layer_grads, x, cotangent, injection):
    """Every stage's backward, its forward recomputed: (layer_grads plus the stages' weight
    gradients, their input cotangents). The pullback of the vmapped stages, not a vmap of
    each stage's pullback: XLA then holds 3 GiB less per device on tr11 (docs/benchmarks.md)."""
    forward = lambda masters, x: sched.stages_carrying_masters(
      (masters, computes), x, zero_repeat, injection, sched.slot_is_real, sched.slot_layer, rng
    )
    _, pullback = jax.vjp(forward, masters, x)
    return pullback((cotangent, layer_grads))

  def head_forward_backward(x, tokens):
    loss, pullback = jax.vjp(
      lambda master, x: sched.head_loss((master, head_compute), x, tokens), head_stand_ins, x
    )
    head_grads, x_cotangent = pullback(jnp.asarray(scale, loss.dtype))
    return loss, head_grads, x_cotangent

  def no_head(x, tokens):
    del tokens
    return jnp.float32(0.0), jax.tree.map(jnp.zeros_like, head_stand_ins), jnp.zeros_like(x)

  def embedding_backward(m, cotangent):
    """Micro-batch m's embedding gradients from its output's cotangent: (those of the
    weights but the token table, w.r.t. their stand-ins, the cotangents of the looked-up rows),
    which `add_embedding_gradients` adds up; without scatter_rows (all the weights', None)."""
    if not scatter_rows:
      _, pullback = jax.vjp(
        lambda master: sched.embed_with((master, embedding_compute), m), embedding_stand_ins
      )
      return pullback(cotangent)[0], None
    rows = sched.lookup_with(sched.embedding_params, m)
    embed = lambda master, rows: sched.embed_rows_with(
      (master, differentiated(embedding_compute)), rows, m
    )
    _, pullback = jax.vjp(embed, embedding_stand_ins, rows)
    return pullback(cotangent)

  def no_embedding_gradients():
    zeros = jax.tree.map(jnp.zeros_like, embedding_stand_ins)
    return zeros, jnp.zeros(sched.activation_shape, sched.dtype) if scatter_rows else None

  accumulate = lambda total, tick_grads: jax.tree.map(
    lambda g, d: g + d.astype(g.dtype), total, tick_grads
  )

  def add_embedding_gradients(other_grads, embedding_grads, t):
    """other_grads (the accumulators of the weights outside the stages) plus a tick's
    `embedding_backward` of the micro-batch stage 0 runs backward at tick t (zeros where
    none)."""
    weight_grads, row_cotangents = embedding_grads
    other_grads = dict(
      other_grads, **accumulate({k: other_grads[k] for k in weight_grads}, weight_grads)
    )
    if row_cotangents is None:
      return other_grads
    tokens = sched.input_tokens(jnp.clip(t - (2 * P - 2), 0, M - 1))
    table = other_grads['word_embeddings']
    # Each use of a row adds its fp32 cotangent, as `model.lookup_rows`' own gradient does.
    table = table.at[tokens].add(row_cotangents.astype(table.dtype))
    return dict(other_grads, word_embeddings=table)

  def stage_inputs(t, forward):
    """The stages' inputs at tick t: micro-batch t's embedding enters stage 0."""
    entering = sched.embed_with(sched.embedding_params, jnp.clip(t, 0, M - 1))
    return ctx.constrain(forward.at[0].set(entering), sched.buffer_names)

  def keep_inputs(t, inputs, kept):
    """Stage s's input at tick t (micro-batch t - s) kept in slot (t - s) mod (2P - 1)."""
    return jax.vmap(
      lambda k, x, slot: jax.lax.dynamic_update_index_in_dim(k, x, slot, 0),
      spmd_axis_name='pipeline',
    )(kept, inputs, jnp.mod(t - stage_ids, slots))

  def forward_half(t, inputs):
    """Stage s runs micro-batch t - s."""
    outputs = sched.stages(
      (masters, computes),
      inputs,
      zero_repeat,
      t - stage_ids,
      sched.slot_is_real,
      sched.slot_layer,
      rng,
    )
    return ctx.constrain(outputs, sched.buffer_names)

  def forward_and_keep(t, forward, kept):
    """`forward_half` and `keep_inputs` together: a fill tick, and the forward's conditional
    inside a shard_map."""
    inputs = stage_inputs(t, forward)
    return forward_half(t, inputs), keep_inputs(t, inputs, kept)

  def backward_half(t, cotangents, kept, grads):
    """Stage s runs the backward of micro-batch t - (2P - 2) + s from its kept input: the
    cotangents one stage down, and grads with this tick's weight gradients added."""
    layer_grads, other_grads = grads
    injection = t - (2 * P - 2) + stage_ids
    active = (injection >= 0) & (injection < M)
    # Zero cotangents give exactly zero gradients: the idle stages add nothing.
    cotangents = jnp.where(active[:, None, None, None], cotangents, 0).astype(sched.dtype)
    inputs = jax.vmap(
      lambda k, slot: jax.lax.dynamic_index_in_dim(k, slot, 0, False), spmd_axis_name='pipeline'
    )(kept, jnp.mod(injection, slots))
    layer_grads, input_cotangents = backward_stages_into(layer_grads, inputs, cotangents, injection)
    embedding_grads = jax.lax.cond(
      active[0],
      lambda: embedding_backward(jnp.clip(injection[0], 0, M - 1), input_cotangents[0]),
      no_embedding_gradients,
    )
    input_cotangents = ctx.constrain(input_cotangents, sched.buffer_names)
    grads = (layer_grads, add_embedding_gradients(other_grads, embedding_grads, t))
    return jnp.roll(input_cotangents, -1, axis=0), grads

  def forward_tick(t, forward, kept):
    """Tick t's forwards (none in the drain's P - 1 ticks): (the stages' outputs, kept)."""
    if keep_outside_forward:
      inputs = stage_inputs(t, forward)
      kept = keep_inputs(t, inputs, kept)
      return jax.lax.cond(t < M + P - 1, forward_half, lambda t, x: x, t, inputs), kept
    return jax.lax.cond(t < M + P - 1, forward_and_keep, lambda t, f, k: (f, k), t, forward, kept)

  def fill_tick(carry, t):
    # No conditional: a fill tick always runs its forwards. With P = 2 XLA inlines the one fill
    # tick, and inside a conditional its forward read the ZeRO-1 gather's buffer while the tick
    # loop read a transposed copy, both live (13B on 64 H100s: 10.8 GiB more; docs/benchmarks.md).
    outputs, kept = forward_and_keep(t, *carry)
    return (jnp.roll(outputs, 1, axis=0), kept), None

  def tick(carry, t):
    forward, cotangents, kept, (layer_grads, other_grads), loss_sum = carry
    outputs, kept = forward_tick(t, forward, kept)
    m_out = t - (P - 1)
    leaving = jax.lax.dynamic_index_in_dim(batch, jnp.clip(m_out, 0, M - 1), 0, False)
    loss, head_grads, last_cotangent = jax.lax.cond(
      (m_out >= 0) & (m_out < M), head_forward_backward, no_head, outputs[P - 1], leaving
    )
    other_grads = dict(
      other_grads, **accumulate({k: other_grads[k] for k in head_grads}, head_grads)
    )
    cotangents = cotangents.at[P - 1].set(last_cotangent.astype(sched.dtype))
    grads = (layer_grads, other_grads)
    # The head's gradient added before the stages' backward reads its kept inputs, not beside
    # the recomputed forward (XLA's schedule otherwise keeps it: 13B on 64 H100s under 'step'
    # 1.2 GiB more, tr11 under 'tick' 0.5).
    grads, cotangents, kept = jax.lax.optimization_barrier((grads, cotangents, kept))
    cotangents, grads = backward_half(t, cotangents, kept, grads)
    return (jnp.roll(outputs, 1, axis=0), cotangents, kept, grads, loss_sum + loss), None

  kept = ctx.constrain(
    jnp.zeros((P, slots) + sched.activation_shape, sched.dtype),
    ('stages', None) + ctx.residual_names,
  )
  # The fill's P - 1 ticks run forwards only, in a scan of their own; every tick after them runs
  # the stages' backward.
  (forward, kept), _ = jax.lax.scan(
    fill_tick, (sched.zero_buffer(P), kept), jnp.arange(P - 1), unroll=cfg.model.scan_unroll
  )
  fp32_zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)
  carry = (
    forward,
    sched.zero_buffer(P),
    kept,
    (fp32_zeros(masters), fp32_zeros(embedding_master)),
    jnp.float32(0.0),
  )
  (_, _, _, (layer_grads, other_grads), loss_sum), _ = jax.lax.scan(
    tick, carry, jnp.arange(P - 1, M + 2 * P - 2), unroll=cfg.model.scan_unroll
  )
  layer_grads = jax.tree.map(lambda g, p: g.reshape(p.shape), layer_grads, params['layers'])
  grads = dict(other_grads, layers=layer_grads)
  return loss_sum * scale, grads
