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

What can be generated: the prompt + --max_new_tokens buffer must fit the model (a gpt2's learned
positions) and the device: each forward over it holds the attention scores of every head on the
device, [heads / T, length, length] float32 (the largest array under attention_impl 'xla'), in
what JAX may use of a GPU, or on CPU in the host's memory, shared by the T devices. A request
beyond either is refused before the checkpoint is restored, with the limit (an upper bound: the
scores are not all a forward holds). As each token costs a forward over the whole buffer, a
generation that takes more than a few seconds shows its progress (tqdm) on stderr.

Exit codes: 0 done, 2 bad input (one message before the model is restored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from t5x_like.config import Config, ConfigError, ModelConfig

# A progress bar on stderr for generations that take longer than this (seconds); shorter ones
# print nothing but their result.
PROGRESS_DELAY_S = 2.0


def generate_ids(
  cfg: Config,
  params,
  prompt_ids: list[int],
  max_new_tokens: int,
  temperature: float = 0.0,
  top_k: int = 0,
  seed: int = 0,
  eod_id: int | None = None,
  progress: bool = False,
) -> list[int]:
  """The new token ids after `prompt_ids` (without them), at most max_new_tokens, ending at
  eod_id (included) if the model writes it. cfg, params: from `inference.load_for_inference`.
  `progress`: a bar on stderr once the generation has taken PROGRESS_DELAY_S."""
  import jax
  import jax.numpy as jnp
  from tqdm import tqdm

  from t5x_like.mesh import partitioning
  from t5x_like.model import transformer as model_lib

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
  buffer[: len(prompt_ids)] = prompt_ids
  key = jax.random.PRNGKey(seed)
  new = []
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
    for position in range(len(prompt_ids), length):
      key, step_key = jax.random.split(key)
      token = int(next_token(params, jnp.asarray(buffer), position, step_key))
      buffer[position] = token
      new.append(token)
      bar.update()
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


def largest_array(
  model: ModelConfig, length: int, tensor: int, dtype: str | None = None
) -> tuple[int, str]:
  """(bytes, shape and dtype) of the largest array one device holds in a forward of `model` over
  `length` tokens on a 1 x 1 x `tensor` mesh (dtype: the compute dtype, default the model's):
  the attention scores of its heads, or without them (a fused attention_impl) the MLP's
  activation."""
  dtype = dtype or model.dtype
  heads, ffn = -(-model.num_heads // tensor), -(-model.ffn_size // tensor)
  mlp = (
    length * ffn * (2 if dtype == 'bfloat16' else 4),
    f'the MLP activation [{length}, {ffn}] {dtype}',
  )
  if model.attention_impl == 'xla':
    # attention_reference's scores, fp32 whatever the dtype; the bias is smaller or fused in.
    return max(
      mlp, (4 * heads * length**2, f'attention scores [{heads}, {length}, {length}] float32')
    )
  return mlp


def device_memory(tensor: int) -> tuple[int, str]:
  """(bytes, whose) one device of a 1 x 1 x `tensor` mesh may use: what JAX may allocate on an
  accelerator; on CPU the host's memory, which the mesh's virtual devices share."""
  import jax

  stats = jax.devices()[0].memory_stats() or {}
  if stats.get('bytes_limit'):
    return stats['bytes_limit'], f'JAX may use of one {jax.devices()[0].device_kind}'
  host = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return host // tensor, (
    "of this host's memory"
    if tensor == 1
    else f"of this host's memory per device (its share of {tensor})"
  )


def max_length(model: ModelConfig, tensor: int, budget: int, dtype: str | None = None) -> int:
  """The longest buffer whose largest_array fits in `budget` bytes (0: none does)."""
  low, high = 0, 1
  while largest_array(model, high, tensor, dtype)[0] <= budget:
    low, high = high, 2 * high
  while high - low > 1:  # largest_array grows with the length: bisect.
    middle = (low + high) // 2
    low, high = (
      (middle, high) if largest_array(model, middle, tensor, dtype)[0] <= budget else (low, middle)
    )
  return low


def check_request(
  saved: Config,
  tokenizer,
  prompt_ids: list[int],
  max_new_tokens: int,
  tensor: int = 1,
  dtype: str | None = None,
  memory: tuple[int, str] | None = None,
  top_k: int = 0,
) -> None:
  """One ConfigError for a request that cannot run: a tokenizer larger than the model, an empty
  prompt, a buffer longer than a gpt2's learned positions or whose forward does not fit a device
  (`memory`: (bytes, whose), default `device_memory(tensor)`), a top_k above the vocabulary.
  Before the restore: cheap."""
  if tokenizer.vocab_size > saved.model.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's "
      f'model has {saved.model.vocab_size}: pass the tokenizer its data was '
      'tokenized with (--tokenizer_model or --tokenizer_json)'
    )
  if top_k > saved.model.vocab_size:
    raise ConfigError(
      f'--top_k {top_k} is more than the {saved.model.vocab_size} tokens of the '
      f'model; use at most {saved.model.vocab_size}, or 0 for all of them'
    )
  if not prompt_ids:
    raise ConfigError('--prompt encodes to no tokens; give some text')
  length = len(prompt_ids) + max_new_tokens
  if saved.model.architecture == 'gpt2' and length > saved.model.max_position_embeddings:
    raise ConfigError(
      f'prompt ({len(prompt_ids)} tokens) + --max_new_tokens ({max_new_tokens}) '
      f'exceeds the {saved.model.max_position_embeddings} learned positions of '
      'this gpt2 model; shorten one of them'
    )
  budget, whose = memory or device_memory(tensor)
  needed, what = largest_array(saved.model, length, tensor, dtype)
  if needed > budget:
    most = max_length(saved.model, tensor, budget, dtype) - len(prompt_ids)
    fix = (
      f'at most --max_new_tokens {most} fits after this prompt'
      if most >= 1
      else 'the prompt alone does not fit: shorten it'
    )
    raise ConfigError(
      f'prompt ({len(prompt_ids)} tokens) + --max_new_tokens ({max_new_tokens}) '
      f'is a {length}-token buffer, and each new token runs the model over all '
      f'of it (no KV cache): a forward over it holds {what}, '
      f'{needed / 2**30:.4g} GiB, more than the {budget / 2**30:.4g} GiB {whose}; '
      f'{fix}'
    )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.generate',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--checkpoint',
    required=True,
    help="a run's WORKDIR/checkpoints (latest step) or one step directory",
  )
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
  from t5x_like.checkpointing.checkpoints import CheckpointError, read_config
  from t5x_like.inference.loading import load_for_inference
  from t5x_like.mesh import partitioning

  try:
    # `not 0 <= x < inf` also refuses NaN, which every comparison calls False.
    if (
      args.max_new_tokens < 1
      or not 0 <= args.temperature < float('inf')
      or args.top_k < 0
      or args.mesh_tensor < 1
    ):
      raise ConfigError(
        f'--max_new_tokens and --mesh.tensor must be >= 1, --temperature a '
        f'finite number >= 0 and --top_k >= 0; got {args.max_new_tokens}, '
        f'{args.mesh_tensor}, {args.temperature} and {args.top_k}'
      )
    partitioning.ensure_devices(args.mesh_tensor)  # before anything starts JAX
    saved = read_config(args.checkpoint, args.step)
    tokenizer = load_tokenizer(args)
    prompt_ids = list(tokenizer.encode(args.prompt))
    check_request(
      saved,
      tokenizer,
      prompt_ids,
      args.max_new_tokens,
      args.mesh_tensor,
      args.dtype,
      top_k=args.top_k,
    )
    cfg, params = load_for_inference(
      args.checkpoint, args.dtype, args.step, 1, args.mesh_tensor, with_data=False
    )
  except (ConfigError, CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  new = generate_ids(
    cfg,
    params,
    prompt_ids,
    args.max_new_tokens,
    args.temperature,
    args.top_k,
    args.seed,
    tokenizer.eod_id,
    progress=True,
  )
  text_ids = new[:-1] if new and new[-1] == tokenizer.eod_id else new
  completion = tokenizer.decode(text_ids)
  print(args.prompt + completion)
  print(
    json.dumps(
      {
        'prompt': args.prompt,
        'completion': completion,
        'prompt_ids': prompt_ids,
        'completion_ids': new,
      }
    )
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
