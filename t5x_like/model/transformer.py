"""Decoder-only transformer (BLOOM and GPT-2/Megatron) in Flax.

BLOOM: ALiBi, LayerNorm right after the token lookup, pre-LN blocks, final LN, tanh-GeLU, biases on
every linear, logits from the tied word embeddings. GPT-2: learned absolute positions instead of
ALiBi and no embedding LayerNorm, unless model.stable_embedding (bitsandbytes' StableEmbedding
normalises the token lookup, before the positions are added).

Layout (independent of the mesh, so any checkpoint restores onto any mesh):
  word_embeddings                  [V_pad, h]          (vocab, embed)
  position_embeddings              [max_pos, h]        (positions, embed)     gpt2 only
  embed_ln/{scale,bias}            [h]                          bloom, or gpt2 + stable_embedding
  layers/ln1/{scale,bias}          [L, h]
  layers/attn/qkv_kernel           [L, h, heads, 3, d] (layers, embed, heads, qkv, kv)
  layers/attn/qkv_bias             [L, heads, 3, d]
  layers/attn/out_kernel           [L, heads, d, h]    (layers, heads, kv, embed)
  layers/attn/out_bias             [L, h]
  layers/ln2/{scale,bias}          [L, h]
  layers/mlp/wi_{kernel,bias}      [L, h, ffn], [L, ffn]
  layers/mlp/wo_{kernel,bias}      [L, ffn, h], [L, h]
  final_ln/{scale,bias}            [h]
The (heads, 3, d) order of the fused QKV is HF BLOOM's head-major interleaving, so conversion is a
reshape. Layers are one scanned block: compile time does not grow with depth.

`decode` runs the same params with a KV cache, for generation (t5x_like/inference/decoding.py):
prompts through the blocks once, then one token at a time against the cached keys and values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding

from t5x_like.config import ModelConfig
from t5x_like.kernels.residuals import ATTENTION_RESIDUALS
from t5x_like.mesh import partitioning
from t5x_like.model import attention as attention_lib


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi slopes of the fairseq/BLOOM recipe, including head counts that are not powers of two."""

  def power_of_two_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

  closest = 2 ** math.floor(math.log2(num_heads))
  slopes = power_of_two_slopes(closest)
  if closest < num_heads:
    slopes += power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
  return np.asarray(slopes, dtype=np.float32)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """Megatron/BLOOM's tanh approximation, written out so it matches bit for bit in fp32."""
  return 0.5 * x * (1.0 + jnp.tanh(0.79788456 * x * (1.0 + 0.044715 * x * x)))


class Context:
  """What every module needs besides the config: compute dtype, an activation constraint, and
  under ZeRO-3 (`gathers`: partitioning.WeightGathers) the gathers of the weights it uses."""

  def __init__(
    self, cfg: ModelConfig, mesh: Mesh | None, gathers: partitioning.WeightGathers | None = None
  ):
    self.cfg = cfg
    self.dtype = jnp.dtype(cfg.dtype)
    self.mesh = mesh
    self.gathers = gathers if mesh is not None else None
    # The residual stream [batch, length, embed] between the tensor-parallel matmuls (and the
    # LayerNorms and dropout on it): split along the sequence under model.sequence_parallel.
    self.residual_names = ('batch', 'length_sp' if cfg.sequence_parallel else 'length', 'act_embed')
    # Inside a shard_map (manual axes) the constraints name the abstract mesh: vmap's
    # spmd_axis_name (the pipeline's stages) cannot batch a constraint on the concrete one there.
    self.constraint_mesh: Mesh | AbstractMesh | None = mesh
    if mesh is not None and AxisType.Manual in mesh.axis_types:
      self.constraint_mesh = mesh.abstract_mesh

  def constrain(self, x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    if self.mesh is None:
      return x
    spec = partitioning.spec_for(names, x.shape, self.mesh)
    assert self.constraint_mesh is not None
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.constraint_mesh, spec))

  def gather_top(self, params: dict) -> dict:
    """Top-level params (embedding, norms) about to be used: gathered under ZeRO-3."""
    return params if self.gathers is None else self.gathers.top(params)

  def gather_layer(self, variables: dict) -> dict:
    """One layer's {'params': ...} about to be used: gathered under ZeRO-3."""
    if self.gathers is None:
      return variables
    return dict(variables, params=self.gathers.layer(variables['params']))


