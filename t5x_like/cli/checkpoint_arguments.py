"""The arguments every command that reads a checkpoint shares (evaluate, generate, harness): which
checkpoint and step, the compute dtype, the tensor-parallel width and the tokenizer."""

from __future__ import annotations

import argparse

from t5x_like.errors import ConfigError


def add_checkpoint_arguments(
  parser: argparse.ArgumentParser,
  *,
  dtype_help: str = "compute dtype (default: the checkpoint config's)",
) -> None:
  """--checkpoint, --step, --dtype and --mesh.tensor (read as args.mesh_tensor)."""
  parser.add_argument(
    '--checkpoint',
    required=True,
    help="a run's WORKDIR/checkpoints (latest step) or one step directory",
  )
  parser.add_argument(
    '--step', type=int, default=None, help='the step to restore (default: the latest)'
  )
  parser.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'], help=dtype_help)
  parser.add_argument(
    '--mesh.tensor',
    dest='mesh_tensor',
    type=int,
    default=1,
    help='tensor-parallel devices: heads, FFN and vocabulary split over them, as in training '
    '(default 1)',
  )


def add_tokenizer_arguments(
  parser: argparse.ArgumentParser, default: str = 'the shipped tokenizer'
) -> None:
  """--tokenizer_model or --tokenizer_json (data.tokenizer.load_tokenizer reads them)."""
  which = parser.add_mutually_exclusive_group()
  which.add_argument('--tokenizer_model', help=f'a SentencePiece .model (default: {default})')
  which.add_argument(
    '--tokenizer_json',
    help='a Hugging Face tokenizer.json, or the directory a tokenizer was saved to',
  )


def tokenizer_from_arguments(args: argparse.Namespace):
  """--tokenizer_json / --tokenizer_model (data.tokenizer.load_tokenizer); a bad path is one
  ConfigError."""
  from t5x_like.data.indexed import DataError
  from t5x_like.data.tokenizer import load_tokenizer as load

  try:
    return load(args.tokenizer_json, args.tokenizer_model)
  except DataError as e:
    raise ConfigError(str(e)) from None
