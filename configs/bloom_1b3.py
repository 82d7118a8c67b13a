"""A 1.3B BLOOM (BigScience's tr11b-1B3-ml shape: 24 layers, hidden 2048, 16 heads, 250k vocab).

BigScience names it by its non-embedding parameters (1.21B); with the 250,880-row embedding the
model has 1.72B parameters. bf16 on 16 GPUs, data parallelism over all 16 (ZeRO-1) without a
pipeline, the gradients summed once a step. Each rank runs micro-batches of 4 with the fused
cross-entropy and its layers unrolled: on one H200 that step ran at 50.8% MFU, 1.22x the chunked
loss with scanned layers (docs/benchmarks.md, 2026-11-28), for 35.9 GiB per GPU by XLA's H100
compile (20.0 with those). Until 2026-11-28 it ran data 8 x pipeline 2 in the GPipe order, which
under save_dots keeps every layer's saved matmul outputs of all 17 ticks in flight: 77.5 GiB per
GPU, more than an 80 GB GPU gives JAX.
`python -m t5x_like.plan --config configs/bloom_1b3.py --search --gpus 16 --gpu h100-80gb` ranks
micro-batches of 8 first (1.4% ahead by its estimate, 50.8 GiB per GPU); the config keeps the
micro-batches of 4 that a GPU measured.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = dict(
    architecture='bloom',
    num_layers=24,
    hidden_size=2048,
    num_heads=16,
    vocab_size=250680,
    pad_vocab_size_to=250880,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    init_std=0.0127,  # sqrt(1 / (3 * 2048))
    dtype='bfloat16',
    # The loss and its gradient in one pass over the vocabulary (kernels/cross_entropy.py).
    cross_entropy_impl='fused',
    # save_dots keeps the layers' matmul outputs instead of recomputing them; with the layers
    # unrolled XLA keeps what the rest of their recomputation would compute too (GeLU's and the
    # LayerNorms' outputs), so the backward recomputes nothing.
    remat_policy='save_dots',
    unroll_layers=True,
  )
  c.train = dict(
    steps=0,
    train_samples=220_000_000,
    global_batch_size=512,
    micro_batch_size=4,
    seq_len=2048,
    seed=42,
  )
  c.optimizer = dict(
    lr=2e-4,
    min_lr=1e-5,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_grad=1.0,
    warmup_samples=183_105,
    decay_samples=200_000_000,
    decay_style='cosine',
  )
  c.mesh = dict(data=16, pipeline=1, tensor=1)
  # Each data rank adds its micro-batches' gradients up in fp32 and the ranks' sums cross once a
  # step, in fp32 (tr11's fp32 gradient accumulation), for the whole fp32 gradient on every
  # rank: 6 GiB more per GPU than under 'tick' (XLA's H100 compiles with the chunked loss and
  # scanned layers: 20.0 against 14.3), whose reduce-scatter of every micro-batch's gradient
  # runs in bf16.
  c.pipeline = dict(grad_sync='step')
  c.eval = dict(interval=1000, iters=1)  # --eval-interval 1000, on the split's validation share
  # And a temporary save every 30 minutes: a crash loses at most about that (docs/checkpoints.md).
  c.checkpoint = dict(save_interval=500, save_interval_mins=30.0, max_to_keep=3, init_from='')
  # SLURM's 20 h limit as in tr8/tr11 (--exit-duration-in-mins 1190), and no progress for 30
  # minutes ends the job with every thread's stack (exit 4) instead of an hours-long hang.
  c.runtime = dict(
    exit_duration_mins=1190.0,
    hang_timeout_mins=30.0,
    replica_check_interval=1000,
    compilation_cache_dir='compilation_cache',
  )
  return c
