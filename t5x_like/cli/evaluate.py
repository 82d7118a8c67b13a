"""`python -m t5x_like.evaluate`: next-token loss of a checkpoint on a token array or dataset.

  python -m t5x_like.evaluate --checkpoint CKPT_DIR --data TOKENS.npy [--dtype float32]
      [--mesh.data D] [--mesh.tensor T]
  python -m t5x_like.evaluate --checkpoint CKPT_DIR --data PREFIX [--documents all|train|valid|test]
      [--split 969,30,1] [--seq_len S] [--max_samples N] ...

TOKENS.npy is an integer array [N, L]; the loss is the mean next-token cross-entropy over all
N x (L-1) predictions. PREFIX names a Megatron dataset (PREFIX.bin + PREFIX.idx, as
`data.train_path` does): its documents (all, or one share of `--split`, by default the
checkpoint's data.split) are read in order as consecutive samples of S + 1 tokens overlapping by
one (S: `--seq_len`, by default the checkpoint's train.seq_len), so every token after the first
is predicted exactly once; the tail shorter than a sample is left out. The last line printed is
a JSON object with `loss`, `ppl` and `tokens`.

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
import os
import sys
from typing import Literal

import numpy as np

from t5x_like.cli.checkpoint_arguments import add_checkpoint_arguments
from t5x_like.config import Config, ConfigError

# --cross_entropy's choices (model.cross_entropy_impl values).
CrossEntropy = Literal['chunked', 'dense']


def load_tokens(path: str, vocab_size: int) -> np.ndarray:
  """The token array, checked before any model work."""
  try:
    tokens = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise ConfigError(
      f'--data {path} does not exist; pass a .npy file of token ids [N, L]'
    ) from None
  except ValueError as e:
    raise ConfigError(f'--data {path} is not a plain .npy array ({e})') from None
  if tokens.ndim != 2 or tokens.shape[1] < 2 or tokens.shape[0] < 1:
    raise ConfigError(
      f'--data must be an integer array [N, L] with L >= 2, got shape {tokens.shape}'
    )
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ConfigError(f'--data must hold integer token ids, got dtype {tokens.dtype}')
  if tokens.min() < 0 or tokens.max() >= vocab_size:
    raise ConfigError(
      f'--data holds token ids in [{tokens.min()}, {tokens.max()}] but the model '
      f'has {vocab_size} tokens'
    )
  return tokens.astype(np.int32)


def dataset_samples(
  prefix: str,
  vocab_size: int,
  seq_len: int,
  split: str = '1',
  documents: str = 'all',
  max_samples: int = 0,
) -> np.ndarray:
  """[N, seq_len + 1] samples of a Megatron dataset's documents (all, or one share of `split`)
  in file order, consecutive samples sharing one token, as a view of the memory map (nothing is
  copied until a batch is read). Every id is checked against the vocabulary first."""
  from t5x_like.data import sources
  from t5x_like.data.indexed import DataError

  try:
    stream = sources.open_indexed(prefix)
    num_documents = len(stream.offsets) - 1
    if documents == 'all':
      first, last = 0, num_documents
    else:
      first, last = sources.split_ranges(num_documents, split)[sources.SPLIT_NAMES.index(documents)]
    tokens = stream.documents(first, last)
    count = (tokens.size - 1) // seq_len
    if max_samples:
      count = min(count, max_samples)
    what = f'--data {prefix} (documents {first}..{last}, --documents {documents})'
    if count < 1:
      raise DataError(
        f'{what} holds {tokens.size} tokens, fewer than one sample of --seq_len + 1 '
        f'= {seq_len + 1}; choose other documents or a shorter --seq_len'
      )
    tokens = tokens[: count * seq_len + 1]
    for start in range(0, tokens.size, 1 << 26):  # a full scan, in bounded chunks
      sources.check_token_ids(tokens[start : start + (1 << 26)], vocab_size, what)
  except DataError as e:
    raise ConfigError(str(e)) from None
  step = tokens.strides[0]
  return np.lib.stride_tricks.as_strided(
    tokens, (count, seq_len + 1), (seq_len * step, step), writeable=False
  )


def evaluate(
  cfg: Config,
  params,
  tokens: np.ndarray,
  batch_size: int = 8,
  cross_entropy: CrossEntropy = 'chunked',
) -> dict:
  """Mean next-token loss over every prediction; one compile (the last batch is padded).

  cfg, params: from `inference.load_for_inference` (its mesh is cfg.mesh, data x 1 x tensor).
  cross_entropy: 'chunked' (never the full fp32 logits; `model.cross_entropy_chunk` vocabulary
  rows at a time) or 'dense' (full logits), the same numbers to fp32 rounding.
  """
  check_batch_size(batch_size, cfg.mesh.data)
  batch_loss_sum = batch_loss_sum_fn(cfg, cross_entropy)

  total = 0.0
  for start in range(0, len(tokens), batch_size):
    batch = np.asarray(tokens[start : start + batch_size], np.int32)  # a dataset view: read now
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
    raise ConfigError(
      f'--batch_size ({batch_size}) must be a positive multiple of --mesh.data '
      f'({data}): each batch is split evenly over the data-parallel devices'
    )


def batch_loss_sum_fn(cfg: Config, cross_entropy: CrossEntropy):
  """The jitted (params, tokens [B, L], valid [B]) -> summed loss of the valid rows, on cfg.mesh:
  rows split over `data`, the model's weights and activations split over `tensor` as in training
  (the params keep the shardings `inference.load_for_inference` gave them)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding

  from t5x_like.mesh import partitioning
  from t5x_like.model import losses
  from t5x_like.model import transformer as model_lib

  mesh = partitioning.make_mesh(cfg.mesh.data, 1, cfg.mesh.tensor)
  model_cfg = dataclasses.replace(cfg.model, cross_entropy_impl=cross_entropy)
  model = model_lib.Transformer(model_cfg, cfg.padded_vocab_size, mesh)
  split = lambda x, names: jax.lax.with_sharding_constraint(
    x, NamedSharding(mesh, partitioning.spec_for(names, x.shape, mesh))
  )

  @jax.jit
  def batch_loss_sum(params, batch, valid):
    batch, valid = split(batch, ('batch', 'length')), split(valid, ('batch',))
    return jnp.sum(losses.token_losses(model, params, batch) * valid[:, None])

  return batch_loss_sum