def _param(module: nn.Module, name: str, init: Callable, shape, names):
  return module.param(name, nn.with_logical_partitioning(init, names), shape, jnp.float32)


def _norm_params(module: nn.Module, h: int) -> dict:
  """A LayerNorm's {scale, bias} [h], declared on `module`."""
  return {
    'scale': _param(module, 'scale', nn.initializers.ones, (h,), ('embed',)),
    'bias': _param(module, 'bias', nn.initializers.zeros, (h,), ('embed',)),
  }


class LayerNorm(nn.Module):
  """LayerNorm with fp32 statistics whatever the compute dtype."""

  eps: float
  dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    params = _norm_params(self, x.shape[-1])
    return layer_norm(x, params['scale'], params['bias'], self.eps).astype(self.dtype)


class NormParams(nn.Module):
  """A LayerNorm's params alone ({scale, bias}, the layout of `LayerNorm`'s), for the model's
  embedding and final norms, which `embed_tokens` and `final_norm` apply to a param tree."""

  hidden_size: int

  @nn.compact
  def __call__(self) -> dict:
    return _norm_params(self, self.hidden_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def layer_norm(x, scale, bias, eps: float):
  """(x - mean) / std * scale + bias over the last dim, statistics in fp32, in x's dtype.

  The backward is written out (two row reductions, one elementwise pass) and keeps only x and the
  fp32 row statistics; autodiff of the forward keeps fp32 intermediates and makes more passes.
  """
  return _layer_norm_fwd(x, scale, bias, eps)[0]


def _layer_norm_fwd(x, scale, bias, eps):
  x32 = x.astype(jnp.float32)
  mean = x32.mean(-1, keepdims=True)
  rstd = jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + eps)
  y = ((x32 - mean) * rstd * scale + bias).astype(x.dtype)
  return y, (x, mean, rstd, scale)


def _layer_norm_bwd(eps, residuals, dy):
  del eps
  x, mean, rstd, scale = residuals
  x_hat = (x.astype(jnp.float32) - mean) * rstd
  dy = dy.astype(jnp.float32)
  g = dy * scale  # the gradient with respect to x_hat
  dx = rstd * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
  rows = tuple(range(dy.ndim - 1))
  return dx.astype(x.dtype), (dy * x_hat).sum(rows), dy.sum(rows)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


class Attention(nn.Module):
  ctx: Context

  @nn.compact
  def __call__(self, x, deterministic: bool):
    cfg = self.ctx.cfg
    h, n, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    std = cfg.weight_init_std
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    zeros = nn.initializers.zeros
    wqkv = _param(
      self, 'qkv_kernel', nn.initializers.normal(std), (h, n, 3, d), ('embed', 'heads', 'qkv', 'kv')
    )
    bqkv = _param(self, 'qkv_bias', zeros, (n, 3, d), ('heads', 'qkv', 'kv'))
    wout = _param(
      self, 'out_kernel', nn.initializers.normal(out_std), (n, d, h), ('heads', 'kv', 'embed')
    )
    bout = _param(self, 'out_bias', zeros, (h,), ('embed',))

    q, k, v = attention_qkv({'qkv_kernel': wqkv, 'qkv_bias': bqkv}, x, self.ctx)
    dropout_rng = None
    if not deterministic and cfg.attention_dropout > 0:
      dropout_rng = self.make_rng('dropout')
    slopes = alibi_slopes(n) if cfg.architecture == 'bloom' else None
    # The heads dim may be split over `tensor`; the partitioner (xla) or the per-shard kernel
    # call (pallas, cudnn) slices the slopes with it.
    ctx = attention_lib.attention(
      q, k, v, cfg=cfg, mesh=self.ctx.mesh, alibi_slopes=slopes, dropout_rng=dropout_rng
    )
    return attention_output({'out_kernel': wout, 'out_bias': bout}, ctx, self.ctx)


