"""The 104B baseline of BigScience's tr8-104B run: unmodified Megatron GPT-2, 'wide' shape.

32 layers, hidden 16384, 32 heads, learned positions, GPT-2 vocabulary 50,257, seq 2048; Adam
(0.9, 0.95 as the run later used, 1e-8), wd 0.1, clip 1.0, lr 6e-5 -> 6e-6 cosine, warm-up 216,320
samples, decay 126,953,125 samples; tensor 4 x pipeline 32; batch ramp-up
`--rampup-batch-size 32 32 6_000_000`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(
    architecture='gpt2',
    num_layers=32,
    hidden_size=16384,
    num_heads=32,
    vocab_size=50257,
    max_position_embeddings=2048,
    init_std=0.006,
    dtype='bfloat16',
    # Dense logits of a 50,257 / 4 vocabulary are small: chunked's peak is the same 152.7 GiB
    # per device (plan, CPU compile, 2026-11-24), for a recomputed logits matmul, so dense.
    cross_entropy_impl='dense',
    # --checkpoint-activations (save_dots: 667.4 GiB per device in the GPipe order).
    remat_policy='full',
  )
  c.train = dict(
    steps=0,
    train_samples=300_000_000,
    global_batch_size=2048,
    micro_batch_size=1,
    seq_len=2048,
    seed=42,
    rampup_batch_size=(32, 32, 6_000_000),
  )
  c.optimizer = dict(
    lr=6e-5,
    min_lr=6e-6,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_grad=1.0,
    warmup_samples=216_320,
    decay_samples=126_953_125,
    decay_style='cosine',
  )
  c.mesh = dict(data=1, pipeline=32, tensor=4)
  # 1F1B: a stage keeps 63 micro-batches' inputs instead of all 2,079 ticks' (peak 25.39 vs
  # 152.49 GiB per device, plan, CPU compile, 2026-11-24).
  c.pipeline = dict(schedule='1f1b')
  c.eval = dict(interval=1000, iters=1)  # --eval-interval 1000, on the split's validation share
  # And a temporary save each hour: a crash loses at most about that (docs/checkpoints.md).
  c.checkpoint = dict(save_interval=300, save_interval_mins=60.0, max_to_keep=3, init_from='')
  # SLURM's 20 h limit as in tr8/tr11 (--exit-duration-in-mins 1190), and no progress for 30
  # minutes ends the job with every thread's stack (exit 4) instead of an hours-long hang.
  c.runtime = dict(
    exit_duration_mins=1190.0,
    hang_timeout_mins=30.0,
    replica_check_interval=1000,
    compilation_cache_dir='compilation_cache',
  )
  return c
