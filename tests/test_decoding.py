"""KV-cache generation (t5x_like/inference/decoding.py) against the forward without a cache.

The reference below is what `generate` did before the cache: each new token runs the whole
model over a fixed prompt + new-token buffer and takes the logits at the last written position.
Random small models in fp32, init_std large enough that their continuations vary.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5x_like.inference import decoding
from t5x_like.inference.loading import inference_config
from t5x_like.mesh import partitioning
from t5x_like.model import transformer as model_lib
from t5x_like.parallel.train_state import make_layout

# Prompts of 1, 7 and 60 tokens: one prompt buffer of 64 positions and, with 12 new tokens, a
# cache of 128; the rows' positions differ at every step.
PROMPTS = [[3], [5, 17, 42, 7, 250, 999, 0], [(i * 37 + 11) % 1000 for i in range(60)]]
NEW = 12
REFERENCE_BUFFER = 96  # every prompt + NEW fits: one reference compilation per model


@functools.cache
def model(architecture, data=1, tensor=1):
  """(inference config, params in its compute shardings) of a random 2-layer model."""
  saved = small_config(
    model=dict(architecture=architecture, init_std=1.0, max_position_embeddings=128),
    mesh=dict(data=data, tensor=tensor),
  )
  cfg = inference_config(saved, data=data, tensor=tensor)
  layout = make_layout(cfg, partitioning.make_mesh(data, 1, tensor))
  return cfg, layout.compute_params(layout.init(0).params)


@functools.cache
def reference_step(cfg, temperature, top_k):
  """The jitted no-cache step: the next token from the forward over the whole buffer."""
  mesh = partitioning.make_mesh(cfg.mesh.data, 1, cfg.mesh.tensor)
  transformer = model_lib.Transformer(cfg.model, cfg.padded_vocab_size, mesh)

  @jax.jit
  def next_token(params, buffer, position, key):
    logits = transformer.apply({'params': params}, buffer[None])[0, position - 1]
    if temperature == 0:
      return jnp.argmax(logits)
    logits = logits / temperature
    if top_k:
      logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
    return jax.random.categorical(key, logits)

  return next_token


def reference(cfg, params, prompt, new, temperature=0.0, top_k=0, seed=0):
  """`new` tokens after `prompt` without a cache (PRNGKey(seed)'s split chain for draws)."""
  next_token = reference_step(cfg, temperature, top_k)
  buffer = np.zeros(REFERENCE_BUFFER, np.int32)
  buffer[: len(prompt)] = prompt
  key = jax.random.PRNGKey(seed)
  for position in range(len(prompt), len(prompt) + new):
    key, step_key = jax.random.split(key)
    buffer[position] = int(next_token(params, jnp.asarray(buffer), position, step_key))
  return buffer[len(prompt) : len(prompt) + new].tolist()


@pytest.mark.parametrize(
  'architecture, data, tensor', [('bloom', 1, 1), ('gpt2', 1, 1), ('bloom', 2, 2), ('gpt2', 1, 2)]
)
def test_cached_greedy_is_the_full_forwards_greedy_for_a_batch_of_prompt_lengths(
  architecture, data, tensor
):
  """BLOOM (ALiBi over keys 0..p) and GPT-2 (the learned position p), on one device, on
  mesh.tensor 2 (the cache split over the heads) and on data 2 x tensor 2 (three prompts in
  four rows): every row's tokens are the no-cache forward's, token for token."""
  cfg, params = model(architecture, data, tensor)
  ours = decoding.generate(cfg, params, PROMPTS, NEW)
  assert ours == [reference(cfg, params, p, NEW) for p in PROMPTS]
  assert all(len(row) == NEW and len(set(row)) > 3 for row in ours)  # varied continuations


def test_eod_and_stop_end_their_rows_alone():
  """A row ends after eod_id (kept) or once stop(row, its ids) is True; the others run on and
  write what they would have written. stop is called after each token of a running row. Every
  row ends at max_new_tokens, one token too (the prefill's alone)."""
  cfg, params = model('gpt2')
  full = decoding.generate(cfg, params, PROMPTS, NEW)
  eod = full[1][4]
  assert eod not in full[1][:4] and eod not in full[2][:3]
  calls = []

  def stop(row, ids):
    calls.append((row, list(ids)))
    return row == 2 and len(ids) == 3

  ours = decoding.generate(cfg, params, PROMPTS, NEW, eod_id=eod, stop=stop)
  first_eod = lambda row: row[: row.index(eod) + 1] if eod in row else row
  assert ours == [first_eod(full[0]), full[1][:5], full[2][:3]]
  assert [c for c in calls if c[0] == 2] == [(2, full[2][:n]) for n in (1, 2, 3)]
  assert [c for c in calls if c[0] == 1] == [(1, full[1][:n]) for n in (1, 2, 3, 4)]
  assert decoding.generate(cfg, params, PROMPTS, 1) == [row[:1] for row in full]


def test_sampling_follows_the_seed_and_draws_what_the_forward_without_a_cache_drew():
  """A seed reproduces itself and another seed differs; the first row (a single prompt's) draws
  what the no-cache generation drew, top_k too; a row's draws do not depend on the other rows,
  and two rows of one prompt draw apart; top_k 1 is greedy."""
  cfg, params = model('bloom')
  sample = lambda prompts, seed, **kw: decoding.generate(
    cfg, params, prompts, NEW, temperature=1.5, seed=seed, **kw
  )
  batch = sample(PROMPTS, 3)
  assert batch == sample(PROMPTS, 3) and batch != sample(PROMPTS, 4)
  assert batch[0] == reference(cfg, params, PROMPTS[0], NEW, 1.5, seed=3)
  top_4 = reference(cfg, params, PROMPTS[0], NEW, 1.5, top_k=4, seed=3)
  assert sample(PROMPTS, 3, top_k=4)[0] == top_4
  assert sample([PROMPTS[0], [7, 7], PROMPTS[2]], 3)[::2] == batch[::2]
  same = sample([PROMPTS[1], PROMPTS[1], PROMPTS[2]], 3)  # rows draw apart
  assert same[1] == batch[1] and same[0] != same[1]
  assert sample(PROMPTS, 3, top_k=1) == decoding.generate(cfg, params, PROMPTS, NEW)


def test_padded_vocabulary_rows_are_never_predicted():
  """The padded rows of the tied embedding (1000 real of 1024) made the likeliest by far: greedy
  and sampled tokens stay in the real vocabulary."""
  cfg, params = model('bloom')
  table = params['word_embeddings']
  pad = jnp.arange(table.shape[0]) >= cfg.model.vocab_size
  params = dict(params, word_embeddings=jnp.where(pad[:, None], 1e3 * table[:1], table))
  for temperature in (0.0, 1.0):
    ids = decoding.generate(cfg, params, PROMPTS, 4, temperature=temperature)
    assert all(0 <= t < cfg.model.vocab_size for row in ids for t in row)


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
  """A tokenizer smaller than the model's vocabulary (BLOOM's 250,680 tokens in 250,880 rows):
  the rows past it made the likeliest, greedy and sampled tokens stay below vocab_limit, which
  the tokenizer can decode."""
  cfg, params = model('bloom')
  table, limit = params['word_embeddings'], 900
  beyond = jnp.arange(table.shape[0]) >= limit
  params = dict(params, word_embeddings=jnp.where(beyond[:, None], 1e3 * table[:1], table))
  assert any(t >= limit for row in decoding.generate(cfg, params, PROMPTS, 4) for t in row)
  for temperature in (0.0, 1.0):
    ids = decoding.generate(cfg, params, PROMPTS, 4, temperature=temperature, vocab_limit=limit)
    assert all(0 <= t < limit for row in ids for t in row)


def test_requests_in_one_bucket_share_their_compilations(caplog):
  """Prompt and cache lengths are rounded up to multiples of CACHE_MULTIPLE: another request of
  the same rows whose lengths round alike compiles nothing; a longer cache compiles again."""
  cfg, params = model('gpt2')
  assert decoding.buffer_lengths(60, 12) == (64, 128)
  decoding.generate(cfg, params, [[1, 2], [3]], 5)
  with jax.log_compiles(), caplog.at_level(logging.WARNING):
    decoding.generate(cfg, params, [[4] * 30, [5] * 9], 20)  # (64, 64) as (2 + 5 - 1)
    assert 'Compiling' not in caplog.text
    decoding.generate(cfg, params, [[4] * 30, [5] * 9], 40)  # a cache of 128
    assert 'Compiling jit(step)' in caplog.text


def test_the_cache_is_split_over_data_on_its_rows_and_over_tensor_on_its_heads():
  """Keys [layers, batch, heads, head_dim, length] and values [layers, batch, heads, length,
  head_dim] under the logical axis rules, after the prefill and after a step."""
  cfg, params = model('bloom', 2, 2)
  mesh = partitioning.make_mesh(2, 1, 2)
  ctx = model_lib.Context(cfg.model, mesh)
  tokens = jnp.ones((2, 8), jnp.int32)
  prefill = jax.jit(lambda p, t: model_lib.decode(p, t, jnp.arange(8)[None] + 0 * t, 16, ctx))
  _, cache = prefill(params, tokens)
  step = jax.jit(lambda p, t, c: model_lib.decode(p, t, jnp.full((2, 1), 8), c, ctx))
  _, stepped = step(params, tokens[:, :1], cache)
  split = NamedSharding(mesh, P(None, 'data', 'tensor'))
  for k, v in (cache, stepped):
    assert k.shape == (2, 2, 8, 8, 16) and v.shape == (2, 2, 8, 16, 8)
    assert k.dtype == v.dtype == jnp.float32
    assert k.sharding.is_equivalent_to(split, 5) and v.sharding.is_equivalent_to(split, 5)


def test_bad_requests_are_refused():
  cfg, params = model('gpt2')
  with pytest.raises(ValueError, match='token ids in'):
    decoding.generate(cfg, params, [[1], []], 3)
  with pytest.raises(ValueError, match='token ids in'):
    decoding.generate(cfg, params, [[1000]], 3)
  with pytest.raises(ValueError, match='exceeds the 128 learned positions'):
    decoding.generate(cfg, params, [[1] * 100], 29)
  assert decoding.generate(cfg, params, [[1], [2]], 0) == [[], []]