def attention_qkv(params, x, ctx: Context):
  """The fused QKV projection of x [B, S, h] (params: a layer's `attn`): q, k, v, each
  [B, S, heads, head_dim]."""
  dtype = ctx.dtype
  qkv = checkpoint_name(
    jnp.einsum('bse,encd->bsncd', x, params['qkv_kernel'].astype(dtype)), 'qkv_projection'
  )
  qkv = qkv + params['qkv_bias'].astype(dtype)
  qkv = ctx.constrain(qkv, ('batch', 'length', 'act_heads', None, None))
  return qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]


def attention_output(params, context, ctx: Context):
  """The attention's output projection of its context [B, S, heads, head_dim] (params: a
  layer's `attn`): [B, S, h]."""
  context = ctx.constrain(context, ('batch', 'length', 'act_heads', None))
  out = checkpoint_name(
    jnp.einsum('bsnd,nde->bse', context, params['out_kernel'].astype(ctx.dtype)),
    'attention_projection',
  )
  # Sequence parallel: the partial sums are reduce-scattered, not all-reduced; bias after.
  out = ctx.constrain(out, ctx.residual_names) + params['out_bias'].astype(ctx.dtype)
  return ctx.constrain(out, ctx.residual_names)


class Mlp(nn.Module):
  ctx: Context

  @nn.compact
  def __call__(self, x):
    cfg, dtype = self.ctx.cfg, self.ctx.dtype
    h, f = cfg.hidden_size, cfg.ffn_size
    std = cfg.weight_init_std
    out_std = std / math.sqrt(2.0 * cfg.num_layers)
    zeros = nn.initializers.zeros
    wi = _param(self, 'wi_kernel', nn.initializers.normal(std), (h, f), ('embed', 'mlp'))
    bi = _param(self, 'wi_bias', zeros, (f,), ('mlp',))
    wo = _param(self, 'wo_kernel', nn.initializers.normal(out_std), (f, h), ('mlp', 'embed'))
    bo = _param(self, 'wo_bias', zeros, (h,), ('embed',))
    y = checkpoint_name(jnp.einsum('bse,ef->bsf', x, wi.astype(dtype)), 'mlp_in') + bi.astype(dtype)
    y = self.ctx.constrain(y, ('batch', 'length', 'act_mlp'))
    y = gelu_tanh(y)
    out = checkpoint_name(jnp.einsum('bsf,fe->bse', y, wo.astype(dtype)), 'mlp_out')
    out = self.ctx.constrain(out, self.ctx.residual_names) + bo.astype(dtype)
    return self.ctx.constrain(out, self.ctx.residual_names)


class Block(nn.Module):
  """Pre-LN block: x + drop(attn(LN1(x))), then x + drop(mlp(LN2(x)))."""

  ctx: Context
  deterministic: bool

  @nn.compact
  def __call__(self, x, _):
    cfg = self.ctx.cfg
    drop = nn.Dropout(cfg.hidden_dropout, deterministic=self.deterministic)
    ln = lambda name: LayerNorm(cfg.layernorm_epsilon, self.ctx.dtype, name=name)
    residual = lambda y: self.ctx.constrain(y, self.ctx.residual_names)
    x = residual(x)
    x = x + drop(Attention(self.ctx, name='attn')(residual(ln('ln1')(x)), self.deterministic))
    x = x + drop(Mlp(self.ctx, name='mlp')(residual(ln('ln2')(x))))
    return residual(x), None


# A layer's matmul outputs without batch dimensions, by name: QKV, the attention's output
# projection, the MLP's two.
LAYER_MATMUL_OUTPUTS = ('qkv_projection', 'attention_projection', 'mlp_in', 'mlp_out')