def load_data(args: argparse.Namespace, saved: Config) -> np.ndarray:
  """--data as [N, L] token ids: a .npy array, or samples of a Megatron dataset."""
  from t5x_like.data import indexed, sources
  from t5x_like.data.indexed import DataError

  dataset_flags = (
    args.documents != 'all'
    or args.split is not None
    or args.seq_len is not None
    or args.max_samples
  )
  if os.path.isdir(args.data_path):
    prefixes = sorted(
      name[: -len('.bin')] for name in os.listdir(args.data_path) if name.endswith('.bin')
    )
    hint = (
      f'; its datasets: {", ".join(os.path.join(args.data_path, p) for p in prefixes[:4])}'
      if prefixes
      else ''
    )
    raise ConfigError(
      f'--data {args.data_path} is a directory; pass TOKENS.npy or a dataset '
      f'PREFIX (the PREFIX of PREFIX.bin and PREFIX.idx){hint}'
    )
  if args.data_path.endswith('.npy'):
    if dataset_flags:
      raise ConfigError(
        '--documents, --split, --seq_len and --max_samples apply to a dataset '
        'PREFIX, not to a .npy array'
      )
    return load_tokens(args.data_path, saved.model.vocab_size)
  if not indexed.exists(args.data_path):
    raise ConfigError(
      f'--data {args.data_path}: neither a .npy file nor a dataset prefix '
      f'({args.data_path}.bin and .idx do not exist); pass TOKENS.npy or the '
      'PREFIX that python -m t5x_like.data preprocess wrote'
    )
  seq_len = saved.train.seq_len if args.seq_len is None else args.seq_len
  split = saved.data.split if args.split is None else args.split
  if seq_len < 1 or args.max_samples < 0:
    raise ConfigError(
      f'--seq_len must be >= 1 and --max_samples >= 0, got {seq_len} and {args.max_samples}'
    )
  try:
    sources.parse_split(split)
  except DataError as e:
    raise ConfigError(str(e).replace('data.split', '--split')) from None
  return dataset_samples(
    args.data_path, saved.model.vocab_size, seq_len, split, args.documents, args.max_samples
  )


