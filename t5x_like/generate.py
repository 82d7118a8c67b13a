"""`python -m t5x_like.generate`: continue a prompt with a checkpoint, to see what it learnt.

  python -m t5x_like.generate --checkpoint CKPT_DIR --prompt "def fibonacci(n):"
      [--max_new_tokens 64] [--temperature 0] [--top_k 0] [--seed 0] [--dtype float32]
      [--tokenizer_model FILE.model | --tokenizer_json tokenizer.json] [--mesh.tensor T]

Megatron's tools/generate_samples_gpt.py for this trainer: a look at a checkpoint's text, not a
server. Temperature 0 (the default) is greedy decoding; above 0 it samples from
softmax(logits / temperature), restricted to the --top_k likeliest tokens if given, from
--seed. Generation stops after --max_new_tokens or at the tokenizer's end-of-document token.
There is no KV cache: each new token runs the model over a fixed buffer of prompt + new tokens
(one compilation), which is causal, so the tokens not yet written do not change the ones before.

The model is restored from any mesh onto a 1 x 1 x T mesh as `evaluate` does. The text is
encoded with the shipped tokenizer unless another is given. It must be the one the checkpoint's
data was tokenized with, and a tokenizer larger than the model's vocabulary is an error. The
continuation is printed, then one JSON line: `prompt`, `completion`, `prompt_ids`,
`completion_ids`.

Exit codes: 0 done, 2 bad input (one message before the model is restored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from t5x_like.config import Config, ConfigError


def generate_ids(cfg: Config, params, prompt_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.0, top_k: int = 0, seed: int = 0,
                 eod_id: int | None = None) -> list[int]:
  """The new token ids after `prompt_ids` (without them), at most max_new_tokens, ending at
  eod_id (included) if the model writes it. cfg, params: from `inference.load_for_inference`."""
  import jax
  import jax.numpy as jnp
  from t5x_like import model as model_lib
  from t5x_like import partitioning
  mesh = partitioning.make_mesh(cfg.mesh.data, 1, cfg.mesh.tensor)
  model = model_lib.Transformer(cfg.model, cfg.padded_vocab_size, mesh)
  length = len(prompt_ids) + max_new_tokens

  @jax.jit
  def next_token(params, buffer, position, key):
    """The token at `position`, from the logits at position - 1 (only those: at BLOOM's
    vocabulary, logits of the whole buffer would be 2 GB per 2048 tokens)."""
    hidden = model.apply({'params': params}, buffer[None], return_hidden=True)[0, position - 1]
    embedding = params['word_embeddings'].astype(hidden.dtype)
    logits = jnp.einsum('e,ve->v', hidden, embedding, preferred_element_type=jnp.float32)
    # The padded vocabulary rows are never predicted, as in training.
    logits = jnp.where(jnp.arange(logits.shape[0]) < cfg.model.vocab_size, logits, -jnp.inf)
    if temperature == 0:
      return jnp.argmax(logits).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
      kth = jax.lax.top_k(logits, top_k)[0][-1]
      logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)

  buffer = np.zeros(length, np.int32)
  buffer[:len(prompt_ids)] = prompt_ids
  key = jax.random.PRNGKey(seed)
  new = []
  for position in range(len(prompt_ids), length):
    key, step_key = jax.random.split(key)
    token = int(next_token(params, jnp.asarray(buffer), position, step_key))
    buffer[position] = token
    new.append(token)
    if token == eod_id:
      break
  return new


def load_tokenizer(args: argparse.Namespace):
  from t5x_like.data.hf_tokenizer import HFTokenizer
  from t5x_like.data.indexed import DataError
  from t5x_like.data.tokenizer import DEFAULT_MODEL_PATH, Tokenizer
  try:
    if args.tokenizer_json:
      return HFTokenizer(args.tokenizer_json)
    path = args.tokenizer_model or DEFAULT_MODEL_PATH
    if not os.path.isfile(path):
      raise DataError(f'--tokenizer_model {path!r} not found')
    return Tokenizer.from_file(path)
  except DataError as e:
    raise ConfigError(str(e)) from None


def check_request(saved: Config, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> None:
  if tokenizer.vocab_size > saved.model.vocab_size:
    raise ConfigError(f'the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint\'s '
                      f'model has {saved.model.vocab_size}: pass the tokenizer its data was '
                      'tokenized with (--tokenizer_model or --tokenizer_json)')
  if not prompt_ids:
    raise ConfigError('--prompt encodes to no tokens; give some text')
  length = len(prompt_ids) + max_new_tokens
  if saved.model.architecture == 'gpt2' and length > saved.model.max_position_embeddings:
    raise ConfigError(f'prompt ({len(prompt_ids)} tokens) + --max_new_tokens ({max_new_tokens}) '
                      f'exceeds the {saved.model.max_position_embeddings} learned positions of '
                      'this gpt2 model; shorten one of them')


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m t5x_like.generate', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help="a run's WORKDIR/checkpoints (latest step) or one step directory")
  parser.add_argument('--prompt', required=True)
  parser.add_argument('--max_new_tokens', type=int, default=64)
  parser.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  parser.add_argument('--top_k', type=int, default=0, help='sample among the k likeliest (0: all)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'])
  parser.add_argument('--step', type=int, default=None)
  which = parser.add_mutually_exclusive_group()
  which.add_argument('--tokenizer_model', help='a SentencePiece .model (default: the shipped one)')
  which.add_argument('--tokenizer_json', help="a Hugging Face tokenizer.json (BLOOM's)")
  parser.add_argument('--mesh.tensor', dest='mesh_tensor', type=int, default=1)
  args = parser.parse_args(argv)
  from t5x_like import partitioning
  from t5x_like.checkpoints import CheckpointError, read_config
  from t5x_like.inference import load_for_inference
  try:
    # `not 0 <= x < inf` also refuses NaN, which every comparison calls False.
    if (args.max_new_tokens < 1 or not 0 <= args.temperature < float('inf') or args.top_k < 0
        or args.mesh_tensor < 1):
      raise ConfigError(f'--max_new_tokens and --mesh.tensor must be >= 1, --temperature a '
                        f'finite number >= 0 and --top_k >= 0; got {args.max_new_tokens}, '
                        f'{args.mesh_tensor}, {args.temperature} and {args.top_k}')
    partitioning.ensure_devices(args.mesh_tensor)  # before anything starts JAX
    saved = read_config(args.checkpoint, args.step)
    tokenizer = load_tokenizer(args)
    prompt_ids = list(tokenizer.encode(args.prompt))
    check_request(saved, tokenizer, prompt_ids, args.max_new_tokens)
    cfg, params = load_for_inference(args.checkpoint, args.dtype, args.step, 1, args.mesh_tensor,
                                     with_data=False)
  except (ConfigError, CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  new = generate_ids(cfg, params, prompt_ids, args.max_new_tokens, args.temperature, args.top_k,
                     args.seed, tokenizer.eod_id)
  text_ids = new[:-1] if new and new[-1] == tokenizer.eod_id else new
  completion = tokenizer.decode(text_ids)
  print(args.prompt + completion)
  print(json.dumps({'prompt': args.prompt, 'completion': completion, 'prompt_ids': prompt_ids,
                    'completion_ids': new}))
  return 0


if __name__ == '__main__':
  sys.exit(main())
