"""8-bit Adam (`optimizer.name='adamw_8bit'`) beside bitsandbytes' algorithm and fp32 AdamW, on
the same gradients of a real model (default: the tiny config).

    python benchmarks/adam8bit_vs_bnb.py [--config configs/tiny.py] [--steps 200]
        [--teacher adamw|ours|bnb|bnb_stable] [--agree_every 10] [--ours_8bit_embedding]
        [--json OUT] [--config.KEY=VALUE ...]

One process, one device (mesh 1x1x1), the config's model, data (the first samples of its
training stream, in order), learning-rate schedule, clipping and weight decay. Each step computes
the gradient of the loss at the teacher's params (the teacher is one of the optimizers below: the
others never touch the params, so the loss column is the teacher's training run) and gives the
same clipped gradient to four optimizers, each with its own state:

* adamw: optax's AdamW (optim.make_optimizer with name 'adamw');
* ours: optim.make_optimizer with name 'adamw_8bit' (t5x_like/optim/quantized_adam.py; with
  --ours_8bit_embedding as it was before its embedding's moments were fp32);
* bnb: `BnbAdam8bit` below, a plain-numpy transcription of bitsandbytes' Adam8bit (its
  create_dynamic_map, its kernel kOptimizerStatic8bit2StateBlockwise, min_8bit_size 4096) on
  blocks of 256 along the block axis that ours uses (the embedding's: its rows), with every
  tensor of 4096 values or more in 8 bits, the embedding included: what Adam8bit does to a plain
  nn.Embedding;
* bnb_stable: the same with the embedding's state in 32 bits, as bitsandbytes' StableEmbedding
  (GlobalOptimManager's override 'optim_bits': 32) and Megatron-DeepSpeed's --use-bnb-optimizer
  have it.

Printed every step, per optimizer: the update's distance to AdamW's (|u - u_adamw| / |u_adamw|,
weight decay left out, over the embedding: d_emb, and over the other params that bitsandbytes
quantises: d_oth), and the largest update element there (max_emb, max_oth) in units of the
largest that exact Adam can make at that step (`adam_update_bound`): above 1 is quantisation
error alone. Every `--agree_every` steps bitsandbytes' kernel also steps from ours' state (its
codes and scales, the same 8-bit tensors) with the same gradient: the fraction of codes that
differ from the ones ours stores and the largest update difference (~0 if ours is bitsandbytes'
algorithm). bitsandbytes multiplies the params by 1 - lr * weight_decay after its step where
optax adds weight_decay * p to the update: a difference of lr^2 * weight_decay * u, left out here
(every optimizer gets optax's decoupled decay).

Measured on the tiny config (docs/model.md, 8-bit Adam): ours and bitsandbytes' kernel store the
same codes but for a few in a million and make updates within 5e-7; with the embedding 8-bit both
drift from AdamW's update there (9% at iteration 100, up to 14% after; the other matrices 3%).
Teacher bnb (bitsandbytes' algorithm training the model) spiked to a loss of 8.0 at the peak
learning rate and ended 200 iterations at 6.236, 4.7% above teacher adamw's 5.956; teacher
bnb_stable at 5.892.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# ------------------------------------------------------------------- bitsandbytes, in numpy


def bnb_dynamic_map(signed: bool) -> np.ndarray:
  """bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for exponents
  1e-6 .. 1 the midpoints of an even split of [0.1, 1] (2^i pieces signed, 2^(i+1) unsigned, the
  split computed in float32 as torch.linspace does), both signs when signed; then 0 and 1;
  sorted. 256 float32 values: the signed map has +1 but not -1."""
  data = []
  for i in range(7):
    pieces = 2**i if signed else 2 ** (i + 1)
    bounds = np.linspace(0.1, 1, pieces + 1, dtype=np.float32)
    means = (bounds[:-1] + bounds[1:]) / np.float32(2)
    data += [float(10.0 ** (i - 6) * float(x)) for x in means]
    if signed:
      data += [-float(10.0 ** (i - 6) * float(x)) for x in means]
  data += [0.0, 1.0]
  assert len(data) == 256
  return np.sort(np.asarray(data, np.float32))


def bnb_quantize(x: np.ndarray, code: np.ndarray) -> np.ndarray:
  """The index (uint8) of the code value nearest to each x in [-1, 1] (bitsandbytes'
  quantize_2D: a binary search, then the nearer of the two neighbours by their midpoint)."""
  upper = np.clip(np.searchsorted(code, x), 1, 255)
  lower = upper - 1
  midpoint = (code[lower] + code[upper]) * np.float32(0.5)
  return np.where(x > midpoint, upper, lower).astype(np.uint8)


class BnbAdam8bit:
  """bitsandbytes' Adam8bit (Optimizer2State with block-wise 8-bit states) for a dict of numpy
  params. `axes` maps each param to the axis its blocks run along (bitsandbytes' contiguous
  blocks of a tensor laid out with that axis last; the stacked `layers` axis is never one), or
  None for a 32-bit state. `update(grads, count)` returns Adam's update direction, m_hat /
  (sqrt(v_hat) + eps), per param as kOptimizerStatic8bit2StateBlockwise computes it (weight
  decay left to the caller)."""

  def __init__(
    self,
    shapes: dict[str, tuple[int, ...]],
    axes: dict[str, int | None],
    b1: float,
    b2: float,
    eps: float,
    block_size: int = 256,
  ):
    self.b1, self.b2, self.eps, self.block, self.axes = b1, b2, eps, block_size, axes
    self.code1, self.code2 = bnb_dynamic_map(True), bnb_dynamic_map(False)
    self.state = {}
    for name, shape in shapes.items():
      if axes[name] is None:
        self.state[name] = dict(s1=np.zeros(shape, np.float32), s2=np.zeros(shape, np.float32))
      else:
        blocked = self.to_blocks(name, np.zeros(shape, np.float32)).shape
        # The first state starts at the signed code's 0 (bitsandbytes' buffers are zeros of
        # the unsigned code, its index 0; the signed code's 0 is index 127).
        self.state[name] = dict(
          c1=np.full(blocked, self.zero1, np.uint8),
          c2=np.zeros(blocked, np.uint8),
          a1=np.zeros(blocked[:-1], np.float32),
          a2=np.zeros(blocked[:-1], np.float32),
        )

  @property
  def zero1(self) -> int:
    return int(np.flatnonzero(self.code1 == 0)[0])

  def to_blocks(self, name, x):
    """x in the param's layout -> [..., blocks, block_size], the block axis last."""
    x = np.moveaxis(x, self.axes[name], -1)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // self.block, self.block))

  def from_blocks(self, name, x):
    x = x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))
    return np.moveaxis(x, -1, self.axes[name])

  def moments(self, name):
    """The stored (dequantised) first and second moments of one param, in its layout."""
    s = self.state[name]
    if 's1' in s:
      return s['s1'], s['s2']
    m = self.code1[s['c1']] * s['a1'][..., None]
    v = self.code2[s['c2']] * s['a2'][..., None]
    return self.from_blocks(name, m), self.from_blocks(name, v)

  def update(self, grads: dict[str, np.ndarray], count: int) -> dict[str, np.ndarray]:
    b1, b2 = np.float32(self.b1), np.float32(self.b2)
    correction1 = np.float32(1 - self.b1**count)
    correction2 = np.float32(math.sqrt(1 - self.b2**count))
    out = {}
    for name, g in grads.items():
      g = np.asarray(g, np.float32)
      m, v = self.moments(name)
      # The kernel's order: the new fp32 moments from the stored ones and the gradient; the
      # update from them; then the requantisation (absmax of the new moments per block).
      v = v * b2 + (np.float32(1) - b2) * g * g
      m = m * b1 + (np.float32(1) - b1) * g
      out[name] = (m / (np.sqrt(v) + correction2 * np.float32(self.eps))) * (
        correction2 / correction1
      )
      s = self.state[name]
      if 's1' in s:
        s['s1'], s['s2'] = m, v
        continue
      m, v = self.to_blocks(name, m), self.to_blocks(name, v)
      a1, a2 = np.abs(m).max(-1), v.max(-1)
      n1 = m / np.where(a1 > 0, a1, 1)[..., None]
      n2 = v / np.where(a2 > 0, a2, 1)[..., None]
      c1 = bnb_quantize(n1, self.code1).astype(np.int32)
      # The kernel keeps the first moment's sign: a value whose nearest code has the other
      # sign (+0 for a negative value) moves one code towards its own sign.
      flipped = np.signbit(self.code1[c1]) != np.signbit(n1)
      c1 = np.where(flipped, c1 + np.where(n1 > 0, 1, -1), c1)
      s.update(c1=c1.astype(np.uint8), c2=bnb_quantize(n2, self.code2), a1=a1, a2=a2)
    return out

  def load(self, name: str, mu, nu, zero_index: tuple[int, int]):
    """Sets one param's state from t5x_like's: fp32 moments, or QuantizedMoments (codes offset
    so that byte 0 is the value 0, by `zero_index` of the signed and unsigned code)."""
    s = self.state[name]
    if 's1' in s:
      s['s1'], s['s2'] = np.asarray(mu, np.float32), np.asarray(nu, np.float32)
      return
    axis = self.axes[name]
    for moment, (c, a), zero in (
      (mu, ('c1', 'a1'), zero_index[0]),
      (nu, ('c2', 'a2'), zero_index[1]),
    ):
      codes = np.moveaxis(np.asarray(moment.codes), axis, -2).astype(np.int32)  # [.., n/B, B]
      s[c] = ((codes + zero) % 256).astype(np.uint8)
      s[a] = np.moveaxis(np.asarray(moment.scales, np.float32), axis, -1)

  def codes(self, name) -> tuple[np.ndarray, np.ndarray]:
    """(first, second) moment's codes as indices into the sorted maps, [..., blocks, B]."""
    return self.state[name]['c1'], self.state[name]['c2']


