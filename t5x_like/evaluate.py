"""`python -m t5x_like.evaluate`: next-token loss of a checkpoint on a token array.

  python -m t5x_like.evaluate --checkpoint CKPT_DIR --data TOKENS.npy [--dtype float32]

TOKENS.npy is an integer array [N, L]; the loss is the mean next-token cross-entropy over all
N x (L-1) predictions. The last line printed is a JSON object with `loss`, `ppl` and `tokens`.

The loss is the chunked, vocabulary-parallel cross-entropy by default (`--cross_entropy chunked`):
it never holds [batch, L, vocabulary] fp32 logits, which for BLOOM's 250,880-token vocabulary is
2 GB per 2048-token sequence. `--cross_entropy dense` computes the full logits instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

import numpy as np

from t5x_like.config import Config, ConfigError


def load_tokens(path: str, vocab_size: int) -> np.ndarray:
  """The token array, checked before any model work."""
  try:
    tokens = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise ConfigError(f'--data {path} does not exist; pass a .npy file of token ids [N, L]') from None
  except ValueError as e:
    raise ConfigError(f'--data {path} is not a plain .npy array ({e})') from None
  if tokens.ndim != 2 or tokens.shape[1] < 2 or tokens.shape[0] < 1:
    raise ConfigError(f'--data must be an integer array [N, L] with L >= 2, got shape '
                      f'{tokens.shape}')
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ConfigError(f'--data must hold integer token ids, got dtype {tokens.dtype}')
  if tokens.min() < 0 or tokens.max() >= vocab_size:
    raise ConfigError(f'--data holds token ids in [{tokens.min()}, {tokens.max()}] but the model '
                      f'has {vocab_size} tokens')
  return tokens.astype(np.int32)


def evaluate(cfg: Config, params, tokens: np.ndarray, batch_size: int = 8,
             cross_entropy: str = 'chunked') -> dict:
  """Mean next-token loss over every prediction; one compile (the last batch is padded).

  cross_entropy: 'chunked' (never the full fp32 logits; `model.cross_entropy_chunk` vocabulary
  rows at a time) or 'dense' (full logits), the same numbers to fp32 rounding.
  """
  batch_loss_sum = batch_loss_sum_fn(cfg, cross_entropy)

  total = 0.0
  for start in range(0, len(tokens), batch_size):
    batch = tokens[start:start + batch_size]
    valid = np.ones(len(batch), np.float32)
    if len(batch) < batch_size:
      pad = batch_size - len(batch)
      batch = np.concatenate([batch, np.zeros((pad, batch.shape[1]), np.int32)])
      valid = np.concatenate([valid, np.zeros(pad, np.float32)])
    total += float(batch_loss_sum(params, batch, valid))
  count = tokens.shape[0] * (tokens.shape[1] - 1)
  loss = total / count
  return {'loss': loss, 'ppl': math.exp(min(20.0, loss)), 'tokens': count}


def batch_loss_sum_fn(cfg: Config, cross_entropy: str):
  """The jitted (params, tokens [B, L], valid [B]) -> summed loss of the valid rows."""
  import jax
  import jax.numpy as jnp
  from t5x_like import losses
  from t5x_like import model as model_lib
  model_cfg = dataclasses.replace(cfg.model, cross_entropy_impl=cross_entropy)
  model = model_lib.Transformer(model_cfg, cfg.padded_vocab_size)

  @jax.jit
  def batch_loss_sum(params, batch, valid):
    return jnp.sum(losses.token_losses(model, params, batch) * valid[:, None])

  return batch_loss_sum


def load_for_inference(checkpoint: str, dtype: str | None = None, step: int | None = None):
  """(config on a one-device mesh, params) of a checkpoint; the padded vocabulary is kept."""
  from t5x_like import checkpoints, partitioning
  from t5x_like.train_state import make_layout
  saved = checkpoints.read_config(checkpoint, step)
  model = {'pad_vocab_size_to': saved.padded_vocab_size, 'hidden_dropout': 0.0,
           'attention_dropout': 0.0}
  if dtype:
    model['dtype'] = dtype
  cfg = saved.replace(model=model, mesh={'data': 1, 'pipeline': 1, 'tensor': 1})
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  return cfg, checkpoints.restore_params(checkpoint, layout, cfg, step)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m t5x_like.evaluate', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help="a run's WORKDIR/checkpoints (latest step) or one step directory")
  parser.add_argument('--data', required=True, help='.npy integer array [N, L] of token ids')
  parser.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'],
                      help='compute dtype (default: the checkpoint config\'s)')
  parser.add_argument('--step', type=int, default=None)
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--cross_entropy', default='chunked', choices=['chunked', 'dense'],
                      help='chunked (default): never the full [batch, L, vocab] fp32 logits; '
                           'dense: the full logits')
  args = parser.parse_args(argv)
  from t5x_like.checkpoints import CheckpointError, read_config
  try:
    saved = read_config(args.checkpoint, args.step)
    tokens = load_tokens(args.data, saved.model.vocab_size)
    cfg, params = load_for_inference(args.checkpoint, args.dtype, args.step)
  except (ConfigError, CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps(evaluate(cfg, params, tokens, args.batch_size, args.cross_entropy)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
