"""`python -m t5x_like.evaluate`: next-token loss of a checkpoint on a token array.

  python -m t5x_like.evaluate --checkpoint CKPT_DIR --data TOKENS.npy [--dtype float32]
      [--mesh.data D] [--mesh.tensor T]

TOKENS.npy is an integer array [N, L]; the loss is the mean next-token cross-entropy over all
N x (L-1) predictions. The last line printed is a JSON object with `loss`, `ppl` and `tokens`.

The model runs on a data x tensor mesh (default 1 x 1), whatever mesh the checkpoint was saved
from: the weights are restored straight into their tensor-parallel shardings (replicated over
`data`), and each batch is split over `data`. A model too large for one device is evaluated with
`--mesh.tensor`; on CPU the virtual devices are created as for training.

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

  cfg, params: from `load_for_inference` (its mesh is cfg.mesh, data x 1 x tensor).
  cross_entropy: 'chunked' (never the full fp32 logits; `model.cross_entropy_chunk` vocabulary
  rows at a time) or 'dense' (full logits), the same numbers to fp32 rounding.
  """
  check_batch_size(batch_size, cfg.mesh.data)
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


def check_batch_size(batch_size: int, data: int) -> None:
  if batch_size < 1 or batch_size % data:
    raise ConfigError(f'--batch_size ({batch_size}) must be a positive multiple of --mesh.data '
                      f'({data}): each batch is split evenly over the data-parallel devices')


def batch_loss_sum_fn(cfg: Config, cross_entropy: str):
  """The jitted (params, tokens [B, L], valid [B]) -> summed loss of the valid rows, on cfg.mesh:
  rows split over `data`, the model's weights and activations split over `tensor` as in training
  (the params keep the shardings `load_for_inference` gave them)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from t5x_like import losses, partitioning
  from t5x_like import model as model_lib
  mesh = partitioning.make_mesh(cfg.mesh.data, 1, cfg.mesh.tensor)
  model_cfg = dataclasses.replace(cfg.model, cross_entropy_impl=cross_entropy)
  model = model_lib.Transformer(model_cfg, cfg.padded_vocab_size, mesh)
  split = lambda x, names: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, partitioning.spec_for(names, x.shape, mesh)))

  @jax.jit
  def batch_loss_sum(params, batch, valid):
    batch, valid = split(batch, ('batch', 'length')), split(valid, ('batch',))
    return jnp.sum(losses.token_losses(model, params, batch) * valid[:, None])

  return batch_loss_sum


def inference_config(saved: Config, dtype: str | None = None, data: int = 1,
                     tensor: int = 1) -> Config:
  """The checkpoint's config for inference on a data x 1 x tensor mesh, validated.

  No dropout, one pipeline stage, and the saved padded vocabulary (rounded up to a multiple of
  `tensor` if it is not one: the extra rows are masked out of the softmax and zero-filled on
  restore). The training batch fields are set to one micro-batch per data shard, so validation
  checks what evaluation uses.
  """
  padded = -(-saved.padded_vocab_size // tensor) * tensor
  model = {'pad_vocab_size_to': padded, 'hidden_dropout': 0.0, 'attention_dropout': 0.0}
  if dtype:
    model['dtype'] = dtype
  return saved.replace(model=model, mesh={'data': data, 'pipeline': 1, 'tensor': tensor},
                       pipeline={'repeats': 1},
                       train={'global_batch_size': data, 'micro_batch_size': 1,
                              'rampup_batch_size': ()}).validate()


def load_for_inference(checkpoint: str, dtype: str | None = None, step: int | None = None,
                       data: int = 1, tensor: int = 1):
  """(config on a data x 1 x tensor mesh, params) of a checkpoint saved from any mesh.

  The params are restored into the mesh's compute shardings: split over `tensor` as training
  splits them, replicated over `data` (no ZeRO split: every data shard runs the whole model).
  """
  import jax
  from t5x_like import checkpoints, partitioning
  from t5x_like.train_state import make_layout
  cfg = inference_config(checkpoints.read_config(checkpoint, step), dtype, data, tensor)
  layout = make_layout(cfg, partitioning.make_mesh(data, 1, tensor))
  params = checkpoints.restore_params(checkpoint, layout, cfg, step)
  return cfg, jax.device_put(params, layout.compute_param_shardings)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m t5x_like.evaluate', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help="a run's WORKDIR/checkpoints (latest step) or one step directory")
  parser.add_argument('--data', dest='data_path', required=True,
                      help='.npy integer array [N, L] of token ids')
  parser.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'],
                      help='compute dtype (default: the checkpoint config\'s)')
  parser.add_argument('--step', type=int, default=None)
  parser.add_argument('--batch_size', type=int, default=8,
                      help='rows per batch; a multiple of --mesh.data')
  parser.add_argument('--mesh.data', dest='mesh_data', type=int, default=1,
                      help='data-parallel devices: each batch is split over them (default 1)')
  parser.add_argument('--mesh.tensor', dest='mesh_tensor', type=int, default=1,
                      help='tensor-parallel devices: heads, FFN and vocabulary split over them, '
                           'as in training (default 1)')
  parser.add_argument('--cross_entropy', default='chunked', choices=['chunked', 'dense'],
                      help='chunked (default): never the full [batch, L, vocab] fp32 logits; '
                           'dense: the full logits')
  args = parser.parse_args(argv)
  from t5x_like import partitioning
  from t5x_like.checkpoints import CheckpointError, read_config
  try:
    data, tensor = args.mesh_data, args.mesh_tensor
    if data < 1 or tensor < 1:
      raise ConfigError(f'--mesh.data and --mesh.tensor must be >= 1, got {data} and {tensor}')
    check_batch_size(args.batch_size, data)
    # Before anything starts JAX: on CPU the mesh's virtual devices are created here.
    partitioning.ensure_devices(data * tensor)
    saved = read_config(args.checkpoint, args.step)
    tokens = load_tokens(args.data_path, saved.model.vocab_size)
    # A mesh the model cannot use fails in inference_config, before anything is restored.
    cfg, params = load_for_inference(args.checkpoint, args.dtype, args.step, data, tensor)
  except (ConfigError, CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps(evaluate(cfg, params, tokens, args.batch_size, args.cross_entropy)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
