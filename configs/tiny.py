"""Tiny BLOOM (~5M params) that trains on CPU in about two minutes on the embedded corpus.

python -m t5x_like.train --config configs/tiny.py --workdir /tmp/tiny
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(
    architecture='bloom',
    num_layers=4,
    hidden_size=256,
    num_heads=8,
    vocab_size=8192,  # The embedded tokenizer's vocabulary.
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_std=0.02,
    # On this CPU XLA's f32 matmuls are faster than bf16 ones (docs/benchmarks.md); GPUs use bf16.
    dtype='float32',
    # The fastest attention that runs on the device: xla on CPU (model/attention.py AUTO_ORDER).
    attention_impl='auto',
    remat_policy='none',
  )
  c.train = dict(
    steps=120,
    global_batch_size=16,
    micro_batch_size=4,
    seq_len=128,
    seed=1234,
  )
  c.optimizer = dict(
    lr=2e-3,
    min_lr=2e-4,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_grad=1.0,
    warmup_samples=320,
    decay_samples=1920,
    decay_style='cosine',
  )
  # The embedded corpus (data.train_path = ''). Megatron's default split 969,30,1 would leave
  # 11 test samples, fewer than one global batch; this one makes 8 of the 733 documents (97
  # samples) the test split.
  c.data = dict(train_path='', split='959,30,11', valid_path={}, skip_train_iteration_range=())
  # The validation split's loss and perplexity every 20 iterations (and at the end).
  c.eval = dict(interval=20, iters=1)
  c.mesh = dict(data=2, pipeline=1, tensor=2)
  c.checkpoint = dict(
    save_interval=60,
    max_to_keep=2,
    keep_period=0,
    init_from='',
    load_optimizer=True,
    override_lr_scheduler=False,
    load_rng=True,
  )
  # Compare the devices' copies of the replicated arrays (LayerNorms across tensor ranks) twice.
  c.runtime = dict(
    kill_switch_path='', exit_duration_mins=0.0, hang_timeout_mins=0.0, replica_check_interval=60
  )
  return c