def check_positions(model, inputs: int) -> None:
  """A gpt2 model reads at most its learned positions per sample: `inputs` more is one error,
  before the restore."""
  if model.architecture == 'gpt2' and inputs > model.max_position_embeddings:
    raise ConfigError(
      f'a sample feeds {inputs} tokens to the model, more than the '
      f'{model.max_position_embeddings} learned positions of this gpt2 model; pass shorter '
      'rows (or, with a dataset, a --seq_len of at most that)'
    )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.evaluate',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add_checkpoint_arguments(parser)
  parser.add_argument(
    '--data',
    dest='data_path',
    required=True,
    help='.npy integer array [N, L] of token ids, or a Megatron dataset PREFIX '
    '(PREFIX.bin + PREFIX.idx)',
  )
  parser.add_argument(
    '--documents',
    default='all',
    choices=['all', 'train', 'valid', 'test'],
    help='with a dataset: all of its documents, or one share of --split',
  )
  parser.add_argument(
    '--split',
    default=None,
    help="with a dataset: train,valid,test shares (default: the checkpoint's data.split)",
  )
  parser.add_argument(
    '--seq_len',
    type=int,
    default=None,
    help="with a dataset: tokens predicted per sample (default: the checkpoint's train.seq_len)",
  )
  parser.add_argument(
    '--max_samples',
    type=int,
    default=0,
    help='with a dataset: at most this many samples, from the first (0: all)',
  )
  parser.add_argument(
    '--batch_size', type=int, default=8, help='rows per batch; a multiple of --mesh.data'
  )
  parser.add_argument(
    '--mesh.data',
    dest='mesh_data',
    type=int,
    default=1,
    help='data-parallel devices: each batch is split over them (default 1)',
  )
  parser.add_argument(
    '--cross_entropy',
    default='chunked',
    choices=['chunked', 'dense'],
    help='chunked (default): never the full [batch, L, vocab] fp32 logits; dense: the full logits',
  )
  args = parser.parse_args(argv)
  from t5x_like.checkpointing.checkpoints import CheckpointError, read_config
  from t5x_like.inference import loading as inference
  from t5x_like.mesh import partitioning

  try:
    data, tensor = args.mesh_data, args.mesh_tensor
    if data < 1 or tensor < 1:
      raise ConfigError(f'--mesh.data and --mesh.tensor must be >= 1, got {data} and {tensor}')
    check_batch_size(args.batch_size, data)
    # Before anything starts JAX: on CPU the mesh's virtual devices are created here.
    partitioning.ensure_devices(data * tensor)
    saved = read_config(args.checkpoint, args.step)
    tokens = load_data(args, saved)
    check_positions(saved.model, tokens.shape[1] - 1)
    # A mesh the model cannot use fails in inference.inference_config, before anything is
    # restored.
    cfg, params = inference.load_for_inference(args.checkpoint, args.dtype, args.step, data, tensor)
  except (ConfigError, CheckpointError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(json.dumps(evaluate(cfg, params, tokens, args.batch_size, args.cross_entropy)))
  return 0


if __name__ == '__main__':
  sys.exit(main())
