"""Generation with a KV cache: `generate` continues a batch of prompts, greedy or sampled.

A prefill runs the prompts through the model once (causal attention with model.attention_impl,
as in training) and keeps every layer's keys and values in a cache of the compute dtype, keys
[layers, batch, heads, head_dim, length] and values [layers, batch, heads, length, head_dim]
(transformer.KEY_CACHE_NAMES and VALUE_CACHE_NAMES: split over `tensor` on the heads and over
`data` on the rows by the logical axis rules). Then one jitted step per new token runs the model
on that token alone: its query at position p attends to the cache's keys 0..p-1 and its own
(ALiBi: slope * (key - query); GPT-2: the learned position p), and its key and value are written
at p.

Prompts of different lengths share the batch right-padded: each row has its own position, the
prefill reads each row's logits at its last prompt token, and a row's next token overwrites the
padding at its position before any query of that row can see it (a query sees keys up to its own
position only). Compiled programs are shared between requests of the same (batch, cache length,
prompt length) bucket: both lengths are rounded up to a multiple of CACHE_MULTIPLE.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable

import numpy as np

from t5x_like.config import Config, ModelConfig

# Cache and prompt buffers are rounded up to a multiple of this many positions, so that requests
# of similar lengths share one compilation.
CACHE_MULTIPLE = 64
# A progress bar on stderr for generations that take longer than this (seconds); shorter ones
# print nothing.
PROGRESS_DELAY_S = 2.0


def buffer_lengths(longest_prompt: int, max_new_tokens: int) -> tuple[int, int]:
  """(prompt buffer, cache) lengths of a generation: the prefill's input and the KV cache's
  positions, multiples of CACHE_MULTIPLE (the prompt buffer at most the cache's). The cache holds
  the longest prompt and every new token but the last, which is never fed back."""
  rounded = lambda n: -(-max(n, 1) // CACHE_MULTIPLE) * CACHE_MULTIPLE
  cache = rounded(longest_prompt + max_new_tokens - 1)
  return min(rounded(longest_prompt), cache), cache


def kv_cache_bytes(
  model: ModelConfig, batch: int, length: int, tensor: int = 1, dtype: str | None = None
) -> int:
  """Bytes of one device's share of the KV cache (keys and values) of `batch` rows of `length`
  positions, heads split over `tensor`, in `dtype` (default the model's compute dtype)."""
  itemsize = 2 if (dtype or model.dtype) == 'bfloat16' else 4
  heads = -(-model.num_heads // tensor)
  return 2 * model.num_layers * batch * length * heads * model.head_dim * itemsize


def generate(
  cfg: Config,
  params,
  prompts: list[list[int]],
  max_new_tokens: int,
  *,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  eod_id: int | None = None,
  stop: Callable[[int, list[int]], bool] | None = None,
  progress: bool = False,
  vocab_limit: int | None = None,
) -> list[list[int]]:
  """New token ids per prompt (without the prompt), at most max_new_tokens each; a row ends
  after eod_id (included) or once stop(row_index, its_new_ids) returns True (stop is called
  after each new token of a row still running). cfg, params: from
  inference.loading.load_for_inference (params in the compute shardings of a data x 1 x tensor
  mesh).

  temperature 0 is greedy decoding; above 0 each token is drawn from softmax(logits /
  temperature), among the top_k likeliest if top_k > 0. The padded vocabulary rows are never
  drawn. Draws follow `seed`: the t-th new token of every row uses the t-th key of
  jax.random.split's chain from PRNGKey(seed), and row r the r-th row of that key's Gumbel noise;
  so a row's tokens depend on the seed, its row index and its own prompt, not on the other rows,
  and a single prompt draws what the generation without a cache drew. A row's eod_id ends it
  without a call to stop. Each prompt is at least one token of [0, vocab_size); for gpt2,
  prompt + max_new_tokens <= max_position_embeddings (else ValueError). `progress`: a bar on
  stderr once the generation has taken PROGRESS_DELAY_S. `vocab_limit`: no id at or above it is
  drawn (the tokenizer's size, where it is smaller than the model's vocabulary, as BLOOM's
  250,680 tokens in its 250,880 rows: the rows past it decode to nothing).

  All rows run until the last one ends, in one jitted step per token on a cache of
  buffer_lengths(longest prompt, max_new_tokens)[1] positions; the rows are padded to a multiple
  of mesh.data.
  """
  import jax
  from tqdm import tqdm

  from t5x_like.mesh import partitioning

  model = cfg.model
  if not 0 <= temperature < float('inf') or not 0 <= top_k <= model.vocab_size:
    raise ValueError(
      f'temperature must be finite and >= 0 and top_k in [0, {model.vocab_size}]; '
      f'got {temperature} and {top_k}'
    )
  for i, prompt in enumerate(prompts):
    if not prompt or not all(0 <= t < model.vocab_size for t in prompt):
      raise ValueError(f'prompt {i} must be one or more token ids in [0, {model.vocab_size})')
    if model.architecture == 'gpt2' and len(prompt) + max_new_tokens > (
      model.max_position_embeddings
    ):
      raise ValueError(
        f'prompt {i} ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the '
        f'{model.max_position_embeddings} learned positions of this gpt2 model'
      )
  if not prompts or max_new_tokens < 1:
    return [[] for _ in prompts]

  data = cfg.mesh.data
  rows = -(-len(prompts) // data) * data  # every data shard gets as many rows
  prompt_length, cache_length = buffer_lengths(max(map(len, prompts)), max_new_tokens)
  tokens = np.zeros((rows, prompt_length), np.int32)
  lengths = np.ones(rows, np.int32)  # the padding rows: one token 0
  for row, prompt in enumerate(prompts):
    tokens[row, : len(prompt)] = prompt
    lengths[row] = len(prompt)
  mesh = partitioning.make_mesh(data, 1, cfg.mesh.tensor)
  drawn = model.vocab_size if vocab_limit is None else min(vocab_limit, model.vocab_size)
  prefill, step = _programs(model, mesh, float(temperature), top_k, drawn)

  token, positions, cache, key = prefill(
    params, tokens, lengths, jax.random.PRNGKey(seed), cache_length
  )
  new: list[list[int]] = [[] for _ in prompts]
  running = list(range(len(prompts)))
  with tqdm(
    total=max_new_tokens,
    desc='generating',
    unit='token',
    file=sys.stderr,
    delay=PROGRESS_DELAY_S,
    mininterval=1.0,
    leave=False,
    disable=not progress,
  ) as bar:
    for written in range(1, max_new_tokens + 1):
      if written < max_new_tokens:
        # Dispatched before this token is read back: the device computes the next one while
        # the host checks this one. The rows that ended compute on, unread.
        following, positions, cache, key = step(params, cache, token, positions, key)
      ids = jax.device_get(token)
      for row in running:
        new[row].append(int(ids[row]))
      running = [
        row
        for row in running
        if new[row][-1] != eod_id and not (stop is not None and stop(row, new[row]))
      ]
      bar.update()
      if not running or written == max_new_tokens:
        break
      token = following
  return new


@functools.lru_cache(maxsize=8)
def _programs(model: ModelConfig, mesh, temperature: float, top_k: int, drawn: int):
  """The jitted (prefill, step) of a model on a mesh with one way of picking tokens. jax.jit
  compiles each for the shapes it is called with: one program per (rows, cache length, prompt
  length) bucket."""
  import jax
  import jax.numpy as jnp

  from t5x_like.model import transformer as model_lib

  # A decoding step is one token per row: nothing to split along the sequence.
  ctx = model_lib.Context(dataclasses.replace(model, sequence_parallel=False), mesh)

  def pick(params, hidden, key):
    """The next token of each row from its final hidden state [rows, h]: (tokens [rows], key)."""
    key, step_key = jax.random.split(key)
    # Rows from `drawn` on (the padding, ids the tokenizer lacks) at the lowest float.
    logits = model_lib.tied_logits(hidden[:, None], params['word_embeddings'], drawn, ctx)
    logits = logits[:, 0]  # [rows, V] fp32
    if temperature == 0:
      return jnp.argmax(logits, -1).astype(jnp.int32), key
    logits = logits / temperature
    if top_k:
      kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(step_key, logits).astype(jnp.int32), key

  @functools.partial(jax.jit, static_argnums=4)
  def prefill(params, tokens, lengths, key, cache_length: int):
    """The prompts [rows, P] (right-padded; `lengths` [rows]) into a new cache: (each row's first
    new token, its position, the cache, the key)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    hidden, cache = model_lib.decode(params, tokens, positions, cache_length, ctx)
    last = hidden[jnp.arange(tokens.shape[0]), lengths - 1]
    token, key = pick(params, last, key)
    return token, lengths, cache, key

  @functools.partial(jax.jit, donate_argnums=1)
  def step(params, cache, tokens, positions, key):
    """Each row's token [rows] at its position [rows] through the model: (the next tokens,
    their positions, the cache, the key). The cache is updated in place (donated)."""
    hidden, cache = model_lib.decode(params, tokens[:, None], positions[:, None], cache, ctx)
    token, key = pick(params, hidden[:, 0], key)
    return token, positions + 1, cache, key

  return prefill, step
