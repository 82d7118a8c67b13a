"""Hugging Face BLOOM conversion: our Flax model must compute what BloomForCausalLM computes.

Every HF model here is built from a random `BloomConfig` (no hub access), with LayerNorm and bias
parameters perturbed so that a mix-up of scale/bias or a dropped bias cannot go unnoticed.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import linen as nn

from t5x_like.checkpointing import hf
from t5x_like.config import Config, ModelConfig
from t5x_like.model.losses import cross_entropy
from t5x_like.model.transformer import Transformer

# Head counts 3, 5 and 6 exercise the non-power-of-two ALiBi slopes; vocabularies that are not
# multiples of 128 exercise the embedding padding. A larger initializer_range than HF's 0.02 gives
# logits of order 1, so that the tolerance below is a real test.
CASES = [
  dict(hidden_size=48, n_head=3, n_layer=2, vocab_size=250, initializer_range=0.2, seed=0),
  dict(hidden_size=40, n_head=5, n_layer=3, vocab_size=1000, initializer_range=0.3, seed=1),
  dict(hidden_size=60, n_head=6, n_layer=2, vocab_size=333, initializer_range=0.25, seed=2),
  dict(hidden_size=64, n_head=8, n_layer=2, vocab_size=1000, initializer_range=0.2, seed=3),
]
CASE_IDS = [f'h{c["hidden_size"]}-n{c["n_head"]}-L{c["n_layer"]}-V{c["vocab_size"]}' for c in CASES]

# What holds in fp32 on CPU at these sizes (largest differences seen: 6e-6 on logits of magnitude
# up to 8, 1e-6 on the loss). Both sides are fp32 rounding, not a model mismatch: against HF run
# in float64 our logits are as close as HF's own fp32 ones, so longer sequences need a looser bound.
LOGITS_ATOL = 1e-5
LOSS_ATOL = 1e-5


def make_hf_model(case: dict) -> transformers.BloomForCausalLM:
  case = dict(case)
  seed = case.pop('seed')
  torch.manual_seed(seed)
  config = transformers.BloomConfig(**case, layer_norm_epsilon=1e-5)
  model = transformers.BloomForCausalLM(config).eval()
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith('.bias'):
        param.add_(0.1 * torch.randn_like(param))
      elif 'layernorm' in name or name.startswith('transformer.ln_f'):
        param.add_(0.2 * torch.randn_like(param))
  return model


def torch_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
  return {name: t.detach().numpy().copy() for name, t in module.state_dict().items()}


def our_config(hf_model) -> ModelConfig:
  values = hf.model_config_from_hf(hf_model.config.to_dict())
  # Through Config.from_dict: the values must be valid keys and types of our `model` section.
  return Config.from_dict({'model': {**values, 'dtype': 'float32'}}).model


def our_logits(cfg: ModelConfig, padded_vocab: int, params, tokens: np.ndarray) -> np.ndarray:
  model = Transformer(cfg, padded_vocab)
  return np.asarray(jax.jit(model.apply)({'params': params}, jnp.asarray(tokens)))


def random_tokens(vocab_size: int, seed: int, shape=(2, 17)) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, vocab_size, shape, dtype=np.int32)


@pytest.mark.parametrize('case', CASES, ids=CASE_IDS)
def test_logits_and_loss_match_hf(case):
  hf_model = make_hf_model(case)
  cfg = our_config(hf_model)
  padded = cfg.padded_vocab_size(1)
  params = hf.params_from_hf_state(torch_state(hf_model), cfg, padded)
  tokens = random_tokens(cfg.vocab_size, case['seed'])

  with torch.no_grad():
    ids = torch.from_numpy(tokens).long()
    out = hf_model(ids, labels=ids)
  hf_logits = out.logits.numpy()
  logits = our_logits(cfg, padded, params, tokens)

  assert np.abs(hf_logits).max() > 1.0  # The comparison is not between near-zero numbers.
  np.testing.assert_allclose(logits[..., : cfg.vocab_size], hf_logits, rtol=0, atol=LOGITS_ATOL)
  # The padded rows can never be predicted.
  assert np.all(logits[..., cfg.vocab_size :] == np.finfo(np.float32).min)

  # HF shifts the labels inside the model: position t predicts token t+1.
  loss = float(cross_entropy(jnp.asarray(logits[:, :-1]), jnp.asarray(tokens[:, 1:])).mean())
  assert abs(loss - out.loss.item()) <= LOSS_ATOL


def test_param_layout_matches_the_flax_model():
  # The converter's table must describe exactly the tree that Transformer.init creates.
  cfg = ModelConfig(num_layers=3, hidden_size=40, num_heads=5, vocab_size=250)
  padded = cfg.padded_vocab_size(2)
  shapes = jax.eval_shape(
    Transformer(cfg, padded).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)
  )
  flat = {
    tuple(k.key for k in path): leaf.shape
    for path, leaf in jax.tree_util.tree_flatten_with_path(nn.unbox(shapes['params']))[0]
  }
  assert flat == hf.param_shapes(cfg, padded)


@pytest.mark.parametrize('case', CASES[:2], ids=CASE_IDS[:2])
def test_state_round_trip_is_bitwise(case):
  hf_model = make_hf_model(case)
  cfg = our_config(hf_model)
  padded = cfg.padded_vocab_size(1)
  # state_dict() carries the tied lm_head.weight, which must be accepted (it equals the embeddings).
  full_state = torch_state(hf_model)
  assert hf.HF_LM_HEAD in full_state
  params = hf.params_from_hf_state(full_state, cfg, padded)
  assert np.all(params['word_embeddings'][cfg.vocab_size :] == 0)

  state = hf.hf_state_from_params(params, cfg)
  expected = {k: v for k, v in full_state.items() if k != hf.HF_LM_HEAD}
  assert state.keys() == expected.keys()
  for name, value in expected.items():
    assert state[name].dtype == np.float32
    np.testing.assert_array_equal(state[name], value, err_msg=name)

  # Checkpoints saved from a bare BloomModel have no 'transformer.' prefix.
  unprefixed = hf.params_from_hf_state(torch_state(hf_model.transformer), cfg, padded)
  jax.tree.map(np.testing.assert_array_equal, unprefixed, params)
  again = hf.params_from_hf_state(state, cfg, padded)
  jax.tree.map(np.testing.assert_array_equal, again, params)


def test_params_round_trip_from_our_init_is_bitwise():
  cfg = ModelConfig(num_layers=2, hidden_size=48, num_heads=6, vocab_size=300)
  padded = cfg.padded_vocab_size(2)
  params = nn.unbox(
    Transformer(cfg, padded).init(jax.random.PRNGKey(3), jnp.zeros((1, 4), jnp.int32))['params']
  )
  params = jax.tree.map(np.array, params)  # Writable host copies.
  # The padded rows carry nothing the model computes, so the HF side drops them; zero them here.
  params['word_embeddings'][cfg.vocab_size :] = 0
  state = hf.hf_state_from_params(params, cfg)
  assert state['transformer.word_embeddings.weight'].shape == (300, 48)
  back = hf.params_from_hf_state(state, cfg, padded)
  jax.tree.map(np.testing.assert_array_equal, back, params)


def test_config_round_trip():
  cfg = ModelConfig(
    num_layers=3,
    hidden_size=60,
    num_heads=6,
    vocab_size=1000,
    layernorm_epsilon=1e-6,
    hidden_dropout=0.1,
    attention_dropout=0.05,
    init_std=0.01,
  )
  hf_config = hf.hf_config_from_model_config(cfg)
  bloom = transformers.BloomConfig(**hf_config)
  assert (bloom.n_layer, bloom.n_head, bloom.hidden_size, bloom.vocab_size) == (3, 6, 60, 1000)
  assert bloom.tie_word_embeddings and not bloom.apply_residual_connection_post_layernorm
  values = hf.model_config_from_hf(hf_config)
  assert Config.from_dict({'model': values}).model == cfg
  # init_std 0 means sqrt(1/(3h)); the HF config carries the resolved value.
  default_std = hf.hf_config_from_model_config(dataclasses.replace(cfg, init_std=0.0))
  assert default_std['initializer_range'] == pytest.approx((1 / (3 * 60)) ** 0.5)


def test_old_config_key_aliases():
  # bigscience/bloom-560m's config.json says n_embed and num_attention_heads.
  values = hf.model_config_from_hf(
    {
      'model_type': 'bloom',
      'n_embed': 64,
      'num_attention_heads': 4,
      'n_layer': 2,
      'vocab_size': 250880,
    }
  )
  assert (values['hidden_size'], values['num_heads'], values['init_std']) == (64, 4, 0.02)


def test_save_then_from_pretrained_gives_identical_logits(tmp_path):
  hf_model = make_hf_model(CASES[2])
  cfg = our_config(hf_model)
  params = hf.params_from_hf_state(torch_state(hf_model), cfg, cfg.padded_vocab_size(1))
  out_dir = tmp_path / 'export'
  out_dir.mkdir()  # An existing empty directory is fine.
  hf.save_hf_dir(
    str(out_dir), hf.hf_config_from_model_config(cfg), hf.hf_state_from_params(params, cfg)
  )
  assert sorted(os.listdir(out_dir)) == ['config.json', 'model.safetensors']
  assert os.listdir(tmp_path) == ['export']  # No staging directory left behind.
  for name in os.listdir(out_dir):  # readable by the others of a shared cluster, as HF's own
    assert os.stat(out_dir / name).st_mode & 0o777 == 0o644, name

  loaded, info = transformers.BloomForCausalLM.from_pretrained(
    str(out_dir), output_loading_info=True
  )
  assert not any(info.values()), info  # No missing, unexpected or mismatched keys.
  loaded.eval()
  ids = torch.from_numpy(random_tokens(cfg.vocab_size, 7)).long()
  with torch.no_grad():
    assert torch.equal(loaded(ids).logits, hf_model(ids).logits)

  config, state = hf.load_hf_dir(str(out_dir))
  assert config == json.loads(json.dumps(hf.hf_config_from_model_config(cfg)))
  jax.tree.map(
    np.testing.assert_array_equal,
    hf.params_from_hf_state(state, cfg, cfg.padded_vocab_size(1)),
    params,
  )


def test_save_pretrained_omits_tied_lm_head_and_sharded_dirs_load(tmp_path):
  hf_model = make_hf_model(CASES[0])
  cfg = our_config(hf_model)
  single, sharded = tmp_path / 'single', tmp_path / 'sharded'
  hf_model.save_pretrained(str(single))
  hf_model.save_pretrained(str(sharded), max_shard_size='20KB')
  assert os.path.isfile(sharded / 'model.safetensors.index.json')
  assert len([f for f in os.listdir(sharded) if f.endswith('.safetensors')]) > 1

  expected = hf.params_from_hf_state(torch_state(hf_model), cfg, 256)
  for directory in (single, sharded):
    config, state = hf.load_hf_dir(str(directory))
    assert hf.HF_LM_HEAD not in state  # save_pretrained drops the tied head.
    assert hf.model_config_from_hf(config) == hf.model_config_from_hf(hf_model.config.to_dict())
    jax.tree.map(np.testing.assert_array_equal, hf.params_from_hf_state(state, cfg, 256), expected)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_exactly_as_fp32(tmp_path, dtype):
  hf_model = make_hf_model(CASES[0]).to(dtype)
  hf_model.save_pretrained(str(tmp_path / 'half'))
  _, state = hf.load_hf_dir(str(tmp_path / 'half'))
  reference = {k: v.float().numpy() for k, v in hf_model.state_dict().items() if k != hf.HF_LM_HEAD}
  assert state.keys() == reference.keys()
  for name, value in reference.items():
    assert state[name].dtype == np.float32
    np.testing.assert_array_equal(state[name], value, err_msg=name)


# --------------------------------------------------------------------------- errors


@pytest.fixture(name='small')
def fixture_small():
  hf_model = make_hf_model(CASES[0])
  cfg = our_config(hf_model)
  return cfg, torch_state(hf_model)


def test_missing_tensor_is_named(small):
  cfg, state = small
  del state['transformer.h.1.mlp.dense_4h_to_h.bias']
  with pytest.raises(
    ValueError, match=r'missing 1 tensor.*transformer\.h\.1\.mlp\.dense_4h_to_h\.bias'
  ):
    hf.params_from_hf_state(state, cfg, 256)


def test_wrong_shape_is_named(small):
  cfg, state = small
  name = 'transformer.h.0.self_attention.query_key_value.weight'
  state[name] = state[name].T.copy()
  with pytest.raises(ValueError, match=r'query_key_value\.weight.*shape \(48, 144\).*\(144, 48\)'):
    hf.params_from_hf_state(state, cfg, 256)


def test_unexpected_tensor_is_named(small):
  cfg, state = small
  state['transformer.h.2.input_layernorm.weight'] = np.ones(48, np.float32)
  with pytest.raises(ValueError, match=r'unexpected tensor.*h\.2\.input_layernorm\.weight'):
    hf.params_from_hf_state(state, cfg, 256)


def test_untied_lm_head_is_refused(small):
  cfg, state = small
  state[hf.HF_LM_HEAD] = state[hf.HF_LM_HEAD] + 1.0
  with pytest.raises(ValueError, match='lm_head.weight.*untied'):
    hf.params_from_hf_state(state, cfg, 256)


def test_too_small_padded_vocab_is_refused(small):
  cfg, state = small
  with pytest.raises(ValueError, match='padded_vocab'):
    hf.params_from_hf_state(state, cfg, 128)


def test_pickled_bin_dir_is_refused(tmp_path):
  # The .bin file is never opened, let alone unpickled, so its bytes do not matter.
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'bloom'}))
  (tmp_path / 'pytorch_model.bin').write_bytes(b'never unpickled')
  with pytest.raises(ValueError, match=r'pickled weights \(pytorch_model\.bin\).*safetensors'):
    hf.load_hf_dir(str(tmp_path))


def test_dir_without_config_is_refused(tmp_path):
  with pytest.raises(FileNotFoundError, match='config.json'):
    hf.load_hf_dir(str(tmp_path))


def test_save_refuses_non_empty_dir(small, tmp_path):
  cfg, _ = small
  params = hf.params_from_hf_state(small[1], cfg, 256)
  target = tmp_path / 'out'
  target.mkdir()
  (target / 'keep.txt').write_text('precious')
  with pytest.raises(FileExistsError, match='not an empty directory'):
    hf.save_hf_dir(
      str(target), hf.hf_config_from_model_config(cfg), hf.hf_state_from_params(params, cfg)
    )
  assert os.listdir(target) == ['keep.txt']
  assert sorted(os.listdir(tmp_path)) == ['out']


def test_save_refuses_state_that_does_not_fit_the_config(small, tmp_path):
  cfg, state = small
  state.pop(hf.HF_LM_HEAD)
  config = hf.hf_config_from_model_config(dataclasses.replace(cfg, num_layers=3))
  with pytest.raises(ValueError, match=r'missing.*transformer\.h\.2\.'):
    hf.save_hf_dir(str(tmp_path / 'out'), config, state)
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
  'change, message',
  [
    ({'model_type': 'gpt2'}, "model_type='gpt2'"),
    (
      {'apply_residual_connection_post_layernorm': True},
      'apply_residual_connection_post_layernorm',
    ),
    ({'tie_word_embeddings': False}, 'tie_word_embeddings'),
    ({'n_head': 7}, 'not divisible'),
  ],
)
def test_unsupported_hf_configs_are_refused(change, message):
  config = {
    'model_type': 'bloom',
    'hidden_size': 48,
    'n_head': 3,
    'n_layer': 2,
    'vocab_size': 250,
    **change,
  }
  with pytest.raises(ValueError, match=message):
    hf.model_config_from_hf(config)


def test_only_bloom_is_exported():
  with pytest.raises(ValueError, match="only the 'bloom' architecture"):
    hf.hf_config_from_model_config(ModelConfig(architecture='gpt2'))
  with pytest.raises(ValueError, match='4 \\* hidden_size'):
    hf.hf_config_from_model_config(ModelConfig(ffn_hidden_size=100))
