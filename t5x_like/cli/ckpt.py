"""`python -m t5x_like.ckpt`: the checkpoint command line (inspect, diff, verify, stats, HF import
and export).

  python -m t5x_like.ckpt inspect CKPT [--step N] [--json]   step, config, tensors, sizes (metadata)
  python -m t5x_like.ckpt diff A B [--atol X]                per-tensor max |a-b| and relative norm
  python -m t5x_like.ckpt verify CKPT [--step N]             finite, Adam step count, restorable,
                      [--no-restore]                         replicas identical on the saved mesh
  python -m t5x_like.ckpt stats CKPT [--step N]              norm/mean/std/min/max/zeros per tensor
  python -m t5x_like.ckpt import-hf HF_DIR OUT_DIR           BloomForCausalLM (safetensors) -> ckpt
  python -m t5x_like.ckpt export-hf CKPT HF_DIR              checkpoint -> BloomForCausalLM dir
                      [--tokenizer_json F | --tokenizer_model F]  the special-token ids of the
                                                             data's tokenizer (default: BLOOM's)
  python -m t5x_like.ckpt rollback CKPT --to N               step N becomes the latest: the later
                                                             steps move to CKPT/.rolled_back/

CKPT (and A, B) is a run's checkpoint root (`WORKDIR/checkpoints`, meaning its latest step unless
`--step N` says otherwise; `--step-a` / `--step-b` for diff) or one step's directory inside it.
Exit codes: 0 ok; 1 `diff` found a difference beyond --atol or `verify` a failed check (the reason
is printed); 2 bad input (no such directory or step, no checkpoint, a damaged checkpoint, a
rollback while a trainer holds the workdir).
The tools run on the CPU (virtual devices where a mesh needs them), never on a GPU a job may hold.
"""

# What inspect / diff / verify / stats compute lives in checkpoint_inspection.py, the HF mapping
# in hf.py, and saving and restoring (the library a run uses) in checkpoints.py.

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from t5x_like.cli.checkpoint_arguments import add_tokenizer_arguments, tokenizer_from_arguments
from t5x_like.config import Config, ConfigError
from t5x_like.files import check_writable


def import_hf(hf_dir: str, out_dir: str) -> Config:
  """Writes a weights-only checkpoint (step 0) with the model config taken from HF's config."""
  from t5x_like.checkpointing import checkpoints, hf

  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ConfigError(f'{out_dir} is a file; pass a new directory to write the checkpoint to')
  if checkpoints.available_steps(out_dir) or (os.path.isdir(out_dir) and os.listdir(out_dir)):
    raise ConfigError(f'{out_dir} is not empty; choose a new output directory')
  check_writable(out_dir, 'the checkpoint directory', 'pass a directory you can write to')
  hf_config, state = hf.load_hf_dir(hf_dir)
  cfg = Config.from_dict(
    {'model': hf.model_config_from_hf(hf_config), 'train': {'steps': 1}}
  ).validate()
  params = hf.params_from_hf_state(state, cfg.model, cfg.padded_vocab_size)
  checkpoints.save_params(out_dir, params, cfg)
  return cfg


def special_token_ids(tokenizer) -> dict[str, int]:
  """The bos, eos and pad ids a Hugging Face config.json names, from the tokenizer the run's data
  was tokenized with: eos its end-of-document id, which also stands for a bos or pad it lacks
  (GPT-2's convention; another tokenizer's ids would name ordinary tokens)."""
  eos = tokenizer.eod_id
  bos, pad = (i if i is not None and i >= 0 else eos for i in (tokenizer.bos_id, tokenizer.pad_id))
  return {'bos_token_id': bos, 'eos_token_id': eos, 'pad_token_id': pad}


