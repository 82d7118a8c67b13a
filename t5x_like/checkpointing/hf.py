"""Conversion between our BLOOM parameters and Hugging Face `BloomForCausalLM` checkpoints.

Four pure functions translate configs and weights, two functions do the file I/O:

  model_config_from_hf(hf_config)         BLOOM config.json dict -> values of our `model` section
  hf_config_from_model_config(cfg)        ModelConfig -> BLOOM config.json dict
  params_from_hf_state(state, cfg, Vpad)  HF tensors -> our param tree (fp32 numpy)
  hf_state_from_params(params, cfg)       our param tree -> HF tensors (fp32 numpy)
  load_hf_dir(dir) / save_hf_dir(dir, config, state)

Weight mapping (HF `Linear.weight` is [out, in]; our kernels are [in, out]):

  word_embeddings.weight [V, h]                 word_embeddings [V_pad, h], rows >= V are zero
  word_embeddings_layernorm.{weight,bias}       embed_ln/{scale,bias}
  h.N.input_layernorm.{weight,bias}             layers/ln1/{scale,bias}[N]
  h.N.self_attention.query_key_value.weight     layers/attn/qkv_kernel[N] = W.T as (h, n, 3, d)
  h.N.self_attention.query_key_value.bias       layers/attn/qkv_bias[N]   = b as (n, 3, d)
  h.N.self_attention.dense.weight               layers/attn/out_kernel[N] = W.T as (n, d, h)
  h.N.self_attention.dense.bias                 layers/attn/out_bias[N]
  h.N.post_attention_layernorm.{weight,bias}    layers/ln2/{scale,bias}[N]
  h.N.mlp.dense_h_to_4h.{weight,bias}           layers/mlp/wi_kernel[N] = W.T, wi_bias[N]
  h.N.mlp.dense_4h_to_h.{weight,bias}           layers/mlp/wo_kernel[N] = W.T, wo_bias[N]
  ln_f.{weight,bias}                            final_ln/{scale,bias}

HF's fused QKV rows are head-major with q, k, v interleaved per head, exactly our (heads, 3, d)
order, and the attention context entering `dense` is head-major like our (heads, d) — so every
conversion is a transpose plus a reshape, never a permutation.

Only safetensors are read or written: pickled `pytorch_model.bin` files can run code when loaded.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from t5x_like.config import ModelConfig

# BloomForCausalLM.save_pretrained prefixes every tensor with this; checkpoints saved from a bare
# BloomModel (e.g. bigscience/bloom-560m) have no prefix.
HF_PREFIX = 'transformer.'
# BLOOM ties the output projection to the word embeddings. save_pretrained omits this tensor, but
# a state_dict() of BloomForCausalLM (and some old checkpoints) contain it.
HF_LM_HEAD = 'lm_head.weight'
CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'

# safetensors dtype codes that are converted to fp32 on load (bf16/fp16 exactly, fp64 rounded).
_FLOAT_DTYPES = ('F16', 'BF16', 'F32', 'F64')


# --------------------------------------------------------------------------- configs


def _first_present(hf_config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
  """The value of the first of several aliases (BLOOM configs were written under varying names)."""
  for key in keys:
    if hf_config.get(key) is not None:
      return hf_config[key]
  raise ValueError(
    f'BLOOM config has none of the keys {list(keys)}; it needs one of them to '
    'define the architecture'
  )


def model_config_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
  """Our `model` config section's values (for `Config.from_dict({'model': ...})`) of a BLOOM config.

  Raises ValueError for configs our model cannot reproduce exactly.
  """
  model_type = hf_config.get('model_type')
  if model_type != 'bloom':
    raise ValueError(
      f'only BLOOM checkpoints can be imported: config.json has model_type='
      f"{model_type!r}, expected 'bloom'"
    )
  if hf_config.get('apply_residual_connection_post_layernorm', False):
    raise ValueError(
      'apply_residual_connection_post_layernorm=True (the residual taken after the '
      'LayerNorm) is not supported: our blocks add the residual before the '
      'LayerNorm, as every released BLOOM model does'
    )
  if not hf_config.get('tie_word_embeddings', True):
    raise ValueError(
      'tie_word_embeddings=False is not supported: our model computes the logits '
      'with the word embeddings, so a separate lm_head cannot be represented'
    )
  # Old BLOOM configs (e.g. bloom-560m) say n_embed / num_attention_heads; HF accepts all of them.
  # The structural keys are required rather than defaulted: a guessed shape would only fail later,
  # with a less helpful message, when the tensors do not fit.
  hidden_size = int(_first_present(hf_config, ('hidden_size', 'n_embed')))
  num_heads = int(_first_present(hf_config, ('n_head', 'num_attention_heads')))
  num_layers = int(_first_present(hf_config, ('n_layer', 'num_hidden_layers')))
  vocab_size = int(_first_present(hf_config, ('vocab_size',)))
  if hidden_size % num_heads:
    raise ValueError(
      f'BLOOM config has hidden_size={hidden_size} not divisible by n_head={num_heads}'
    )
  # The other keys fall back to BloomConfig's defaults, as `from_pretrained` does. HF ignores
  # `n_inner` and `pretraining_tp` (without slow_but_exact) changes nothing numerically, so the
  # MLP is always 4h and neither key matters here.
  return {
    'architecture': 'bloom',
    'num_layers': num_layers,
    'hidden_size': hidden_size,
    'num_heads': num_heads,
    'ffn_hidden_size': 0,
    'vocab_size': vocab_size,
    'layernorm_epsilon': float(hf_config.get('layer_norm_epsilon', 1e-5)),
    'hidden_dropout': float(hf_config.get('hidden_dropout', 0.0)),
    'attention_dropout': float(hf_config.get('attention_dropout', 0.0)),
    'init_std': float(hf_config.get('initializer_range', 0.02)),
  }


def _check_bloom_model(cfg: ModelConfig) -> None:
  """Raises ValueError unless `cfg` has a BLOOM twin in Hugging Face."""
  if cfg.architecture != 'bloom':
    raise ValueError(
      f"only the 'bloom' architecture converts to/from Hugging Face BLOOM; "
      f'model.architecture is {cfg.architecture!r}'
    )
  if cfg.ffn_size != 4 * cfg.hidden_size:
    raise ValueError(
      f'Hugging Face BLOOM has an MLP of 4 * hidden_size = {4 * cfg.hidden_size}; '
      f'model.ffn_hidden_size={cfg.ffn_hidden_size} cannot be represented'
    )
  if cfg.hidden_size % cfg.num_heads:
    raise ValueError(
      f'model.hidden_size ({cfg.hidden_size}) is not divisible by model.num_heads ({cfg.num_heads})'
    )


def hf_config_from_model_config(
  cfg: ModelConfig, bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 3
) -> dict[str, Any]:
  """A BLOOM config.json dict for `cfg` (the real, unpadded vocabulary).

  The default special-token ids are the BigScience BLOOM tokenizer's (<s>=1, </s>=2, <pad>=3).
  """
  _check_bloom_model(cfg)
  for name, token_id in (('bos', bos_token_id), ('eos', eos_token_id), ('pad', pad_token_id)):
    if not 0 <= token_id < cfg.vocab_size:
      raise ValueError(
        f'{name}_token_id={token_id} is outside the vocabulary [0, {cfg.vocab_size})'
      )
  return {
    'model_type': 'bloom',
    'architectures': ['BloomForCausalLM'],
    'vocab_size': cfg.vocab_size,
    'hidden_size': cfg.hidden_size,
    'n_layer': cfg.num_layers,
    'n_head': cfg.num_heads,
    'layer_norm_epsilon': cfg.layernorm_epsilon,
    # The resolved std, so that an init_std of 0 (meaning sqrt(1/(3h))) survives the round trip.
    'initializer_range': cfg.weight_init_std,
    'hidden_dropout': cfg.hidden_dropout,
    'attention_dropout': cfg.attention_dropout,
    'apply_residual_connection_post_layernorm': False,
    'pretraining_tp': 1,
    'slow_but_exact': False,
    'tie_word_embeddings': True,
    'use_cache': True,
    'bos_token_id': bos_token_id,
    'eos_token_id': eos_token_id,
    'pad_token_id': pad_token_id,
    # The weights that save_hf_dir writes are fp32.
    'dtype': 'float32',
  }


# --------------------------------------------------------------------------- weights


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One HF tensor and where it lives in our param tree.

  ours = (W.T if transpose else W).reshape(our_shape); the inverse for the way back.
  """

  hf_name: str  # Without HF_PREFIX.
  path: tuple[str, ...]  # In our param tree.
  layer: int | None  # Index into the stacked layers dim, None for a top-level param.
  hf_shape: tuple[int, ...]
  our_shape: tuple[int, ...]  # Per layer for stacked params.
  transpose: bool = False

  def to_ours(self, value: np.ndarray) -> np.ndarray:
    return (value.T if self.transpose else value).reshape(self.our_shape)

  def to_hf(self, value: np.ndarray) -> np.ndarray:
    if self.transpose:
      return value.reshape(self.hf_shape[::-1]).T
    return value.reshape(self.hf_shape)


