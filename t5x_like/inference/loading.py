"""A checkpoint's model, ready to run outside training: the library that `evaluate`, `generate` and
`ckpt export-hf` share.

`load_for_inference` restores a checkpoint saved from any mesh onto a data x 1 x tensor mesh, with
the config the inference tools run it with (`inference_config`).
"""

from __future__ import annotations

import dataclasses

from t5x_like.config import Config, DataConfig


def inference_config(
  saved: Config, dtype: str | None = None, data: int = 1, tensor: int = 1, with_data: bool = True
) -> Config:
  """The checkpoint's config for inference on a data x 1 x tensor mesh, validated.

  No dropout, one pipeline stage, and the saved padded vocabulary (rounded up to a multiple of
  `tensor` if it is not one: the extra rows are masked out of the softmax and zero-filled on
  restore). The training batch fields are set to one micro-batch per data shard, so validation
  checks what evaluation uses. `with_data=False` (generation, export) drops the run's data
  settings: a model runs without the data it trained on (a user's seqio Task module need not be
  importable, nor its files present).
  """
  from t5x_like.training import startup  # the full check (attention, data, schedule), as training's

  padded = -(-saved.padded_vocab_size // tensor) * tensor
  model: dict[str, object] = {
    'pad_vocab_size_to': padded,
    'hidden_dropout': 0.0,
    'attention_dropout': 0.0,
  }
  if dtype:
    model['dtype'] = dtype
  if not with_data:
    saved = dataclasses.replace(saved, data=DataConfig())
  return startup.check_config(
    saved.replace(
      model=model,
      # The whole model on every data shard: no ZeRO split of the weights to gather.
      mesh={'data': data, 'pipeline': 1, 'tensor': tensor, 'zero_stage': 1, 'zero_group': 0},
      pipeline={'repeats': 1},
      train={'global_batch_size': data, 'micro_batch_size': 1, 'rampup_batch_size': ()},
    )
  )


def load_for_inference(
  checkpoint: str,
  dtype: str | None = None,
  step: int | None = None,
  data: int = 1,
  tensor: int = 1,
  with_data: bool = True,
):
  """(config on a data x 1 x tensor mesh, params) of a checkpoint saved from any mesh.

  The params are restored into the mesh's compute shardings: split over `tensor` as training
  splits them, replicated over `data` (no ZeRO split: every data shard runs the whole model).
  """
  # Imported here: JAX starts with them, and the tools create their virtual devices first.
  from t5x_like.checkpointing import checkpoints
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout

  cfg = inference_config(checkpoints.read_config(checkpoint, step), dtype, data, tensor, with_data)
  layout = make_layout(cfg, partitioning.make_mesh(data, 1, tensor))
  params = checkpoints.restore_params(checkpoint, layout, cfg, step)
  return cfg, layout.compute_params(params)
