"""`python -m t5x_like.generate`: continue a prompt with a checkpoint, to see what it learnt.

  python -m t5x_like.generate --checkpoint CKPT_DIR --prompt "def fibonacci(n):"
      [--max_new_tokens 64] [--temperature 0] [--top_k 0] [--seed 0] [--dtype float32]
      [--tokenizer_model FILE.model | --tokenizer_json tokenizer.json] [--mesh.tensor T]

Megatron's tools/generate_samples_gpt.py for this trainer: a look at a checkpoint's text, not a
server. Temperature 0 (the default) is greedy decoding; above 0 it samples from
softmax(logits / temperature), restricted to the --top_k likeliest tokens if given, from
--seed. Generation stops after --max_new_tokens or at the tokenizer's end-of-document token.
It runs with a KV cache (t5x_like/inference/decoding.py): the prompt runs through the model once
and every layer keeps its keys and values at every position, in the compute dtype, split over
the T devices on the heads; each new token then runs the model on itself alone and attends to
the cache. The cache holds the prompt and all new tokens but the last, rounded up to a multiple
of 64 positions, so similar requests share their compiled programs. Greedy tokens are those of
the forward over the whole sequence, and a --seed draws what it drew before the cache.

The model is restored from any mesh onto a 1 x 1 x T mesh as `evaluate` does. The text is
encoded with the shipped tokenizer unless another is given. It must be the one the checkpoint's
data was tokenized with, and a tokenizer larger than the model's vocabulary is an error. The
continuation is printed, then one JSON line: `prompt`, `completion`, `prompt_ids`,
`completion_ids`.

What can be generated: prompt + --max_new_tokens must fit the model (a gpt2's learned
positions) and the device: at its peak a generation holds, besides the weights, the KV cache and
the largest array of the prompt's forward (its attention scores [heads / T, P, P] float32 under
attention_impl 'xla', P the prompt rounded up to a multiple of 64, or its MLP activation), in what
JAX may use of a GPU, or on CPU in the host's memory, shared by the T devices. A request beyond
either is refused before the checkpoint is restored, with the largest --max_new_tokens that
could fit (an upper bound: the weights and the smaller arrays are not counted). A generation
that takes more than a few seconds shows its progress (tqdm) on stderr.

Exit codes: 0 done, 2 bad input (one message before the model is restored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from t5x_like.cli.checkpoint_arguments import (
  add_checkpoint_arguments,
  add_tokenizer_arguments,
  tokenizer_from_arguments,
)
from t5x_like.config import Config, ConfigError, ModelConfig
from t5x_like.inference import decoding


def completion_text(tokenizer, prompt_ids: list[int], new: list[int]) -> str:
  """The text of `new` (its end-of-document left out) as it continues the prompt: decoded after
  the prompt's ids, so that its first piece keeps the space SentencePiece drops from the start
  of a text ('The cat' + ' sat', not 'The catsat'); alone where the prompt's text ends inside a
  character."""
  text_ids = new[:-1] if new and new[-1] == tokenizer.eod_id else new
  whole, prompt_text = tokenizer.decode(prompt_ids + text_ids), tokenizer.decode(prompt_ids)
  return whole[len(prompt_text) :] if whole.startswith(prompt_text) else tokenizer.decode(text_ids)


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
  from t5x_like.model import attention  # 'auto' as this process's device resolves it

  if attention.resolved(model, attention.device_if_known()) == 'xla':
    # attention_reference's scores, fp32 whatever the dtype; the bias is smaller or fused in.
    return max(
      mlp, (4 * heads * length**2, f'attention scores [{heads}, {length}, {length}] float32')
    )
  return mlp


def generation_memory(
  model: ModelConfig, prompt_tokens: int, max_new_tokens: int, tensor: int, dtype: str | None = None
) -> tuple[int, str]:
  """(bytes, what) one device of a 1 x 1 x `tensor` mesh holds at the peak of a generation,
  the weights aside: the KV cache and the largest array of the prompt's forward (the prefill;
  a step's arrays are smaller)."""
  dtype = dtype or model.dtype
  prompt_buffer, length = decoding.buffer_lengths(prompt_tokens, max_new_tokens)
  cache = decoding.kv_cache_bytes(model, 1, length, tensor, dtype)
  forward, what = largest_array(model, prompt_buffer, tensor, dtype)
  heads = -(-model.num_heads // tensor)
  return cache + forward, (
    f'a KV cache of {length} positions (keys and values of {model.num_layers} layers x {heads} '
    f"heads x {model.head_dim} {dtype}, {cache / 2**30:.4g} GiB) and the prompt's forward's "
    f'{what} ({forward / 2**30:.4g} GiB)'
  )


def device_memory(tensor: int) -> tuple[int, str]:
  """(bytes, whose) one device of a 1 x 1 x `tensor` mesh may use: what JAX may allocate on an
  accelerator; on CPU the host's memory, which the mesh's virtual devices share."""
  from t5x_like.training.device_memory import accelerator_memory

  accelerator = accelerator_memory()
  if accelerator:
    return accelerator[0], f'JAX may use of one {accelerator[1]}'
  host = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  return host // tensor, (
    "of this host's memory"
    if tensor == 1
    else f"of this host's memory per device (its share of {tensor})"
  )


