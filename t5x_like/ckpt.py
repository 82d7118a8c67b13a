"""`python -m t5x_like.ckpt`: checkpoint tools.

  python -m t5x_like.ckpt import-hf HF_DIR OUT_DIR    BloomForCausalLM (safetensors) -> checkpoint
  python -m t5x_like.ckpt export-hf CKPT_DIR HF_DIR   checkpoint -> BloomForCausalLM directory

CKPT_DIR is a run's checkpoint root (`WORKDIR/checkpoints`, meaning its latest step unless
`--step N` says otherwise) or one step's directory inside it.
"""

from __future__ import annotations

import argparse
import os
import sys

from t5x_like.config import Config, ConfigError


def import_hf(hf_dir: str, out_dir: str) -> Config:
  """Writes a weights-only checkpoint (step 0) with the model config taken from HF's config."""
  from t5x_like import checkpoints, hf
  if checkpoints.available_steps(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)):
    raise ConfigError(f'{out_dir} is not empty; choose a new output directory')
  hf_config, state = hf.load_hf_dir(hf_dir)
  cfg = Config.from_dict({'model': hf.model_config_from_hf(hf_config),
                          'train': {'steps': 1}}).validate()
  params = hf.params_from_hf_state(state, cfg.model, cfg.padded_vocab_size)
  checkpoints.save_params(out_dir, params, cfg)
  return cfg


def export_hf(ckpt_dir: str, hf_dir: str, step: int | None = None) -> None:
  import jax
  import numpy as np
  from t5x_like import hf
  from t5x_like.evaluate import load_for_inference
  cfg, params = load_for_inference(ckpt_dir, 'float32', step)
  state = hf.hf_state_from_params(jax.tree.map(np.asarray, params), cfg.model)
  hf.save_hf_dir(hf_dir, hf.hf_config_from_model_config(cfg.model), state)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m t5x_like.ckpt', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest='command', required=True)
  p = sub.add_parser('import-hf', help='HF BloomForCausalLM directory -> checkpoint')
  p.add_argument('hf_dir')
  p.add_argument('out_dir')
  p = sub.add_parser('export-hf', help='checkpoint -> HF BloomForCausalLM directory')
  p.add_argument('ckpt_dir')
  p.add_argument('hf_dir')
  p.add_argument('--step', type=int, default=None)
  args = parser.parse_args(argv)
  from t5x_like.checkpoints import CheckpointError
  try:
    if args.command == 'import-hf':
      cfg = import_hf(args.hf_dir, args.out_dir)
      print(f'wrote {args.out_dir}/0: {cfg.model.architecture} {cfg.model.num_layers} layers, '
            f'hidden {cfg.model.hidden_size}, vocab {cfg.model.vocab_size}')
    else:
      export_hf(args.ckpt_dir, args.hf_dir, args.step)
      print(f'wrote {args.hf_dir} (load with BloomForCausalLM.from_pretrained)')
  except (ConfigError, CheckpointError, ValueError, FileNotFoundError, FileExistsError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
