"""Generation throughput on CPU: the KV cache (t5x_like/inference/decoding.py) against no cache.

    PYTHONPATH=. python benchmarks/generate_throughput.py [--models tiny,bloom_100m]
        [--cases 32x64,128x256] [--batch 1] [--rounds 3] [--no_cache_tokens N] [--json OUT]

For each model (configs/tiny.py's shapes, and BLOOM at GPT-2-small's: 12 layers, hidden 768,
12 heads, vocab 8192, about 92M parameters; random weights, fp32, one CPU device) and each case
PxN (a prompt of P tokens, N new tokens, greedy, no end-of-document token so every row writes N):

* KV cache: `decoding.generate` on `--batch` prompts of P tokens, timed whole (prefill, steps,
  reading each token back), the best of --rounds after a compiling run; tokens/s counts the new
  tokens of every row. The prefill is timed as a request of one new token (best of --rounds),
  and a step as the rest of the time over the N - 1 steps.
* No cache: what `generate` did before the cache, written out below: each new token runs the
  model over a fixed P + N buffer (one compilation) and takes the logits at the last written
  position. Every token costs the same forward, so it is timed over the first --no_cache_tokens
  tokens (default all N) of one prompt, after a compiling call.

The greedy tokens of both paths are compared for the tokens both wrote (the script fails if
they differ). Prints a markdown table (and with --json the numbers).

`--layouts 384,2048` times instead what chose the cache's layout: a step's attention core alone
(scores, softmax, values; one query on each of bloom_100m's 12 layers x 12 heads x 64, fp32,
the cache of each layer sliced out of the stacked one by the layer scan, as in a step) for the
cache in three layouts, at each cache length: keys and values [length, heads, head_dim]; both
[heads, length, head_dim]; keys [heads, head_dim, length] and values [heads, length, head_dim]
(what transformer.decode keeps). Best of 20 after a compiling call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# configs/tiny.py plus these overrides.
MODELS = {
  'tiny': {},
  'bloom_100m': {'model.num_layers': 12, 'model.hidden_size': 768, 'model.num_heads': 12},
}


def build(model: str):
  """(inference config, params in its compute shardings) of a random model on one device."""
  from t5x_like.config import load_config_file
  from t5x_like.inference.loading import inference_config
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout

  overrides = {'mesh.data': 1, 'mesh.pipeline': 1, 'mesh.tensor': 1, **MODELS[model]}
  saved = load_config_file(os.path.join(REPO, 'configs', 'tiny.py'), overrides).validate()
  cfg = inference_config(saved, with_data=False)
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  return cfg, layout.compute_params(layout.init(0).params)


def no_cache_generator(cfg):
  """The generation without a cache: next_token(params, buffer [length], position) -> the greedy
  token at `position` from the forward over the whole buffer."""
  import jax
  import jax.numpy as jnp

  from t5x_like.mesh import partitioning
  from t5x_like.model import transformer as model_lib

  mesh = partitioning.make_mesh(1, 1, 1)
  model = model_lib.Transformer(cfg.model, cfg.padded_vocab_size, mesh)

  @jax.jit
  def next_token(params, buffer, position):
    # Only the logits at position - 1, as generate did.
    hidden = model.apply({'params': params}, buffer[None], return_hidden=True)[0, position - 1]
    embedding = params['word_embeddings'].astype(hidden.dtype)
    logits = jnp.einsum('e,ve->v', hidden, embedding, preferred_element_type=jnp.float32)
    logits = jnp.where(jnp.arange(logits.shape[0]) < cfg.model.vocab_size, logits, -jnp.inf)
    return jnp.argmax(logits).astype(jnp.int32)

  return next_token


def run_no_cache(next_token, params, prompt: list[int], length: int, tokens: int) -> list[int]:
  import jax.numpy as jnp
  import numpy as np

  buffer = np.zeros(length, np.int32)
  buffer[: len(prompt)] = prompt
  for position in range(len(prompt), len(prompt) + tokens):
    buffer[position] = int(next_token(params, jnp.asarray(buffer), position))
  return buffer[len(prompt) : len(prompt) + tokens].tolist()


def measure(model: str, prompt_len: int, new: int, batch: int, rounds: int, no_cache_tokens: int):
  import numpy as np

  from t5x_like.inference import decoding

  cfg, params = build(model)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, cfg.model.vocab_size, prompt_len).tolist() for _ in range(batch)]

  # KV cache: a compiling run, then the best of `rounds`; the prefill alone (1 new token).
  start = time.perf_counter()
  cached = decoding.generate(cfg, params, prompts, new)
  first_s = time.perf_counter() - start
  best = min(_seconds(lambda: decoding.generate(cfg, params, prompts, new)) for _ in range(rounds))
  # The prefill: a request of one new token (its cache is shorter, the work the same but for
  # the zeros after the prompts). The steps share the rest.
  generate_one = lambda: decoding.generate(cfg, params, prompts, 1)
  generate_one()
  prefill = min(_seconds(generate_one) for _ in range(rounds))
  step_s = (best - prefill) / max(new - 1, 1)

  # No cache: one prompt, `no_cache_tokens` tokens after a compiling call.
  length = prompt_len + new
  measured = min(no_cache_tokens or new, new)
  next_token = no_cache_generator(cfg)
  run_no_cache(next_token, params, prompts[0], length, 1)
  start = time.perf_counter()
  reference = run_no_cache(next_token, params, prompts[0], length, measured)
  no_cache_s = time.perf_counter() - start
  if reference != cached[0][:measured]:
    raise SystemExit(f'{model} {prompt_len}x{new}: the cached greedy tokens differ: {cached[0]}')
  return {
    'model': model,
    'params_m': round(cfg.model.num_params() / 1e6, 1),
    'prompt': prompt_len,
    'new': new,
    'batch': batch,
    'cache_tokens_per_s': batch * new / best,
    'cache_total_s': best,
    'cache_first_s': first_s,
    'prefill_ms': 1e3 * prefill,
    'step_ms': 1e3 * step_s,
    'no_cache_tokens_per_s': measured / no_cache_s,
    'no_cache_timed_tokens': measured,
    'speedup': (batch * new / best) / (measured / no_cache_s),
  }


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


# (keys' per-layer shape, values', the scores einsum, the values einsum) with batch 1, 12 heads
# of 64 and L positions; q is [batch, 1, heads, head_dim].
LAYOUTS = {
  'keys, values [length, heads, head_dim]': (
    ('L', 12, 64),
    ('L', 12, 64),
    'bqnd,bknd->bnqk',
    'bnqk,bknd->bnqd',
  ),
  'keys, values [heads, length, head_dim]': (
    (12, 'L', 64),
    (12, 'L', 64),
    'bqnd,bnkd->bnqk',
    'bnqk,bnkd->bnqd',
  ),
  'keys [heads, head_dim, length], values [heads, length, head_dim]': (
    (12, 64, 'L'),
    (12, 'L', 64),
    'bqnd,bndk->bnqk',
    'bnqk,bnkd->bnqd',
  ),
}


def layout_ms(layout: str, length: int, layers: int = 12, repeats: int = 20) -> float:
  """Milliseconds of one step's attention core over `layers` layers' caches in `layout`."""
  import jax
  import jax.numpy as jnp

  keys, values, scores_spec, out_spec = LAYOUTS[layout]
  shape = lambda dims: (layers, 1) + tuple(length if d == 'L' else d for d in dims)
  k = jax.random.normal(jax.random.PRNGKey(0), shape(keys))
  v = jax.random.normal(jax.random.PRNGKey(1), shape(values))
  q = jax.random.normal(jax.random.PRNGKey(2), (1, 1, 12, 64))

  def layer(x, kv):
    scores = jnp.einsum(scores_spec, x, kv[0], preferred_element_type=jnp.float32) / 8.0
    weights = jnp.exp(scores - scores.max(-1, keepdims=True))
    out = jnp.einsum(out_spec, weights, kv[1], preferred_element_type=jnp.float32)
    return x + out.swapaxes(1, 2) / weights.sum(-1)[..., None].swapaxes(1, 2), None

  attend = jax.jit(lambda q, k, v: jax.lax.scan(layer, q, (k, v))[0])
  jax.block_until_ready(attend(q, k, v))
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(attend(q, k, v))
    best = min(best, time.perf_counter() - start)
  return 1e3 * best


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--models', default='tiny,bloom_100m')
  parser.add_argument('--cases', default='32x64,128x256', help='PROMPTxNEW, comma-separated')
  parser.add_argument('--batch', type=int, default=1)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--no_cache_tokens', type=int, default=0, help='0: all new tokens')
  parser.add_argument('--json', default=None)
  parser.add_argument('--layouts', default='', help='cache lengths: time the cache layouts')
  args = parser.parse_args(argv)
  import jax

  if args.layouts:
    lengths = [int(n) for n in args.layouts.split(',')]
    print(f'jax {jax.__version__}, {os.cpu_count()} CPUs\n')
    print('| cache layout (per layer) | ' + ' | '.join(f'{n} positions' for n in lengths) + ' |')
    print('|---|' + '---:|' * len(lengths))
    for layout in LAYOUTS:
      times = ' | '.join(f'{layout_ms(layout, n):.2f} ms' for n in lengths)
      print(f'| {layout} | {times} |')
    return 0

  rows = []
  for model in args.models.split(','):
    for case in args.cases.split(','):
      prompt_len, new = (int(n) for n in case.split('x'))
      rows.append(measure(model, prompt_len, new, args.batch, args.rounds, args.no_cache_tokens))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  print(
    f'jax {jax.__version__}, {platform.processor() or platform.machine()}, '
    f'{os.cpu_count()} CPUs, batch {args.batch}\n'
  )
  print(
    '| model | params | prompt + new | no cache tok/s | KV cache tok/s | speed-up | '
    'prefill ms | step ms |'
  )
  print('|---|---:|---|---:|---:|---:|---:|---:|')
  for r in rows:
    print(
      f'| {r["model"]} | {r["params_m"]}M | {r["prompt"]} + {r["new"]} | '
      f'{r["no_cache_tokens_per_s"]:.1f} | {r["cache_tokens_per_s"]:.1f} | '
      f'{r["speedup"]:.1f}x | {r["prefill_ms"]:.1f} | {r["step_ms"]:.2f} |'
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == '__main__':
  sys.exit(main())