_REMAT_POLICIES = {
  'full': jax.checkpoint_policies.nothing_saveable,
  # The matmul outputs without batch dimensions (QKV, the output projections, the MLP's), and the
  # fused attention kernels' output and log-sum-exp, without which their backward would run the
  # forward kernel again (the xla path's scores and softmax are recomputed). Named as well: under
  # the pipeline's vmap over stages every matmul has a batch dimension, and the rule alone saved
  # none, so each layer's backward ran its forward's matmuls a second time.
  'save_dots': jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(ATTENTION_RESIDUALS, *LAYER_MATMUL_OUTPUTS),
  ),
}


class Transformer(nn.Module):
  """tokens [B, S] -> fp32 logits [B, S, V_pad] (padded vocabulary entries masked out)."""

  cfg: ModelConfig
  padded_vocab: int
  mesh: Mesh | None = None
  # ZeRO-3 (mesh.zero_stage=3): the params arrive split over `data` and each is gathered where
  # it is used (train_state.make_layout sets it).
  gathers: partitioning.WeightGathers | None = None

  @nn.compact
  def __call__(
    self, tokens: jax.Array, deterministic: bool = True, return_hidden: bool = False
  ) -> jax.Array:
    """return_hidden: the final-LN hidden states [B, S, h] instead of the logits, for a loss
    that applies the tied embedding itself (the chunked cross-entropy, t5x_like/losses.py).

    embed_tokens -> the scanned blocks -> final_norm -> tied_logits: the functions the
    pipeline's stages apply to the same param tree (t5x_like/parallel/pipeline.py)."""
    cfg, ctx = self.cfg, Context(self.cfg, self.mesh, self.gathers)
    embedding = _embedding_params(self, self.padded_vocab)
    x = embed_tokens(ctx.gather_top(embedding), tokens, cfg, ctx)
    x = nn.Dropout(cfg.hidden_dropout, deterministic=deterministic)(x)

    block: type[Block] = Block
    policy = remat_policy(cfg.remat_policy)
    if ctx.gathers is not None:  # ZeRO-3: each layer's weights gathered inside the scan
      block = nn.map_variables(Block, 'params', trans_in_fn=ctx.gather_layer, mutable=False)
      # The backward pass gathers them again. Without recomputation ('none') it would keep
      # values computed from them (a reshaped kernel): the matmul outputs are kept instead
      # (save_dots) and the elementwise work recomputed.
      policy = partitioning.never_save(
        [partitioning.GATHERED_WEIGHTS], policy or remat_policy('save_dots')
      )
    if policy is not None:
      block = nn.remat(block, policy=policy, prevent_cse=False)
    layers = nn.scan(
      block,
      variable_axes={'params': 0},
      split_rngs={'params': True, 'dropout': True},
      length=cfg.num_layers,
      unroll=cfg.num_layers if cfg.scan_unroll or cfg.unroll_layers else 1,
      metadata_params={nn.PARTITION_NAME: 'layers'},
    )(ctx, deterministic, name='layers')
    x, _ = layers(x, None)
    final = ctx.gather_top({'final_ln': NormParams(cfg.hidden_size, name='final_ln')()})
    x = final_norm(final, x, cfg, ctx)
    if return_hidden:
      return x
    emb = ctx.gather_top({'word_embeddings': embedding['word_embeddings']})['word_embeddings']
    return tied_logits(x, emb, cfg.vocab_size, ctx)


