"""Pipeline parallelism over the `pipeline` mesh axis: one SPMD program, a circular schedule.

Stage plan. The L layers are cut into chunks of `chunk` layers; chunk c = r * P + s runs on stage
s in repeat r (R repeats: the circular/interleaved schedule). When P * R does not divide L, some
stages get one padding slot (an identity layer): never more than one per stage, first and last
stages first (BLOOM-176B put 5 blocks + the embedding on those and 6 on the others).

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
`_recompute_in_backward`); the backward pass recomputes the tick, and inside that recomputation
each layer keeps only its matmul outputs, not all `chunk` layers' attention probabilities.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np

from t5x_like import losses, model as model_lib
from t5x_like.config import Config


@dataclasses.dataclass(frozen=True)
class StagePlan:
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
    cost = (f'{padding} padding slot(s) (identity layers on stages '
            f'{[s for s in range(self.stages) if (self.slot_layer[s] < 0).any()]}), costing '
            f'{padding / self.num_slots:.1%} of the layer compute') if padding else 'no padding'
    return (f'{self.num_layers} layers on {self.stages} stages x {self.repeats} repeat(s) of '
            f'{self.chunk} layer(s): layers per stage {self.layers_per_stage()}; {cost}')


def make_plan(num_layers: int, stages: int, repeats: int = 1) -> StagePlan:
  chunk = math.ceil(num_layers / (stages * repeats))
  padding = stages * repeats * chunk - num_layers
  if padding > stages:
    raise ValueError(f'{num_layers} layers on {stages} stages x {repeats} repeats would need more '
                     'than one padding slot per stage')
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
  return StagePlan(num_layers, stages, repeats, chunk, slot_layer)


def plan_for(cfg: Config) -> StagePlan:
  return make_plan(cfg.model.num_layers, cfg.mesh.pipeline, cfg.pipeline.repeats)


# ----------------------------------------------------------------------------- layout conversion


def is_layer_leaf(path) -> bool:
  return any(getattr(k, 'key', None) == 'layers' for k in path)


def map_layer_leaves(fn, tree):
  """Applies fn to every array under a `layers` key (params and the Adam moments alike)."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: fn(x) if is_layer_leaf(path) and getattr(x, 'ndim', 0) else x, tree)


def to_storage(plan: StagePlan, tree):
  """Canonical [L, ...] layer stacks -> stage-major storage [P * R * chunk, ...] (zero padding)."""
  if plan.is_identity:
    return tree
  slots = jnp.asarray(np.maximum(plan.storage_slots, 0))
  real = jnp.asarray(plan.storage_slots >= 0)

  def convert(x):
    taken = jnp.take(x, slots, axis=0)
    return jnp.where(real.reshape((-1,) + (1,) * (x.ndim - 1)), taken, jnp.zeros_like(taken))

  return map_layer_leaves(convert, tree)


def to_canonical(plan: StagePlan, tree):
  """Storage [P * R * chunk, ...] -> canonical [L, ...] layer order."""
  if plan.is_identity:
    return tree
  position = jnp.asarray(plan.storage_position)
  return map_layer_leaves(lambda x: jnp.take(x, position, axis=0), tree)


def storage_shape(plan: StagePlan, path, shape: tuple[int, ...]) -> tuple[int, ...]:
  if is_layer_leaf(path) and len(shape) and not plan.is_identity:
    return (plan.num_slots,) + tuple(shape[1:])
  return tuple(shape)


# ----------------------------------------------------------------------------------- schedule


def _never_save_weights(policy):
  """`policy` (None: save everything), except the per-layer compute-dtype weights."""
  exclude = jax.checkpoint_policies.save_anything_except_these_names('stage_weights')
  if policy is None:
    return exclude
  return lambda prim, *args, **params: (exclude(prim, *args, **params) and
                                        policy(prim, *args, **params))