def export_hf(ckpt_dir: str, hf_dir: str, step: int | None = None, tokenizer=None) -> None:
  """Writes a BloomForCausalLM directory; its config.json names `tokenizer`'s special-token ids
  (BLOOM's without one), so that HF's `generate` stops at the data's end of document."""
  import jax
  import numpy as np

  from t5x_like.checkpointing import checkpoints, hf
  from t5x_like.inference.loading import load_for_inference

  check_writable(hf_dir, 'the Hugging Face directory', 'pass a directory you can write to')
  ids = special_token_ids(tokenizer) if tokenizer is not None else {}  # {}: BLOOM's
  vocab = checkpoints.read_config(ckpt_dir, step).model.vocab_size  # before the restore
  if tokenizer is not None and tokenizer.vocab_size > vocab:
    raise ConfigError(
      f'the tokenizer has {tokenizer.vocab_size} tokens, the model {vocab}: pass the '
      "tokenizer the checkpoint's data was tokenized with (--tokenizer_json or --tokenizer_model)"
    )
  cfg, params = load_for_inference(ckpt_dir, 'float32', step, with_data=False)
  state = hf.hf_state_from_params(jax.tree.map(np.asarray, params), cfg.model)
  hf.save_hf_dir(hf_dir, hf.hf_config_from_model_config(cfg.model, **ids), state)