def _tensors(cfg: ModelConfig) -> list[_Tensor]:
  """Every tensor of a BLOOM checkpoint of `cfg`, in save_pretrained's module order."""
  h, n, d, f, v = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.ffn_size, cfg.vocab_size

  def layer_norm(hf, ours, layer=None):
    return [
      _Tensor(f'{hf}.weight', (*ours, 'scale'), layer, (h,), (h,)),
      _Tensor(f'{hf}.bias', (*ours, 'bias'), layer, (h,), (h,)),
    ]

  tensors = [
    # Our embedding has V_pad rows; params_from_hf_state/hf_state_from_params pad and slice it.
    _Tensor('word_embeddings.weight', ('word_embeddings',), None, (v, h), (v, h)),
    *layer_norm('word_embeddings_layernorm', ('embed_ln',)),
  ]
  for i in range(cfg.num_layers):
    p = f'h.{i}.'
    tensors += [
      *layer_norm(p + 'input_layernorm', ('layers', 'ln1'), i),
      _Tensor(
        p + 'self_attention.query_key_value.weight',
        ('layers', 'attn', 'qkv_kernel'),
        i,
        (3 * h, h),
        (h, n, 3, d),
        transpose=True,
      ),
      _Tensor(
        p + 'self_attention.query_key_value.bias',
        ('layers', 'attn', 'qkv_bias'),
        i,
        (3 * h,),
        (n, 3, d),
      ),
      _Tensor(
        p + 'self_attention.dense.weight',
        ('layers', 'attn', 'out_kernel'),
        i,
        (h, h),
        (n, d, h),
        transpose=True,
      ),
      _Tensor(p + 'self_attention.dense.bias', ('layers', 'attn', 'out_bias'), i, (h,), (h,)),
      *layer_norm(p + 'post_attention_layernorm', ('layers', 'ln2'), i),
      _Tensor(
        p + 'mlp.dense_h_to_4h.weight',
        ('layers', 'mlp', 'wi_kernel'),
        i,
        (f, h),
        (h, f),
        transpose=True,
      ),
      _Tensor(p + 'mlp.dense_h_to_4h.bias', ('layers', 'mlp', 'wi_bias'), i, (f,), (f,)),
      _Tensor(
        p + 'mlp.dense_4h_to_h.weight',
        ('layers', 'mlp', 'wo_kernel'),
        i,
        (h, f),
        (f, h),
        transpose=True,
      ),
      _Tensor(p + 'mlp.dense_4h_to_h.bias', ('layers', 'mlp', 'wo_bias'), i, (h,), (h,)),
    ]
  tensors += layer_norm('ln_f', ('final_ln',))
  return tensors


