import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import program_loops

from t5x_like.config import ModelConfig
from t5x_like.model import losses
from t5x_like.model import transformer as model_lib


def build(**overrides):
  cfg = ModelConfig(
    **{
      **dict(num_layers=3, hidden_size=48, num_heads=6, vocab_size=200, init_std=0.02),
      **overrides,
    }
  )
  m = model_lib.Transformer(cfg, padded_vocab=256)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
  boxed = m.init(jax.random.PRNGKey(0), tokens)['params']
  return cfg, m, nn.unbox(boxed), model_lib.param_logical_names(boxed), tokens


def test_alibi_slopes_match_the_fairseq_recipe():
  # Powers of two: 2^(-8(i+1)/n).
  np.testing.assert_allclose(model_lib.alibi_slopes(8), [2 ** (-(i + 1)) for i in range(8)])
  # 112 heads (BLOOM-176B): the 64 slopes for 64 heads, then every other slope of 128 heads.
  s112 = model_lib.alibi_slopes(112)
  np.testing.assert_allclose(s112[:64], [2 ** (-8 * (i + 1) / 64) for i in range(64)])
  np.testing.assert_allclose(s112[64:], [2 ** (-8 * (i + 1) / 128) for i in range(128)][0::2][:48])
  # 6 heads: 4 + 2.
  np.testing.assert_allclose(model_lib.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def test_gelu_is_the_tanh_approximation():
  x = jnp.linspace(-6, 6, 101)
  np.testing.assert_allclose(model_lib.gelu_tanh(x), jax.nn.gelu(x, approximate=True), atol=1e-6)


@pytest.mark.parametrize('dtype, tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_layer_norm_values_and_gradients_equal_autodiff_of_the_formula(dtype, tol):
  """The hand-written LayerNorm backward against autodiff of the plain fp32-statistics formula."""
  kx, ks, kb, kd = jax.random.split(jax.random.PRNGKey(3), 4)
  x = (3.0 * jax.random.normal(kx, (2, 5, 64)) + 1.5).astype(dtype)
  scale = 1.0 + 0.1 * jax.random.normal(ks, (64,))
  bias = 0.1 * jax.random.normal(kb, (64,))
  dy = jax.random.normal(kd, (2, 5, 64)).astype(dtype)

  def formula(x, scale, bias):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + 1e-5)
    return (y * scale + bias).astype(x.dtype)

  ours = lambda x, scale, bias: model_lib.layer_norm(x, scale, bias, 1e-5)
  want, want_vjp = jax.vjp(formula, x, scale, bias)
  got, got_vjp = jax.vjp(ours, x, scale, bias)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.float32(got), np.float32(want), atol=tol, rtol=tol)
  for g, w in zip(got_vjp(dy), want_vjp(dy)):
    assert g.dtype == w.dtype
    np.testing.assert_allclose(np.float32(g), np.float32(w), atol=tol, rtol=tol)


def test_parameter_layout_is_stacked_and_named():
  cfg, _, params, names, _ = build()
  L, h, n, d = 3, 48, 6, 8
  layers = params['layers']
  assert layers['attn']['qkv_kernel'].shape == (L, h, n, 3, d)
  assert layers['attn']['out_kernel'].shape == (L, n, d, h)
  assert layers['mlp']['wi_kernel'].shape == (L, h, 4 * h)
  assert layers['mlp']['wo_kernel'].shape == (L, 4 * h, h)
  assert params['word_embeddings'].shape == (256, h)
  assert set(params) == {'word_embeddings', 'embed_ln', 'layers', 'final_ln'}
  assert names['layers']['attn']['qkv_kernel'] == ('layers', 'embed', 'heads', 'qkv', 'kv')
  assert names['layers']['mlp']['wo_kernel'] == ('layers', 'mlp', 'embed')
  assert names['word_embeddings'] == ('vocab', 'embed')


def test_init_std_and_scaled_output_projections():
  cfg = ModelConfig(num_layers=8, hidden_size=256, num_heads=4, vocab_size=4096, init_std=0.02)
  m = model_lib.Transformer(cfg, padded_vocab=4096)
  params = nn.unbox(m.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))['params'])
  std = lambda x: float(jnp.std(x))
  assert abs(std(params['layers']['mlp']['wi_kernel']) - 0.02) < 0.001
  assert abs(std(params['word_embeddings']) - 0.02) < 0.001
  scaled = 0.02 / math.sqrt(2 * 8)
  assert abs(std(params['layers']['mlp']['wo_kernel']) - scaled) < 0.0005
  assert abs(std(params['layers']['attn']['out_kernel']) - scaled) < 0.0005
  assert float(jnp.abs(params['layers']['mlp']['wi_bias']).max()) == 0.0
  assert float(params['embed_ln']['scale'].min()) == 1.0
  # The default std is BLOOM's sqrt(1/(3h)).
  assert abs(ModelConfig(hidden_size=14336).weight_init_std - 0.0048) < 1e-4


def test_causal_and_padded_vocab_masked():
  cfg, m, params, _, tokens = build()
  logits = m.apply({'params': params}, tokens)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % cfg.vocab_size)
  logits2 = m.apply({'params': params}, changed)
  np.testing.assert_array_equal(logits[:, :8], logits2[:, :8])
  assert not np.allclose(logits[:, 8:], logits2[:, 8:])
  probs = jax.nn.softmax(logits, -1)
  assert float(probs[..., cfg.vocab_size :].max()) == 0.0