def _recompute_in_backward(fn, dtype):
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
      return [jax.lax.bitcast_convert_type(leaf, jnp.uint16) if bits else leaf
              for leaf, bits in zip(jax.tree.leaves(args), as_bits)]

    def restore(kept):
      return treedef.unflatten([jax.lax.bitcast_convert_type(leaf, dtype) if bits else leaf
                                for leaf, bits in zip(kept, as_bits)])

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


def _dropout(x, rate: float, rng):
  if rate <= 0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def pipeline_loss(params, batch, rng, cfg: Config, plan: StagePlan, ctx: model_lib.Context,
                  deterministic: bool = True):
  """Mean next-token loss of batch [M, rows, S + 1] through the pipelined model: the mean of the
  micro-batches' means over their targets that are not padding (`losses.PAD_ID`), over the
  micro-batches that hold any.

  `params` hold fp32 values in storage layout; each use casts to the compute dtype, so gradients
  accumulate over micro-batches (through the scan's transpose) in fp32.
  """
  P, R, chunk = plan.stages, plan.repeats, plan.chunk
  M, rows, seq = batch.shape[0], batch.shape[1], batch.shape[2] - 1
  hidden = cfg.model.hidden_size
  dtype = ctx.dtype
  cast = lambda tree: jax.tree.map(lambda w: w.astype(dtype), tree)
  layers = jax.tree.map(lambda w: w.reshape((P, R, chunk) + w.shape[1:]), params['layers'])
  slot_is_real = jnp.asarray(plan.slot_layer >= 0)
  slot_layer = jnp.asarray(plan.slot_layer)
  full = cfg.model.remat_policy == 'full'
  # Under 'full' the whole tick is recomputed in the backward pass (below); inside that recompute
  # each layer still keeps only its matmul outputs for its own backward, not the attention
  # probabilities and dropout bits of all `chunk` layers at once.
  policy = model_lib.remat_policy('save_dots' if full else cfg.model.remat_policy)
  hidden_dropout = 0.0 if deterministic else cfg.model.hidden_dropout
  keyed = lambda rng, *ids: None if deterministic else jax.random.fold_in(
      jax.random.fold_in(rng, ids[0]), ids[1])

  def run_stage(stage_layers, x, repeat, injection, stage_real, stage_ids, rng):
    real = jax.lax.dynamic_index_in_dim(stage_real, repeat, 0, False)
    ids = jax.lax.dynamic_index_in_dim(stage_ids, repeat, 0, False)

    def one_layer(x, i):
      weights = jax.tree.map(lambda a: a[repeat, i], stage_layers)
      # Named so that no remat policy saves it: a per-tick copy of the weights would make the
      # scan keep T copies of the stage for the backward pass.
      weights = checkpoint_name(cast(weights), 'stage_weights')
      y = model_lib.apply_block(weights, x, ctx, deterministic, keyed(rng, injection, ids[i]))
      return jnp.where(real[i], y, x), None

    if cfg.model.remat_policy != 'none':
      one_layer = jax.checkpoint(one_layer, policy=_never_save_weights(policy), prevent_cse=False)
    x, _ = jax.lax.scan(one_layer, x, jnp.arange(chunk), unroll=cfg.model.scan_unroll)
    return x

  stages = jax.vmap(run_stage, in_axes=(0, 0, 0, 0, 0, 0, None), spmd_axis_name='pipeline')
  buffer_names = ('stages',) + ctx.residual_names  # split along seq under sequence_parallel

  # Computed at every tick (a lookup and a LayerNorm, cheap next to a stage) and recomputed in
  # the backward pass: only the token ids are kept per tick, and the table, a loop invariant of
  # the scan, is never copied. (Under a cond the table would be saved once per tick.)
  @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable,
                     prevent_cse=False)
  def embed(m):
    inputs, _, _ = losses.split_tokens(jax.lax.dynamic_index_in_dim(batch, m, 0, False))
    x = model_lib.embed_tokens(params, inputs, cfg.model, ctx)
    return _dropout(x, hidden_dropout, keyed(rng, m, _EMBED_DROPOUT_ID))

  def head_loss(head_params, x, tokens):
    _, labels, weights = losses.split_tokens(tokens)
    if cfg.model.cross_entropy_impl == 'chunked':
      hidden = model_lib.final_norm(head_params, x, cfg.model, ctx)
      embedding = head_params['word_embeddings'].astype(hidden.dtype)
      token_losses = losses.chunked_token_losses(hidden, embedding, labels, cfg.model, ctx.mesh)
    else:
      logits = model_lib.output_logits(head_params, x, cfg.model, ctx)
      token_losses = model_lib.cross_entropy(logits, labels)
    return losses.weighted_mean(token_losses, weights)

  if not full:
    # Keep only the head's input per tick and recompute [rows, S, V] logits in backward.
    head_loss = jax.checkpoint(head_loss, policy=jax.checkpoint_policies.nothing_saveable,
                               prevent_cse=False)

  def stage_tick(layers, head_params, inputs, repeat, injection, t, batch, rng, slot_is_real,
                 slot_layer):
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
      return outputs, jax.lax.cond(m_out >= 0, head_loss, lambda *_: jnp.float32(0.0),
                                   head_params, outputs[P - 1], leaving)
    loss = head_loss(head_params, outputs[P - 1], leaving)
    return outputs, jnp.where(m_out >= 0, loss, 0.0)

  if full:
    # Megatron's full recomputation: keep only each stage's input per tick and recompute the
    # stage's forward (and the head's) once in the backward pass.
    stage_tick = _recompute_in_backward(stage_tick, dtype)
  head_params = {k: params[k] for k in ('word_embeddings', 'final_ln')}

  def tick(carry, t):
    buffer, waiting = carry
    injection = t - jnp.arange(P)
    repeat = jnp.clip(injection // M, 0, R - 1)
    m_in = t % M
    zeros = jnp.zeros((rows, seq, hidden), dtype)
    later = jax.lax.dynamic_index_in_dim(waiting, m_in, 0, False) if R > 1 else zeros
    entering = jnp.where(t < M, embed(m_in), later)
    inputs = ctx.constrain(buffer.at[0].set(entering), buffer_names)
    outputs, loss = stage_tick(layers, head_params, inputs, repeat, injection, t, batch, rng,
                               slot_is_real, slot_layer)
    if R > 1:
      last, done = outputs[P - 1], t - (P - 1)
      m_out = jnp.mod(done, M)
      waiting = jax.lax.dynamic_update_index_in_dim(
          waiting, jnp.where(done >= 0, last, waiting[m_out]), m_out, 0)
    return (jnp.roll(outputs, 1, axis=0), waiting), loss

  buffer = ctx.constrain(jnp.zeros((P, rows, seq, hidden), dtype), buffer_names)
  waiting = jnp.zeros((M if R > 1 else 1, rows, seq, hidden), dtype)
  waiting = ctx.constrain(waiting, (None,) + ctx.residual_names)  # sequence_parallel: split too
  _, tick_losses = jax.lax.scan(tick, (buffer, waiting), jnp.arange(M * R + P - 1),
                                unroll=cfg.model.scan_unroll)
  if cfg.train.rampup_microbatch_multiple:
    # The ramp-up's rounded-up micro-batch counts: the micro-batches after the real ones are
    # padding only; they add a loss of 0 and no gradient, and the mean is over the real ones.
    # The stages compute them like any other. (Not skipped: within a tick the stages run under
    # vmap, where a cond becomes a select. A cond that skipped the ticks after the last real
    # micro-batch had left worked, but its per-tick weight-gradient output cost BLOOM-176B
    # 16.7 GiB more per device, docs/benchmarks.md.)
    return tick_losses.sum() / losses.real_microbatches(batch).sum()
  return tick_losses.sum() / M