def param_shapes(cfg: ModelConfig, padded_vocab: int) -> dict[tuple[str, ...], tuple[int, ...]]:
  """Path -> shape of every leaf of our BLOOM param tree (layers stacked on dim 0)."""
  shapes = {}
  for t in _tensors(cfg):
    shapes[t.path] = t.our_shape if t.layer is None else (cfg.num_layers, *t.our_shape)
  shapes[('word_embeddings',)] = (padded_vocab, cfg.hidden_size)
  return shapes


def _non_finite(named: Mapping[str, Any], layered: frozenset = frozenset()) -> str | None:
  """'NAME (N NaN, M Inf of T values), ...' for the arrays of `named` that hold NaN or Inf (at
  most 8 named), or None when none does. The names in `layered` are stacked over layers (dim 0):
  their entry also says which layers."""
  found = []
  for name, value in named.items():
    value = np.asarray(value)
    finite = np.isfinite(value)
    if finite.all():
      continue
    counts = [
      f'{int(n)} {kind}'
      for n, kind in ((np.isnan(value).sum(), 'NaN'), (np.isinf(value).sum(), 'Inf'))
      if n
    ]
    where = ''
    if name in layered:
      layers = np.flatnonzero(~finite.reshape(len(value), -1).all(axis=1))
      where = f'; layer(s) {", ".join(map(str, layers))}'
    found.append(f'{name!r} ({", ".join(counts)} of {value.size} values{where})')
  if not found:
    return None
  more = f' and {len(found) - 8} more' if len(found) > 8 else ''
  return f'{len(found)} tensor(s): {", ".join(found[:8])}{more}'