def test_gpt2_has_learned_positions_and_no_embedding_layernorm():
  cfg, m, params, names, tokens = build(architecture='gpt2', max_position_embeddings=32)
  assert 'position_embeddings' in params and 'embed_ln' not in params
  assert params['position_embeddings'].shape == (32, 48)
  logits = m.apply({'params': params}, tokens)
  assert logits.shape == (2, 12, 256) and bool(jnp.isfinite(logits[..., :200]).all())
  # Without ALiBi, position information comes only from the learned embeddings.
  zeroed = jax.tree.map(lambda x: x, params)
  zeroed['position_embeddings'] = jnp.zeros_like(params['position_embeddings'])
  assert not np.allclose(m.apply({'params': zeroed}, tokens), logits)


@pytest.mark.parametrize('policy', ['full', 'save_dots'])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
  cfg, m, params, _, tokens = build()
  remat = model_lib.Transformer(ModelConfig(**{**cfg.__dict__, 'remat_policy': policy}), 256)

  def loss(model, p):
    return losses.cross_entropy(model.apply({'params': p}, tokens[:, :-1]), tokens[:, 1:]).mean()

  l1, g1 = jax.value_and_grad(lambda p: loss(m, p))(params)
  l2, g2 = jax.value_and_grad(lambda p: loss(remat, p))(params)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)


def test_embedding_gradient_adds_a_frequent_tokens_rows_in_fp32():
  # One token in all 4,096 positions of a micro-batch (2 x 2048, tr11's): in bf16, jnp.take's
  # scatter-add stops growing once its sum's spacing passes twice a row's cotangent.
  cfg, _, params, _, _ = build(dtype='bfloat16')
  tokens = jnp.full((2, 2048), 7, jnp.int32)
  # Not constant along the features, which the embedding LayerNorm's backward would zero.
  scale = (1.0 + jnp.arange(4096.0) * 1e-3).reshape(2, 2048, 1) * jnp.linspace(-1.0, 2.0, 48)

  def row_gradient(dtype):
    ctx = model_lib.Context(ModelConfig(**{**cfg.__dict__, 'dtype': dtype}), None)

    def loss(table):
      x = model_lib.embed_tokens(dict(params, word_embeddings=table), tokens, cfg, ctx)
      return (x.astype(jnp.float32) * scale).sum()

    return jax.grad(loss)(params['word_embeddings'])[7]

  np.testing.assert_allclose(row_gradient('bfloat16'), row_gradient('float32'), rtol=2e-2, atol=1)


def test_dropout_is_active_only_when_training():
  cfg, m, params, _, tokens = build(hidden_dropout=0.1, attention_dropout=0.1)
  eval_a = m.apply({'params': params}, tokens)
  eval_b = m.apply({'params': params}, tokens)
  np.testing.assert_array_equal(eval_a, eval_b)
  train = m.apply(
    {'params': params}, tokens, deterministic=False, rngs={'dropout': jax.random.PRNGKey(3)}
  )
  assert not np.allclose(train, eval_a)


def test_cross_entropy_matches_log_softmax():
  logits = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 37)) * 4
  labels = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, 37)
  want = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
  np.testing.assert_allclose(losses.cross_entropy(logits, labels), want, rtol=1e-6)


def test_compile_size_does_not_grow_with_depth():
  """The layers are one scanned block: 2 and 16 layers lower to the same number of matmuls."""
  counts = []
  for layers in (2, 16):
    cfg = ModelConfig(num_layers=layers, hidden_size=32, num_heads=4, vocab_size=128)
    m = model_lib.Transformer(cfg, 128)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = jax.eval_shape(lambda: nn.unbox(m.init(jax.random.PRNGKey(0), tokens)['params']))
    text = jax.jit(lambda p: m.apply({'params': p}, tokens)).lower(params).as_text()
    counts.append(text.count('dot_general'))
  assert counts[0] == counts[1] > 0


@pytest.mark.parametrize('policy', ['none', 'save_dots'])
def test_unrolled_layers_give_the_scanned_loss_and_gradients_one_block_per_layer(policy):
  cfg, _, params, _, tokens = build()
  scanned, unrolled = (
    model_lib.Transformer(
      ModelConfig(**{**cfg.__dict__, 'remat_policy': policy, 'unroll_layers': unroll}), 256
    )
    for unroll in (False, True)
  )

  def loss(model, p):
    return losses.cross_entropy(model.apply({'params': p}, tokens[:, :-1]), tokens[:, 1:]).mean()

  steps = [
    jax.jit(jax.value_and_grad(lambda p, model=model: loss(model, p)))
    for model in (scanned, unrolled)
  ]
  (l1, g1), (l2, g2) = (step(params) for step in steps)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g1, g2)
  # The same (stacked) params; compiled, the scanned layers are a forward and a backward loop of
  # num_layers trips, the unrolled ones no loop and more matmuls (one block per layer).
  texts = [step.lower(params).compile().as_text() for step in steps]
  trips = [[trips for _, trips in program_loops(text)] for text in texts]
  assert trips == [[cfg.num_layers] * 2, []]
  assert texts[1].count(' dot(') > texts[0].count(' dot(') > 0