def adam_update_bound(b1: float, b2: float, count: int) -> float:
  """The largest |m_hat| / sqrt(v_hat) that exact Adam can reach at step `count` (b1^2 < b2):
  m_t^2 <= K_t v_t by Cauchy-Schwarz on the two moving averages, K_t = (1 - b1)^2 / (1 - b2) *
  (1 - (b1^2 / b2)^t) / (1 - b1^2 / b2); then the bias corrections. 1 at the first step."""
  r = b1 * b1 / b2
  k = (1 - b1) ** 2 / (1 - b2) * (1 - r**count) / (1 - r)
  return math.sqrt(k) * math.sqrt(1 - b2**count) / (1 - b1**count)


# ------------------------------------------------------------------------------ the run


def param_names(tree) -> dict[str, object]:
  """{'layers/mlp/wi_kernel': leaf, ...} in the tree's leaf order."""
  import jax

  return {
    '/'.join(str(getattr(k, 'key', k)) for k in path): leaf
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def bnb_axes(params, block_size: int, stable_embedding: bool) -> dict[str, int | None]:
  """Per param name, the axis of bitsandbytes' 8-bit blocks, or None for a 32-bit state: 32 bits
  below min_8bit_size (4096 values; per layer, bitsandbytes seeing each layer's own tensor) and
  for the embedding under StableEmbedding; the embedding's blocks are its rows (the contiguous
  blocks of a [V, h] table); any other param's those of quantized_adam.block_axes (the same
  blocks ours has)."""
  import jax

  from t5x_like.optim import quantized_adam

  is_axis = lambda x: x is None or isinstance(x, quantized_adam.BlockAxis)
  leaves = param_names(params)
  ours = jax.tree.leaves(
    quantized_adam.block_axes(params, block_size, 4096, fp32_state=()), is_leaf=is_axis
  )
  axes = {}
  for (name, leaf), where in zip(leaves.items(), ours):
    if 'word_embeddings' in name:
      axes[name] = None if stable_embedding else leaf.ndim - 1
    else:
      axes[name] = None if where is None else where.axis
  return axes


def load_ours(bnb: BnbAdam8bit, adam_state) -> None:
  """Sets `bnb`'s state to ours' (a quantized_adam.ScaleByAdam8bitState): the same moments, as
  its codes and scales."""
  import jax

  from t5x_like.optim import quantized_adam as qa

  zero = (
    int(np.flatnonzero(qa.SIGNED_CODE == 0)[0]),
    int(np.flatnonzero(qa.UNSIGNED_CODE == 0)[0]),
  )
  mu = jax.tree.leaves(adam_state.mu, is_leaf=qa.is_quantized)
  nu = jax.tree.leaves(adam_state.nu, is_leaf=qa.is_quantized)
  for name, m, v in zip(bnb.state, mu, nu):
    if qa.is_quantized(m) != ('c1' in bnb.state[name]):
      raise ValueError(
        f'{name}: ours keeps {"8-bit" if qa.is_quantized(m) else "fp32"} '
        'moments, this bitsandbytes the other'
      )
    bnb.load(name, m, v, zero)


class TinyRun:
  """A config's model on one device (mesh 1x1x1), its training data in order, and the gradient
  (clipped as the train step clips it) at any params: what the optimizers here are fed."""

  def __init__(self, config_path: str, overrides: list[str] | None = None):
    import jax

    from t5x_like.config import load_config_file, parse_overrides
    from t5x_like.mesh import partitioning
    from t5x_like.model import losses
    from t5x_like.optim import adamw as optim
    from t5x_like.parallel.train_state import make_layout
    from t5x_like.training.startup import open_data
    from t5x_like.training.step import batch_sharding

    cfg = (
      load_config_file(config_path, parse_overrides(overrides or []))
      .replace(mesh={'data': 1, 'pipeline': 1, 'tensor': 1})
      .validate()
    )
    self.cfg = cfg
    self.layout = make_layout(
      cfg.replace(optimizer={'name': 'adamw'}).validate(), partitioning.make_mesh(1, 1, 1)
    )
    self.source = open_data(cfg, cfg.train.seed).train
    self.sharding = batch_sharding(self.layout)
    model, clip = self.layout.model, cfg.optimizer.clip_grad

    def loss_and_grads(params, batch):
      def loss_fn(params):
        return jax.vmap(lambda tokens: losses.mean_loss(model, params, tokens))(batch).mean()

      loss, grads = jax.value_and_grad(loss_fn)(params)
      grads, norm = optim.clip_by_global_norm(grads, clip)
      return loss, grads, norm

    self._grads = jax.jit(loss_and_grads)

  def init_params(self):
    return self.layout.init(self.cfg.train.seed).params

  def gradients(self, params, iteration: int):
    """(loss, clipped gradients, pre-clip norm) at `params` on the batch of `iteration` (0-based),
    and that iteration's learning rate."""
    from t5x_like.training import batches, schedule

    gbs = self.cfg.train.global_batch_size
    batch = batches.global_batch(self.cfg, self.sharding, self.source, iteration * gbs, gbs)
    loss, grads, norm = self._grads(params, batch)
    return loss, grads, norm, schedule.learning_rate(self.cfg.optimizer, iteration * gbs)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--config', default=os.path.join(REPO, 'configs', 'tiny.py'))
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--teacher', default='adamw', choices=['adamw', 'ours', 'bnb', 'bnb_stable'])
  parser.add_argument('--agree_every', type=int, default=10)
  parser.add_argument(
    '--ours_8bit_embedding',
    action='store_true',
    help="ours as it was before its embedding's moments were fp32 (8-bit)",
  )
  parser.add_argument('--json', default='')
  args, rest = parser.parse_known_args(argv)

  import jax
  import jax.numpy as jnp

  from t5x_like.optim import adamw as optim
  from t5x_like.optim import quantized_adam

  if args.ours_8bit_embedding:
    quantized_adam.FP32_STATE = ()

  run = TinyRun(args.config, rest)
  cfg, o = run.cfg, run.cfg.optimizer
  params = run.init_params()
  opt8 = cfg.replace(optimizer={'name': 'adamw_8bit'}).validate().optimizer
  tx32 = optim.make_optimizer(cfg.replace(optimizer={'name': 'adamw'}).validate().optimizer, params)
  tx8 = optim.make_optimizer(opt8, params, optim.fp32_state_params(cfg.model))
  s32, s8 = tx32.init(params), tx8.init(params)
  update32, update8 = jax.jit(tx32.update), jax.jit(tx8.update)
  mask = param_names(optim.decay_mask(params))
  leaves = param_names(params)
  names = list(leaves)
  shapes = {n: x.shape for n, x in leaves.items()}
  is_embedding = {n: 'word_embeddings' in n for n in names}
  axes = {stable: bnb_axes(params, o.quant_block_size, stable) for stable in (False, True)}
  eight = {n: axes[False][n] is not None for n in names}  # 8-bit in bitsandbytes' default
  bnb = BnbAdam8bit(shapes, axes[False], o.beta1, o.beta2, o.eps, o.quant_block_size)
  bnb_stable = BnbAdam8bit(shapes, axes[True], o.beta1, o.beta2, o.eps, o.quant_block_size)
  ours_axes = dict(
    zip(
      names,
      jax.tree.leaves(
        optim.block_axes(opt8, params, optim.fp32_state_params(cfg.model)),
        is_leaf=lambda x: x is None or isinstance(x, quantized_adam.BlockAxis),
      ),
    )
  )
  print(
    f'> {args.config}: {sum(x.size for x in leaves.values()) / 1e6:.2f}M params; 8-bit in '
    f'bitsandbytes: {", ".join(n for n in names if eight[n])}; in ours: '
    f'{", ".join(n for n in names if ours_axes[n] is not None)}',
    flush=True,
  )

  def summary(updates: dict[str, np.ndarray], reference: dict[str, np.ndarray], count: int):
    """(distance to AdamW's update over the embedding, over the other 8-bit params; the largest
    update in the embedding and in the others, in units of the largest that exact Adam can
    make at this step). Updates without weight decay."""
    row = []
    for group in (True, False):
      chosen = [n for n in names if eight[n] and is_embedding[n] == group]
      diff = math.sqrt(sum(float(np.sum((updates[n] - reference[n]) ** 2)) for n in chosen))
      ref = math.sqrt(sum(float(np.sum(reference[n] ** 2)) for n in chosen))
      row.append(diff / max(ref, 1e-30))
    for group in (True, False):
      chosen = [n for n in names if eight[n] and is_embedding[n] == group]
      row.append(
        max(float(np.abs(updates[n]).max()) for n in chosen)
        / adam_update_bound(o.beta1, o.beta2, count)
      )
    return row

  rows = []
  teacher_params = params
  start = time.perf_counter()
  for i in range(args.steps):
    loss, grads, norm, lr = run.gradients(teacher_params, i)
    count = i + 1
    u32, s32 = update32(grads, s32, teacher_params)
    s8_before = s8
    u8, s8 = update8(grads, s8, teacher_params)
    g = {n: np.asarray(x) for n, x in param_names(jax.device_get(grads)).items()}
    p = {n: np.asarray(x) for n, x in param_names(jax.device_get(teacher_params)).items()}
    # Decoupled weight decay as optax adds it (the step multiplies the update by -lr).
    decay = lambda n: o.weight_decay * p[n] if mask[n] else 0.0
    without_decay = lambda u: {
      n: np.asarray(x) - decay(n) for n, x in param_names(jax.device_get(u)).items()
    }
    adam = {
      'adamw': without_decay(u32),
      'ours': without_decay(u8),
      'bnb': bnb.update(g, count),
      'bnb_stable': bnb_stable.update(g, count),
    }
    record = dict(iteration=count, lm_loss=float(loss), grad_norm=float(norm), lr=lr)
    for label in ('ours', 'bnb', 'bnb_stable'):
      d_emb, d_rest, r_emb, r_rest = summary(adam[label], adam['adamw'], count)
      record[label] = dict(
        update_distance_embedding=d_emb,
        update_distance_other=d_rest,
        largest_update_embedding=r_emb,
        largest_update_other=r_rest,
      )
    if args.agree_every and count % args.agree_every == 0:
      # bitsandbytes' kernel from ours' state before this step (the same codes and scales, the
      # same 8-bit tensors), with this step's gradient, against ours' step.
      probe = BnbAdam8bit(
        shapes,
        {n: None if ours_axes[n] is None else ours_axes[n].axis for n in names},
        o.beta1,
        o.beta2,
        o.eps,
        o.quant_block_size,
      )
      load_ours(probe, s8_before[0])
      after = BnbAdam8bit(shapes, probe.axes, o.beta1, o.beta2, o.eps, o.quant_block_size)
      load_ours(after, s8[0])
      update = probe.update(g, count)
      differing = total = 0
      for n in names:
        if ours_axes[n] is not None:
          for mine, theirs in zip(after.codes(n), probe.codes(n)):
            differing += int(np.sum(mine != theirs))
            total += mine.size
      record['agreement'] = dict(
        codes_differing=differing / max(total, 1),
        largest_update_difference=max(
          float(np.abs(update[n] - adam['ours'][n]).max()) for n in names
        ),
      )
    rows.append(record)
    line = f'{count:4d} loss {record["lm_loss"]:.4f} gn {record["grad_norm"]:5.2f} | ' + ' | '.join(
      f'{k} d_emb {record[k]["update_distance_embedding"]:.3f} d_oth '
      f'{record[k]["update_distance_other"]:.3f} max_emb '
      f'{record[k]["largest_update_embedding"]:.2f} max_oth '
      f'{record[k]["largest_update_other"]:.2f}'
      for k in ('ours', 'bnb', 'bnb_stable')
    )
    if 'agreement' in record:
      line += (
        f" | bnb from ours' state: codes differing "
        f'{record["agreement"]["codes_differing"]:.1e}, largest update difference '
        f'{record["agreement"]["largest_update_difference"]:.1e}'
      )
    print(line, flush=True)
    teacher_params = jax.tree.map(
      lambda x, n: x - lr * jnp.asarray(adam[args.teacher][n] + decay(n), x.dtype),
      teacher_params,
      jax.tree_util.tree_unflatten(jax.tree.structure(teacher_params), names),
    )
  losses = [r['lm_loss'] for r in rows]
  last5 = float(np.mean(losses[-5:]))
  print(
    f'> teacher {args.teacher}: mean lm loss of the last 5 iterations {last5:.4f} '
    f'({time.perf_counter() - start:.0f} s)'
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(dict(config=args.config, teacher=args.teacher, rows=rows, last5=last5), f)
  return 0


if __name__ == '__main__':
  sys.exit(main())