def _strip_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
  """Tensor names without HF_PREFIX; a name present with and without it is an error."""
  stripped = {}
  for name, value in state.items():
    short = name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name
    if short in stripped:
      raise ValueError(f'tensor {short!r} appears both with and without the {HF_PREFIX!r} prefix')
    stripped[short] = value
  return stripped


def params_from_hf_state(
  state: Mapping[str, np.ndarray], cfg: ModelConfig, padded_vocab: int
) -> dict[str, Any]:
  """Our param tree (fp32 numpy, layers stacked) from the tensors of a HF BLOOM checkpoint.

  `state` maps HF names, with or without the 'transformer.' prefix, to arrays of any float dtype.
  The word embeddings are zero-padded to `padded_vocab` rows. Every expected tensor must be
  present with the expected shape and nothing else may be left; an `lm_head.weight` is accepted
  only if it equals the word embeddings (BLOOM ties them).
  """
  _check_bloom_model(cfg)
  if padded_vocab < cfg.vocab_size:
    raise ValueError(
      f'padded_vocab ({padded_vocab}) is smaller than the vocabulary ({cfg.vocab_size})'
    )
  # Before anything is converted: a NaN or Inf weight makes every logit NaN, and training from
  # it gives NaN losses at once, far from the import that brought it.
  non_finite = _non_finite(state)
  if non_finite:
    raise ValueError(
      f'HF BLOOM state has non-finite values in {non_finite}; a model with NaN '
      'or Inf weights computes NaN: fetch or convert the checkpoint again (a '
      'damaged download or copy), or use an earlier one (a diverged run)'
    )
  remaining = _strip_prefixes(state)
  lm_head = remaining.pop(HF_LM_HEAD, None)
  tensors = _tensors(cfg)
  # All missing names in one message: a config mismatch usually loses many at once.
  missing = [t.hf_name for t in tensors if t.hf_name not in remaining]
  if missing:
    shown = ', '.join(HF_PREFIX + name for name in missing[:8])
    more = f' and {len(missing) - 8} more' if len(missing) > 8 else ''
    raise ValueError(
      f'HF BLOOM state is missing {len(missing)} tensor(s): {shown}{more} '
      f'(expected for n_layer={cfg.num_layers}, hidden_size={cfg.hidden_size})'
    )

  params: dict[str, Any] = {}
  for path, shape in param_shapes(cfg, padded_vocab).items():
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    # Zeros: the padded embedding rows must be zero (they are never looked up, and their logits
    # are masked), and every other entry is overwritten below.
    node[path[-1]] = np.zeros(shape, np.float32)

  for t in tensors:
    value = np.asarray(remaining.pop(t.hf_name), dtype=np.float32)
    if value.shape != t.hf_shape:
      raise ValueError(
        f'tensor {HF_PREFIX + t.hf_name!r} has shape {tuple(value.shape)}, '
        f'expected {t.hf_shape} for n_layer={cfg.num_layers}, '
        f'hidden_size={cfg.hidden_size}, n_head={cfg.num_heads}, '
        f'vocab_size={cfg.vocab_size}'
      )
    node = params
    for key in t.path[:-1]:
      node = node[key]
    if t.path == ('word_embeddings',):
      node[t.path[-1]][: cfg.vocab_size] = value
    elif t.layer is None:
      node[t.path[-1]][...] = t.to_ours(value)
    else:
      node[t.path[-1]][t.layer] = t.to_ours(value)

  if remaining:
    names = ', '.join(repr(name) for name in sorted(remaining)[:8])
    raise ValueError(
      f'HF BLOOM state has {len(remaining)} unexpected tensor(s): {names} '
      f'(a model with more layers than n_layer={cfg.num_layers}, or not BLOOM?)'
    )
  if lm_head is not None:
    embeddings = params['word_embeddings'][: cfg.vocab_size]
    lm_head = np.asarray(lm_head, dtype=np.float32)
    if lm_head.shape != embeddings.shape or not np.array_equal(lm_head, embeddings):
      raise ValueError(
        f'{HF_LM_HEAD!r} differs from the word embeddings: the checkpoint has an '
        'untied output layer, which our model (logits from the word embeddings, as '
        'in BLOOM) cannot represent'
      )
  return params


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(_flatten(value, (*prefix, key)))
    else:
      flat[(*prefix, key)] = value
  return flat


