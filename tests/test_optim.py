import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like.config import OptimizerConfig
from t5x_like.optim import adamw as optim
from t5x_like.training import schedule
from t5x_like.training import step as step_lib


def lr_at(cfg, samples):
  return float(schedule.learning_rate(cfg, samples))


def test_warmup_then_cosine_to_min_then_constant():
  cfg = OptimizerConfig(lr=6e-5, min_lr=6e-6, warmup_samples=183_105, decay_samples=200_000_000)
  assert lr_at(cfg, 0) == 0.0
  assert lr_at(cfg, 183_105 // 2) == pytest.approx(3e-5, rel=1e-4)
  assert lr_at(cfg, 183_105) == pytest.approx(6e-5, rel=1e-6)
  mid = 183_105 + (200_000_000 - 183_105) / 2
  assert lr_at(cfg, mid) == pytest.approx((6e-5 + 6e-6) / 2, rel=1e-4)
  assert lr_at(cfg, 200_000_000) == pytest.approx(6e-6, rel=1e-6)
  assert lr_at(cfg, 250_000_000) == pytest.approx(6e-6, rel=1e-6)


def test_linear_and_constant_decay():
  lin = OptimizerConfig(
    lr=1.0, min_lr=0.0, warmup_samples=10, decay_samples=110, decay_style='linear'
  )
  assert lr_at(lin, 60) == pytest.approx(0.5)
  assert lr_at(lin, 85) == pytest.approx(0.25)
  const = OptimizerConfig(
    lr=1.0, min_lr=0.0, warmup_samples=10, decay_samples=110, decay_style='constant'
  )
  assert lr_at(const, 5) == pytest.approx(0.5) and lr_at(const, 100) == 1.0


def test_no_weight_decay_on_biases_or_any_layernorm():
  params = {
    'word_embeddings': jnp.ones((8, 4)),
    'embed_ln': {'scale': jnp.ones(4), 'bias': jnp.ones(4)},
    'final_ln': {'scale': jnp.ones(4), 'bias': jnp.ones(4)},
    'layers': {
      'ln1': {'scale': jnp.ones((2, 4))},
      'attn': {
        'qkv_kernel': jnp.ones((2, 4, 2, 3, 2)),
        'qkv_bias': jnp.ones((2, 2, 3, 2)),
        'out_bias': jnp.ones((2, 4)),
      },
      'mlp': {'wi_kernel': jnp.ones((2, 4, 16)), 'wi_bias': jnp.ones((2, 16))},
    },
  }
  mask = optim.decay_mask(params)
  assert mask['word_embeddings'] is True
  assert mask['layers']['attn']['qkv_kernel'] and mask['layers']['mlp']['wi_kernel']
  for path in (
    ('embed_ln', 'scale'),
    ('embed_ln', 'bias'),
    ('final_ln', 'scale'),
    ('layers', 'ln1', 'scale'),
    ('layers', 'attn', 'qkv_bias'),
    ('layers', 'attn', 'out_bias'),
    ('layers', 'mlp', 'wi_bias'),
  ):
    node = mask
    for key in path:
      node = node[key]
    assert node is False, path


@pytest.mark.parametrize(
  'model, mesh',
  [
    ({'architecture': 'bloom'}, {'data': 2, 'tensor': 2}),
    ({'architecture': 'gpt2'}, {'data': 2, 'tensor': 2}),
    ({'architecture': 'gpt2', 'stable_embedding': True}, {'data': 2}),
    ({'architecture': 'bloom'}, {'pipeline': 2, 'tensor': 2}),
  ],
)
def test_weight_decay_reaches_exactly_the_real_models_matrices(model, mesh):
  """The mask on the params as the train step holds them (the pipeline's stage stacks, ZeRO's
  padding), of each architecture: no LayerNorm (any {scale, bias} pair, wherever it sits and
  whatever it is named: the chronicles' embedding LayerNorm) and no bias decays; every weight
  matrix and embedding does, GPT-2's positions included, as in Megatron."""
  from t5x_like.config import Config
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout

  cfg = Config.from_dict(
    {
      'model': {'num_layers': 4, 'hidden_size': 32, 'num_heads': 4, 'vocab_size': 64, **model},
      'train': {'steps': 1, 'global_batch_size': 8, 'micro_batch_size': 2, 'seq_len': 16},
      'mesh': mesh,
    }
  ).validate()
  params = make_layout(cfg, partitioning.mesh_of(cfg.mesh)).abstract.params
  mask = optim.decay_mask(params)

  def leaves(tree, path=()):
    for key, node in tree.items():
      if isinstance(node, dict):
        is_norm = set(node) == {'scale', 'bias'}
        yield from ((p, norm or is_norm) for p, norm in leaves(node, (*path, key)))
      else:
        yield (*path, key), False

  def at(tree, path):
    for key in path:
      tree = tree[key]
    return tree

  found = list(leaves(params))
  norms = [path for path, is_norm in found if is_norm]
  assert len(norms) >= 2 * (2 + 1)  # each layer's two LayerNorms (stacked) and the final one
  decayed = sorted('/'.join(path) for path, _ in found if at(mask, path))
  expected = sorted(
    '/'.join(path) for path, is_norm in found if not is_norm and not path[-1].endswith('bias')
  )
  assert decayed == expected
  assert 'word_embeddings' in '|'.join(decayed) and 'qkv_kernel' in '|'.join(decayed)


def test_adam_step_count_lives_in_the_state_and_matches_torch_adamw_math():
  cfg = OptimizerConfig(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
  params = {'w': jnp.array([[1.0, -2.0]]), 'b': jnp.array([0.5])}
  tx = optim.make_optimizer(cfg, params)
  state = tx.init(params)
  grads = {'w': jnp.array([[0.3, -0.1]]), 'b': jnp.array([0.2])}
  p = params
  for step in range(1, 4):
    updates, state = tx.update(grads, state, p)
    p = jax.tree.map(lambda x, u: x - cfg.lr * u, p, updates)
    assert int(optim.adam_count(state)) == step
  # Closed form after 3 equal gradients: m_hat = g, v_hat = g^2 -> update = sign(g) (+ wd for w).
  w = np.array([[1.0, -2.0]])
  for _ in range(3):
    w = w - 0.1 * (
      np.sign([[0.3, -0.1]]) * np.abs([[0.3, -0.1]]) / (np.abs([[0.3, -0.1]]) + 1e-8) + 0.1 * w
    )
  np.testing.assert_allclose(p['w'], w, rtol=1e-5)
  np.testing.assert_allclose(p['b'], 0.5 - 3 * 0.1, rtol=1e-5)  # no decay on the bias


def test_clipping_reports_the_pre_clip_norm():
  grads = {'a': jnp.array([3.0, 4.0])}
  clipped, norm = optim.clip_by_global_norm(grads, 1.0)
  assert float(norm) == pytest.approx(5.0)
  assert float(jnp.linalg.norm(clipped['a'])) == pytest.approx(1.0, rel=1e-5)
  unclipped, norm = optim.clip_by_global_norm(grads, 0.0)
  np.testing.assert_array_equal(unclipped['a'], grads['a'])


def test_zero_count_counts_both_signed_zeros_and_nothing_else():
  """Megatron's 'num zeros', counted on bit patterns: +0 and -0 in fp32 and bf16, and not a
  subnormal (which `g == 0` on XLA's CPU flushes to zero), a NaN or an infinity."""
  tree = {
    'f32': jnp.array([0.0, -0.0, 1e-45, -1e-45, np.nan, np.inf, -3.0, 0.0], jnp.float32),
    'bf16': jnp.array([0.0, -0.0, 1e-40, 2.0], jnp.bfloat16),
  }
  assert int(step_lib.count_zeros(tree)) == 5
  normal = {k: jnp.where(jnp.abs(g) < 1e-30, 0, g) for k, g in tree.items()}
  assert int(step_lib.count_zeros(normal)) == sum(int(jnp.sum(g == 0)) for g in normal.values())


def test_token_decay_counts_tokens_from_the_end_of_the_warmup():
  """Megatron's --lr-decay-tokens: warm-up in samples, then the decay ratio in tokens, from the
  tokens consumed when the warm-up ended (`schedule.warmup_end_tokens`)."""
  cfg = OptimizerConfig(
    lr=1e-4, min_lr=1e-5, warmup_samples=100, decay_samples=10**9, decay_tokens=11_000
  )
  warmup_end = 1_000
  assert schedule.learning_rate(cfg, 50, 400, warmup_end) == pytest.approx(5e-5)  # samples
  assert schedule.learning_rate(cfg, 100, warmup_end, warmup_end) == pytest.approx(1e-4)
  # Halfway through the tokens, cosine: (lr + min_lr) / 2, whatever the samples say.
  assert schedule.learning_rate(cfg, 200, 6_000, warmup_end) == pytest.approx(5.5e-5)
  assert schedule.learning_rate(cfg, 10**8, 6_000, warmup_end) == pytest.approx(5.5e-5)
  assert schedule.learning_rate(cfg, 300, 11_000, warmup_end) == pytest.approx(1e-5)
  assert schedule.learning_rate(cfg, 300, 50_000, warmup_end) == pytest.approx(1e-5)
  # Past 2^31 tokens (tr11 consumed 450B): exact on the host, no int32 or float32 argument.
  big = OptimizerConfig(
    lr=1.0, min_lr=0.0, warmup_samples=0, decay_tokens=2 * 10**11 + 2, decay_style='linear'
  )
  assert schedule.learning_rate(big, 1, 10**11 + 1, 0) == 0.5
