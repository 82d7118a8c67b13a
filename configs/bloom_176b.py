"""BLOOM-176B exactly as trained in BigScience's tr11-176B-ml run (see ../shared/reference).

70 layers, hidden 14336, 112 heads, ALiBi, embedding LayerNorm, vocabulary 250,680 padded to
250,880; tensor 4 x pipeline 12 x data 8 (384 GPUs), micro-batch 2, global batch 2048;
Adam(0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, lr 6e-5 warmed up over 183,105 samples and
cosine-decayed to 6e-6 at 200M samples; 220M training samples. tr11 also ramped the batch size up
(`--rampup-batch-size 192 16 9_765_625`); the ramp-up arrives with pipeline parallelism.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(
      architecture='bloom',
      num_layers=70,
      hidden_size=14336,
      num_heads=112,
      vocab_size=250680,
      pad_vocab_size_to=250880,
      layernorm_epsilon=1e-5,
      hidden_dropout=0.1,
      attention_dropout=0.1,
      init_std=0.0048,  # sqrt(1 / (3 * 14336))
      dtype='bfloat16',
      attention_impl='xla',
      remat_policy='full',  # --checkpoint-activations
  )
  c.train = dict(
      steps=0,
      train_samples=220_000_000,
      global_batch_size=2048,
      micro_batch_size=2,
      seq_len=2048,
      seed=42,
  )
  c.optimizer = dict(
      lr=6e-5,
      min_lr=6e-6,
      beta1=0.9,
      beta2=0.95,
      eps=1e-8,
      weight_decay=0.1,
      clip_grad=1.0,
      warmup_samples=183_105,
      decay_samples=200_000_000,
      decay_style='cosine',
  )
  c.mesh = dict(data=8, pipeline=12, tensor=4)
  c.checkpoint = dict(save_interval=100, max_to_keep=3, init_from='')
  return c