def _embedding_params(module: nn.Module, padded_vocab: int) -> dict:
  """The input side's params, declared on the Transformer `module` in the order (and so with
  the init values) they always had: word_embeddings, then embed_ln and position_embeddings as
  the architecture has them."""
  cfg = module.cfg
  std = cfg.weight_init_std
  # StableEmbedding's Xavier-uniform: the init runs on the global [V_pad, h] shape (jitted
  # into its shardings), so its fan is the whole vocabulary's on every tensor/pipeline shard,
  # not a shard's (Megatron-DeepSpeed PR 182).
  emb_init = (
    nn.initializers.xavier_uniform() if cfg.stable_embedding else nn.initializers.normal(std)
  )
  params = {
    'word_embeddings': _param(
      module, 'word_embeddings', emb_init, (padded_vocab, cfg.hidden_size), ('vocab', 'embed')
    )
  }
  if has_embed_ln(cfg):
    params['embed_ln'] = NormParams(cfg.hidden_size, name='embed_ln')()
  if cfg.architecture == 'gpt2':
    params['position_embeddings'] = _param(
      module,
      'position_embeddings',
      nn.initializers.normal(std),
      (cfg.max_position_embeddings, cfg.hidden_size),
      ('positions', 'embed'),
    )
  return params


def has_embed_ln(cfg: ModelConfig) -> bool:
  """BLOOM's LayerNorm after the token lookup; GPT-2 has it under model.stable_embedding."""
  return cfg.architecture != 'gpt2' or cfg.stable_embedding


def tied_logits(x, emb, vocab_size: int, ctx: Context):
  """fp32 logits from the tied embeddings, split over the vocabulary; padded rows masked."""
  logits = jnp.einsum('bse,ve->bsv', x, emb.astype(ctx.dtype), preferred_element_type=jnp.float32)
  logits = ctx.constrain(logits, ('batch', 'length', 'act_vocab'))
  # Padded rows can never be predicted, so an imported HF model keeps its exact softmax.
  valid = jnp.arange(emb.shape[0]) < vocab_size
  return jnp.where(valid, logits, jnp.finfo(jnp.float32).min)


@jax.custom_vjp
def lookup_rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
  """`jnp.take(table, tokens, axis=0)`, whose gradient adds up a token's repeated rows in fp32
  and rounds to the table's dtype once. jnp.take's own gradient is a scatter-add in the table's
  dtype: in bf16 a frequent token's sum stops growing (4,096 cotangents of 1 to 5 sum to 2,048
  instead of 12,483), where Megatron's embedding backward accumulates in fp32."""
  return jnp.take(table, tokens, axis=0)


def _lookup_rows_forward(table, tokens):
  # A [vocab, 0] residual: the table's row count and dtype, no bytes.
  return jnp.take(table, tokens, axis=0), (tokens, jnp.zeros((table.shape[0], 0), table.dtype))


def _lookup_rows_backward(residuals, cotangent):
  tokens, like = residuals
  rows = jnp.zeros((like.shape[0],) + cotangent.shape[tokens.ndim :], jnp.float32)
  return rows.at[tokens].add(cotangent.astype(jnp.float32)).astype(like.dtype), None


lookup_rows.defvjp(_lookup_rows_forward, _lookup_rows_backward)


def embed_tokens(params, tokens, cfg: ModelConfig, ctx: Context, positions=None):
  """The Transformer's input side on a param tree: the token lookup (`lookup_tokens`), then
  `embed_rows`."""
  return embed_rows(params, lookup_tokens(params, tokens, ctx), cfg, ctx, positions)


def lookup_tokens(params, tokens, ctx: Context) -> jax.Array:
  """The rows [B, S, h] of the token table for tokens [B, S], in the compute dtype (a
  vocab-split table: masked local lookup + all-reduce)."""
  table = params['word_embeddings'].astype(ctx.dtype)
  if ctx.mesh is not None:
    table = partitioning.lookup_table(table, ctx.mesh)
  return lookup_rows(table, tokens)