def hf_state_from_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
  """HF BLOOM tensors (fp32 numpy, 'transformer.'-prefixed) from our unboxed param tree.

  The names are those `BloomForCausalLM.save_pretrained` writes: the tied `lm_head.weight` is not
  included. The word embeddings are sliced to the real vocabulary; the padded rows are dropped,
  which loses nothing the model computes (they are never looked up and their logits are masked).
  """
  _check_bloom_model(cfg)
  flat = _flatten(params)
  embeddings = flat.get(('word_embeddings',))
  if embeddings is None:
    raise ValueError("param tree has no 'word_embeddings'")
  expected = param_shapes(cfg, padded_vocab=np.shape(embeddings)[0])
  if np.shape(embeddings)[0] < cfg.vocab_size:
    raise ValueError(
      f'word_embeddings has {np.shape(embeddings)[0]} rows, fewer than the '
      f'vocabulary ({cfg.vocab_size})'
    )
  for path, shape in expected.items():
    if path not in flat:
      raise ValueError(f'param tree is missing {"/".join(path)!r}')
    if tuple(np.shape(flat[path])) != shape:
      raise ValueError(
        f'param {"/".join(path)!r} has shape {tuple(np.shape(flat[path]))}, '
        f'expected {shape} for this model config'
      )
  unexpected = sorted('/'.join(path) for path in set(flat) - set(expected))
  if unexpected:
    raise ValueError(f'param tree has params that BLOOM does not have: {unexpected}')

  # One device-to-host copy per param, not one per layer slice.
  host = {path: np.asarray(value, dtype=np.float32) for path, value in flat.items()}
  non_finite = _non_finite(
    {'/'.join(path): value for path, value in host.items()},
    frozenset('/'.join(t.path) for t in _tensors(cfg) if t.layer is not None),
  )
  if non_finite:
    raise ValueError(
      f'the params have non-finite values in {non_finite}; exported, the model '
      'would compute NaN: export another step (--step N; `python -m t5x_like.ckpt '
      'verify` checks each one), or the last good checkpoint of the run'
    )
  state = {}
  for t in _tensors(cfg):
    value = host[t.path]
    if t.path == ('word_embeddings',):
      value = value[: cfg.vocab_size]
    elif t.layer is not None:
      value = t.to_hf(value[t.layer])
    else:
      value = t.to_hf(value)
    # Contiguous copies: safetensors serialises the buffer, and transposes are only views.
    state[HF_PREFIX + t.hf_name] = np.ascontiguousarray(value)
  return state


