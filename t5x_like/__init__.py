"""t5x_like: a JAX/XLA trainer for BLOOM- and GPT-style language models.

The package is layered. A module imports from its own package and from the layers below it,
never from a layer above (tests/test_imports.py enforces it; the command shims at the root and
`data/__main__.py` are entry points, not layers):

  7  cli/             one module per command; `python -m t5x_like.<command>` runs it
  6  inference/       a checkpoint's model, ready to run outside training
     planning/        the cost model (`plan --estimate/--search`), XLA's memory report
  5  training/        the loop: trainer, hooks, the jitted step, resume, checkpoint cadence,
                      incidents, runtime stops, alerts, metrics, the run's workdir
  4  checkpointing/   Orbax checkpoints, their inspection, Hugging Face conversion, provenance
  3  parallel/        the state laid out on the mesh: pipeline stages, ZeRO, the train state
  2  model/           the network (BLOOM, GPT-2), attention, losses
     optim/           AdamW and 8-bit Adam
  1  mesh/            the device mesh, its logical axis rules, the processes that share it
     data/            datasets, blends, tokenizers, seqio Tasks
  0  config.py        the typed, validated config (a leaf), errors.py its error, files.py
                      atomic writes; kernels/ the Pallas kernels
"""