def embed_rows(params, rows, cfg: ModelConfig, ctx: Context, positions=None):
  """The input side after the lookup, on the looked-up `rows` [B, S, h]: BLOOM's embedding
  LayerNorm, or GPT-2's positions (after the LayerNorm of model.stable_embedding). `positions`
  [B, S]: each token's (decoding); default 0..S-1 on every row. Reads no `word_embeddings`."""
  x = rows
  if has_embed_ln(cfg):
    x = apply_norm(cfg, ctx, params['embed_ln'], ctx.constrain(x, ctx.residual_names))
  if cfg.architecture == 'gpt2' and positions is None:
    x = x + params['position_embeddings'][: rows.shape[1]].astype(ctx.dtype)[None]
  elif cfg.architecture == 'gpt2':
    # 'clip': a decoding cache may be longer than the table; no real token sits past its end.
    table = params['position_embeddings'].astype(ctx.dtype)
    x = x + jnp.take(table, positions, axis=0, mode='clip')
  return ctx.constrain(x, ctx.residual_names)


def apply_norm(cfg: ModelConfig, ctx: Context, norm_params, x: jax.Array) -> jax.Array:
  """A LayerNorm of the model's epsilon and compute dtype, with the given params."""
  return cast(
    jax.Array, LayerNorm(cfg.layernorm_epsilon, ctx.dtype).apply({'params': norm_params}, x)
  )


def final_norm(params, x, cfg: ModelConfig, ctx: Context):
  """The final LayerNorm on a param tree."""
  x = ctx.constrain(x, ctx.residual_names)
  return ctx.constrain(
    apply_norm(cfg, ctx, params['final_ln'], x),
    ctx.residual_names,
  )


def output_logits(params, x, cfg: ModelConfig, ctx: Context):
  """The Transformer's output side on a param tree: `final_norm`, then `tied_logits`."""
  return tied_logits(
    final_norm(params, x, cfg, ctx), params['word_embeddings'], cfg.vocab_size, ctx
  )


def apply_block(layer_params, x, ctx: Context, deterministic: bool = True, dropout_rng=None):
  """One transformer block (params of a single layer, unstacked; gathered here under ZeRO-3)
  on x. Named as the Flax model's scanned blocks are: its ops' names read '.../layers/attn/...'
  in either, which the step profiles go by (benchmarks/train_throughput.py)."""
  rngs = {'dropout': dropout_rng} if dropout_rng is not None else {}
  variables = ctx.gather_layer({'params': layer_params})
  y, _ = Block(ctx, deterministic, name='layers').apply(variables, x, None, rngs=rngs)
  return y


def dropout(x, rate: float, rng):
  """x with each element zeroed with probability `rate` (the rest scaled by 1 / (1 - rate)),
  drawn from `rng`; x itself at rate 0 or without an rng (deterministic)."""
  if rate <= 0 or rng is None:
    return x
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


# Decoding with a KV cache: the keys and values of every layer at every position written so far,
# in the compute dtype, split over `tensor` on the heads as the attention's activations are.
# Keys [layers, batch, heads, head_dim, length], values [layers, batch, heads, length, head_dim]:
# the layouts whose two products XLA's CPU backend runs without transposing the cache. In the
# order [length, heads, head_dim] it transposed each layer's keys and values every step, and
# attention over 2048 positions took 4.3x as long (docs/benchmarks.md).
KEY_CACHE_NAMES = ('layers', 'batch', 'act_heads', None, 'length')
VALUE_CACHE_NAMES = ('layers', 'batch', 'act_heads', 'length', None)


class KVCache(NamedTuple):
  k: jax.Array  # [layers, batch, heads, head_dim, length]
  v: jax.Array  # [layers, batch, heads, length, head_dim]