# --------------------------------------------------------------------------- files


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file as fp32 numpy arrays."""
  from safetensors import SafetensorError  # pylint: disable=import-outside-toplevel

  try:
    return _read_safetensors_unchecked(path)
  except SafetensorError as e:
    raise ValueError(
      f'{path} is not a readable safetensors file ({e}); it may be truncated (an '
      'interrupted download or copy): fetch or convert it again'
    ) from None


def _read_safetensors_unchecked(path: str) -> dict[str, np.ndarray]:
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  state = {}
  bf16_names = []
  with safe_open(path, framework='numpy') as f:
    for name in f.keys():
      dtype = f.get_slice(name).get_dtype()
      if dtype not in _FLOAT_DTYPES:
        raise ValueError(
          f'tensor {name!r} in {path} has dtype {dtype}; BLOOM weights are '
          f'floating point ({", ".join(_FLOAT_DTYPES)})'
        )
      if dtype == 'BF16':
        bf16_names.append(name)
      else:
        state[name] = f.get_tensor(name).astype(np.float32)
  if bf16_names:
    # numpy has no bfloat16, so safetensors' numpy reader refuses it; its flax reader returns jax
    # arrays, kept on the host so that a large checkpoint does not fill an accelerator.
    import jax  # pylint: disable=import-outside-toplevel

    with jax.default_device(jax.devices('cpu')[0]):
      with safe_open(path, framework='flax') as f:
        for name in bf16_names:
          # bf16 -> fp32 is exact (the bf16 bits are the top half of the fp32 ones).
          state[name] = np.asarray(f.get_tensor(name)).astype(np.float32)
  return state


def _read_json(path: str) -> Any:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (ValueError, UnicodeDecodeError) as e:
    raise ValueError(f'{path} is not valid JSON ({e}); fetch or fix the file') from None


def load_hf_dir(hf_dir: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.json dict, fp32 tensors) of a HF BLOOM checkpoint directory, safetensors only.

  Reads `model.safetensors`, or the shards listed in `*.safetensors.index.json`, or, without an
  index, every `*.safetensors` file. Pickled `*.bin` weights are refused.
  """
  if not os.path.isdir(hf_dir):
    raise FileNotFoundError(
      f'{hf_dir!r} is not a directory; pass a Hugging Face checkpoint '
      'directory (config.json + *.safetensors)'
    )
  config_path = os.path.join(hf_dir, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(
      f'{hf_dir!r} has no {CONFIG_FILE}; a Hugging Face checkpoint directory '
      'needs it to define the architecture'
    )
  config = _read_json(config_path)
  if not isinstance(config, dict):
    raise ValueError(
      f'{config_path} holds a {type(config).__name__}, not a JSON object of '
      'config fields; pass the config.json of a Hugging Face checkpoint'
    )

  indexes = sorted(glob.glob(os.path.join(hf_dir, '*.safetensors.index.json')))
  if len(indexes) > 1:
    raise ValueError(f'{hf_dir!r} has several safetensors indexes {indexes}; keep one')
  expected_names = None
  if indexes:
    weight_map = _read_json(indexes[0])
    weight_map = weight_map.get('weight_map') if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
      raise ValueError(
        f'{indexes[0]} has no weight_map of tensor names to shard files; '
        'fetch the index again or remove it to read every *.safetensors file'
      )
    expected_names = set(weight_map)
    files = [os.path.join(hf_dir, name) for name in sorted(set(weight_map.values()))]
    absent = [path for path in files if not os.path.isfile(path)]
    if absent:
      raise FileNotFoundError(f'{indexes[0]} lists shard(s) that do not exist: {absent}')
  else:
    files = sorted(glob.glob(os.path.join(hf_dir, '*.safetensors')))

  if not files:
    pickles = sorted(os.path.basename(p) for p in glob.glob(os.path.join(hf_dir, '*.bin')))
    if pickles:
      raise ValueError(
        f'{hf_dir!r} holds only pickled weights ({", ".join(pickles)}); they are refused because '
        'unpickling can run arbitrary code. Convert them once, in an environment you trust, '
        'with: python -c "import sys, transformers; transformers.BloomForCausalLM.'
        'from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2], safe_serialization=True)" '
        'IN_DIR OUT_DIR — which writes model.safetensors'
      )
    raise FileNotFoundError(f'{hf_dir!r} has no *.safetensors weights')

  state: dict[str, np.ndarray] = {}
  for path in files:
    for name, value in _read_safetensors(path).items():
      if name in state:
        raise ValueError(f'tensor {name!r} appears in more than one file of {hf_dir!r}')
      state[name] = value
  if expected_names is not None and set(state) != expected_names:
    diff = sorted(expected_names.symmetric_difference(state))
    raise ValueError(f'the shards of {hf_dir!r} do not match its index: {diff[:8]}')
  return config, state


def save_hf_dir(hf_dir: str, config: Mapping[str, Any], state: Mapping[str, np.ndarray]) -> None:
  """Writes `config.json` and `model.safetensors` that `BloomForCausalLM.from_pretrained` loads.

  The directory appears complete or not at all: everything is written into a temporary directory
  beside it, then renamed. An existing non-empty directory is never overwritten.
  """
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  # Check the pair before writing anything: the tensors must be exactly those of the config.
  cfg = ModelConfig(**model_config_from_hf(config))
  expected = {HF_PREFIX + t.hf_name: t.hf_shape for t in _tensors(cfg)}
  names = set(state)
  if names != set(expected):
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    raise ValueError(
      f'state does not match the config: missing {missing[:8]}, unexpected '
      f'{unexpected[:8]} (names must carry the {HF_PREFIX!r} prefix, as '
      'hf_state_from_params writes them)'
    )
  for name, shape in expected.items():
    if tuple(np.shape(state[name])) != shape:
      raise ValueError(
        f'tensor {name!r} has shape {tuple(np.shape(state[name]))}, expected {shape} for the config'
      )

  hf_dir = os.path.abspath(hf_dir)
  if os.path.exists(hf_dir) and (not os.path.isdir(hf_dir) or os.listdir(hf_dir)):
    raise FileExistsError(
      f'{hf_dir!r} already exists and is not an empty directory; refusing to '
      'overwrite it — pick a new path or remove it first'
    )
  parent = os.path.dirname(hf_dir)
  os.makedirs(parent, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f'.{os.path.basename(hf_dir)}.tmp-', dir=parent)
  try:
    # mkdtemp makes the directory private (0700); the checkpoint should read like any other.
    os.chmod(staging, 0o755)
    with open(os.path.join(staging, CONFIG_FILE), 'w', encoding='utf-8') as f:
      json.dump(dict(config), f, indent=2, sort_keys=True)
      f.write('\n')
    tensors = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in state.items()}
    # format=pt: what transformers writes, and what its loader checks for.
    save_file(tensors, os.path.join(staging, WEIGHTS_FILE), metadata={'format': 'pt'})
    for name in (CONFIG_FILE, WEIGHTS_FILE):
      os.chmod(os.path.join(staging, name), 0o644)  # safetensors writes its file owner-only
      with open(os.path.join(staging, name), 'rb') as f:
        os.fsync(f.fileno())
    # rename(2) replaces an empty directory atomically and fails on a non-empty one, so a
    # directory filled concurrently since the check above is not clobbered either.
    os.replace(staging, hf_dir)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  directory = os.open(parent, os.O_RDONLY)
  try:
    os.fsync(directory)  # Makes the rename itself durable.
  finally:
    os.close(directory)


__all__ = [
  'model_config_from_hf',
  'hf_config_from_model_config',
  'params_from_hf_state',
  'hf_state_from_params',
  'load_hf_dir',
  'save_hf_dir',
  'param_shapes',
]