def _finite_json(value):
  """JSON has no inf/NaN: they become null (the text output shows them)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite_json(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_finite_json(v) for v in value]
  return value


def run_tool(args) -> int:
  """inspect / diff / verify / stats; returns the exit code."""
  from t5x_like.checkpointing import inspection

  emit = lambda obj: print(json.dumps(_finite_json(obj), indent=2))
  if args.command == 'inspect':
    info = inspection.inspect(inspection.CheckpointReader(args.ckpt_dir, args.step))
    emit(info) if args.json else print(inspection.format_inspect(info))
    return 0
  if args.command == 'stats':
    rows = inspection.stats(inspection.CheckpointReader(args.ckpt_dir, args.step))
    emit(rows) if args.json else print(inspection.format_stats(rows))
    return 0
  if args.command == 'diff':
    if not 0 <= args.atol < float('inf'):  # also refuses NaN
      raise ConfigError(
        f'--atol must be a finite number >= 0 (the largest |a - b| that counts '
        f'as equal), got {args.atol}'
      )
    a = inspection.CheckpointReader(args.a, args.step_a)
    b = inspection.CheckpointReader(args.b, args.step_b)
    result = inspection.diff(a, b, args.atol)
    emit(result) if args.json else print(inspection.format_diff(result))
    return 0 if result['same'] else 1
  from t5x_like.checkpointing.checkpoints import CheckpointError

  reader = inspection.CheckpointReader(args.ckpt_dir, args.step)
  try:
    results = inspection.verify(reader, restore=not args.no_restore)
  except CheckpointError as e:  # a tensor that cannot be read: the check failed, not the input
    results = [{'check': 'readable', 'ok': False, 'detail': str(e)}]
  if args.json:
    emit(results)
  else:
    for r in results:
      print(f'{"ok  " if r["ok"] else "FAIL"} {r["check"]}: {r["detail"]}')
  failed = [r['check'] for r in results if not r['ok']]
  unchecked = ' (not restored: --no-restore)' if args.no_restore else ''
  print(
    f'{reader.dir}: ' + (f'FAILED ({", ".join(failed)})' if failed else 'verified') + unchecked,
    file=sys.stderr if failed else sys.stdout,
  )
  return 1 if failed else 0


def rollback(ckpt_dir: str, step: int) -> None:
  """checkpoints.roll_back under the workdir's lock (WORKDIR/trainer.lock, when there is one):
  never while a trainer runs there, and no trainer starts while the steps move."""
  from t5x_like.checkpointing import checkpoints
  from t5x_like.training import workdir as workdir_lib

  root, _ = checkpoints.resolve(ckpt_dir)
  workdir = os.path.dirname(root)
  lock = None
  if os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE)):
    lock = workdir_lib.Lock(workdir)
    lock.acquire()
  try:
    moved, target = checkpoints.roll_back(root, step)
  finally:
    if lock is not None:
      lock.release(started=False)
  print(
    f'moved step(s) {", ".join(map(str, moved))} of {root} to {target}\n'
    f'the next run in {workdir} resumes from step {step}, and replaces its records after '
    f'iteration {step} (metrics.jsonl, eval_metrics.jsonl, TensorBoard); to undo: '
    f'mv {target}/* {root}/'
  )


def _use_cpu() -> None:
  """Unless JAX_PLATFORMS says otherwise, the tools never take a GPU (a job may be using it)."""
  from t5x_like.mesh import partitioning

  if not os.environ.get('JAX_PLATFORMS') and not partitioning.backends_started():
    import jax

    jax.config.update('jax_platforms', 'cpu')
  import absl.logging

  absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info lines are not for this output


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.ckpt',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest='command', required=True)
  for name, text in (
    ('inspect', 'step, config, tensors with shapes/dtypes/bytes/sharding'),
    ('verify', 'finite tensors, Adam step count, restorable, replicas equal'),
    ('stats', 'per-tensor norm, mean, std, min, max, zeros (params, Adam)'),
  ):
    p = sub.add_parser(name, help=text)
    p.add_argument('ckpt_dir', help="a run's WORKDIR/checkpoints (latest step) or a step dir")
    p.add_argument('--step', type=int, default=None)
    p.add_argument('--json', action='store_true', help='print JSON instead of a table')
    if name == 'verify':
      p.add_argument(
        '--no-restore',
        action='store_true',
        help='only the streamed checks: no restore (which needs host memory of the '
        "checkpoint's size) and so no replica check",
      )
  p = sub.add_parser('diff', help='per-tensor differences between two checkpoints')
  p.add_argument('a')
  p.add_argument('b')
  p.add_argument('--step-a', type=int, default=None)
  p.add_argument('--step-b', type=int, default=None)
  p.add_argument(
    '--atol',
    type=float,
    default=0.0,
    help='largest |a-b| that counts as equal (default 0: bitwise)',
  )
  p.add_argument('--json', action='store_true')
  p = sub.add_parser('import-hf', help='HF BloomForCausalLM directory -> checkpoint')
  p.add_argument('hf_dir')
  p.add_argument('out_dir')
  p = sub.add_parser('export-hf', help='checkpoint -> HF BloomForCausalLM directory')
  p.add_argument('ckpt_dir')
  p.add_argument('hf_dir')
  p.add_argument('--step', type=int, default=None)
  # config.json names the special-token ids of the tokenizer the data was tokenized with.
  add_tokenizer_arguments(p, default="BLOOM's ids: <s> 1, </s> 2, <pad> 3")
  p = sub.add_parser('rollback', help='make step N the latest: the later steps are moved aside')
  p.add_argument('ckpt_dir', help="a run's WORKDIR/checkpoints")
  p.add_argument('--to', type=int, required=True, help='the step the next run resumes from')
  args = parser.parse_args(argv)
  _use_cpu()
  from t5x_like.checkpointing.checkpoints import CheckpointError

  try:
    if args.command in ('inspect', 'diff', 'verify', 'stats'):
      return run_tool(args)
    if args.command == 'rollback':
      rollback(args.ckpt_dir, args.to)
      return 0
    if args.command == 'import-hf':
      cfg = import_hf(args.hf_dir, args.out_dir)
      print(
        f'wrote {args.out_dir}/0: {cfg.model.architecture} {cfg.model.num_layers} layers, '
        f'hidden {cfg.model.hidden_size}, vocab {cfg.model.vocab_size}'
      )
    else:
      given = args.tokenizer_json or args.tokenizer_model
      export_hf(
        args.ckpt_dir, args.hf_dir, args.step, tokenizer_from_arguments(args) if given else None
      )
      print(f'wrote {args.hf_dir} (load with BloomForCausalLM.from_pretrained)')
  except (ConfigError, CheckpointError, ValueError, FileNotFoundError, FileExistsError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