def decode(params, tokens, positions, cache: KVCache | int, ctx: Context):
  """The model with a KV cache on tokens [B, T] at positions [B, T] (each row its own):
  (the final-LN hidden states [B, T, h], the cache with the tokens' keys and values written at
  their positions).

  `cache` a KVCache: the tokens attend to the cache's positions before them and to each other,
  causally (a decoding step: T = 1), and their keys and values are written after the layers.
  `cache` an int: the tokens are prompts from position 0 (positions 0..T-1 on every row) that
  attend to each other, causally, with model.attention_impl as in training, and the cache
  returned is a new one of that many positions (>= T), zeros after the prompts. ctx: without
  ZeRO-3 gathers or sequence parallelism. Keys, values and outputs are the training forward's
  for the same tokens.
  """
  cfg = ctx.cfg
  x = embed_tokens(params, tokens, cfg, ctx, positions)
  names = (KEY_CACHE_NAMES, VALUE_CACHE_NAMES)
  if isinstance(cache, int):
    after = cache - tokens.shape[1]

    def prompt_layer(x, layer_params):
      x, (k, v) = decode_block(layer_params, x, None, positions, ctx)
      # In the cache's layouts, zeros after the prompts. The scan's outputs are the cache
      # itself, one layer at a time: no second copy of it.
      k = jnp.pad(k.transpose(0, 2, 3, 1), [(0, 0), (0, 0), (0, 0), (0, after)])
      v = jnp.pad(v.transpose(0, 2, 1, 3), [(0, 0), (0, 0), (0, after), (0, 0)])
      return x, tuple(ctx.constrain(a, n[1:]) for a, n in zip((k, v), names, strict=True))

    x, kv = jax.lax.scan(prompt_layer, x, params['layers'])
  else:
    x, new = jax.lax.scan(
      lambda x, layer_in: decode_block(layer_in[0], x, layer_in[1], positions, ctx),
      x,
      (params['layers'], tuple(cache)),
    )
    rows = jnp.arange(tokens.shape[0])[:, None]
    # Indexed apart, rows and positions put their [B, T] first: the new [layers, B, T, heads,
    # head_dim] keys and values go in as [B, T, layers, heads, head_dim].
    new_k, new_v = (a.transpose(1, 2, 0, 3, 4) for a in new)
    kv = (
      cache.k.at[:, rows, :, :, positions].set(new_k),
      cache.v.at[:, rows, :, positions].set(new_v),
    )
  cache = KVCache(*(ctx.constrain(a, n) for a, n in zip(kv, names, strict=True)))
  return final_norm(params, x, cfg, ctx), cache


def decode_block(layer_params, x, kv, positions, ctx: Context):
  """One block of `decode` (params of a single layer) on x [B, T, h] at positions [B, T]: (its
  output, the tokens' keys and values [B, T, heads, head_dim]). kv: this layer's cache (keys
  [B, heads, head_dim, L], values [B, heads, L, head_dim]), or None for prompts that attend to
  each other only."""
  cfg = ctx.cfg
  residual = lambda y: ctx.constrain(y, ctx.residual_names)
  x = residual(x)
  q, k, v = attention_qkv(
    layer_params['attn'], residual(apply_norm(cfg, ctx, layer_params['ln1'], x)), ctx
  )
  slopes = alibi_slopes(cfg.num_heads) if cfg.architecture == 'bloom' else None
  if kv is None:
    context = attention_lib.attention(q, k, v, cfg=cfg, mesh=ctx.mesh, alibi_slopes=slopes)
  else:
    context = attention_lib.cached_attention(q, k, v, positions, *kv, alibi_slopes=slopes)
  x = x + attention_output(layer_params['attn'], context, ctx)
  mlp_in = residual(apply_norm(cfg, ctx, layer_params['ln2'], x))
  x = x + Mlp(ctx).apply({'params': layer_params['mlp']}, mlp_in)
  return residual(x), (k, v)


def gathered_embedding(model: Transformer, params) -> jax.Array:
  """The tied embedding of `params` as the model uses it (gathered under ZeRO-3), for the losses
  that apply it themselves."""
  ctx = Context(model.cfg, model.mesh, model.gathers)
  return ctx.gather_top({'word_embeddings': params['word_embeddings']})['word_embeddings']


def remat_policy(name: str):
  """The jax.checkpoint policy of `model.remat_policy`, or None for no recomputation."""
  return _REMAT_POLICIES.get(name)


def param_logical_names(boxed_params):
  """The logical axis names of every parameter of a boxed (nn.Partitioned) param tree."""
  return jax.tree.map(
    lambda b: b.names, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
  )