def max_new_tokens_that_fit(
  model: ModelConfig, prompt_tokens: int, tensor: int, budget: int, dtype: str | None = None
) -> int:
  """The most new tokens after a prompt whose generation_memory fits in `budget` bytes (0:
  not even one)."""
  fits = lambda new: generation_memory(model, prompt_tokens, new, tensor, dtype)[0] <= budget
  low, high = 0, 1
  while fits(high):
    low, high = high, 2 * high
  while high - low > 1:  # generation_memory grows with the new tokens: bisect.
    middle = (low + high) // 2
    low, high = (middle, high) if fits(middle) else (low, middle)
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
  prompt, a prompt + new tokens longer than a gpt2's learned positions or whose generation does
  not fit a device (`memory`: (bytes, whose), default `device_memory(tensor)`), a top_k above
  the vocabulary. Before the restore: cheap."""
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
  needed, what = generation_memory(saved.model, len(prompt_ids), max_new_tokens, tensor, dtype)
  if needed > budget:
    most = max_new_tokens_that_fit(saved.model, len(prompt_ids), tensor, budget, dtype)
    fix = (
      f'at most --max_new_tokens {most} fits after this prompt'
      if most >= 1
      else 'the prompt alone does not fit: shorten it'
    )
    raise ConfigError(
      f'prompt ({len(prompt_ids)} tokens) + --max_new_tokens ({max_new_tokens}) needs at '
      f'least {needed / 2**30:.4g} GiB on a device, {what}: more than the '
      f'{budget / 2**30:.4g} GiB {whose}; {fix}'
    )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.generate',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_checkpoint_arguments(parser)
  parser.add_argument('--prompt', required=True)
  parser.add_argument('--max_new_tokens', type=int, default=64)
  parser.add_argument('--temperature', type=float, default=0.0, help='0: greedy')
  parser.add_argument('--top_k', type=int, default=0, help='sample among the k likeliest (0: all)')
  parser.add_argument('--seed', type=int, default=0)
  add_tokenizer_arguments(parser)
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
    tokenizer = tokenizer_from_arguments(args)
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
  [new] = decoding.generate(
    cfg,
    params,
    [prompt_ids],
    args.max_new_tokens,
    temperature=args.temperature,
    top_k=args.top_k,
    seed=args.seed,
    eod_id=tokenizer.eod_id,
    progress=True,
    vocab_limit=tokenizer.vocab_size,
  )
  completion = completion_text(tokenizer, prompt_ids, new)
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
