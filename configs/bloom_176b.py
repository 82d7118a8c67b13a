"""BLOOM-176B exactly as trained in BigScience's tr11-176B-ml run (see ../shared/reference).

70 layers, hidden 14336, 112 heads, ALiBi, embedding LayerNorm, vocabulary 250,680 padded to
250,880; tensor 4 x pipeline 12 x data 8 (384 GPUs), micro-batch 2, global batch 2048;
Adam(0.9, 0.95, 1e-8), weight decay 0.1, clip 1.0, lr 6e-5 warmed up over 183,105 samples and
cosine-decayed to 6e-6 at 200M samples; 220M training samples; the batch size ramps up from 192
by 16 over 9,765,625 samples (`--rampup-batch-size 192 16 9_765_625`).
"""

import ml_collections

# tr11's 28 datasets and weights: bigscience data/catalogue/
# training_dataset_ratios_merged_nigercongo_v3.json, as load_ratios_meg_ds_format.py passed them.
TR11_DATASETS = (
  ('ar', 0.0330676168743166),
  ('ca', 0.011242051312222764),
  ('code', 0.13027200903379185),
  ('en', 0.22171164529099704),
  ('es', 0.10667815627928671),
  ('eu', 0.0015595123898173287),
  ('fr', 0.13054018439603915),
  ('id', 0.01091803753667153),
  ('indic-as', 0.00011021422347108609),
  ('indic-bn', 0.005492381453597748),
  ('indic-gu', 0.0004021215011318779),
  ('indic-hi', 0.007470068593492175),
  ('indic-kn', 0.0006190467776576425),
  ('indic-ml', 0.0010335296343329384),
  ('indic-mr', 0.0005012010684646179),
  ('indic-ne', 0.0006672772956128299),
  ('indic-or', 0.00035928138344705506),
  ('indic-pa', 0.0005084433130291778),
  ('indic-ta', 0.0021137328219915496),
  ('indic-te', 0.0009129946225980253),
  ('indic-ur', 0.0012454301613725426),
  ('nigercongo-all', 0.00031588689199263235),
  ('oscar-en', 0.08137213783015229),
  ('oscar-zh', 0.055293935695898196),
  ('pt', 0.04954150576361177),
  ('vi', 0.02461641286531197),
  ('zhs', 0.12091748245519074),
  ('zht', 0.0005177025345001541),
)
TR11_TOKENIZER = (
  'bigscience-catalogue-data-dev_byte-level-bpe-tokenizer-no-norm-250k-'
  'whitespace-and-eos-regex-alpha-v3-dedup-lines-articles'
)


def tr11_prefix(name: str) -> str:
  """A dataset's prefix under tr11's merged-meg-ds_v3_pii directory."""
  if name.startswith('oscar-'):
    return f'{name}/meg_ds_{TR11_TOKENIZER}_text_document'
  return f'{name}/{TR11_TOKENIZER}_{name}_text_document'


def tr11_group(name: str, span: str) -> str:
  """One weighted split group of all 28 datasets, as tr11's train-splits.txt wrote it."""
  return f'{name}: ' + ', '.join(
    f'{weight} {span} {tr11_prefix(dataset)}' for dataset, weight in TR11_DATASETS
  )


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
    # With attention_dropout > 0 'auto' runs xla on every device (the fused kernels have none).
    attention_impl='auto',
    # The loss a vocabulary chunk at a time: peak 63.96 GiB vs dense 64.40 GiB per device (plan,
    # CPU compile, 2026-11-24) for one more logits matmul in the backward, ~0.5% of the FLOPs
    # here (estimated; +5.9% measured on bloom_1b3, where the logits weigh 13 times more).
    cross_entropy_impl='chunked',
    # --checkpoint-activations; save_dots would keep every layer's matmul outputs: 320.5 GiB.
    remat_policy='full',
    # Megatron-LM's sequence parallelism: peak 49.60 vs 63.96 GiB per device, the kept stage
    # inputs 3.80 vs 15.20 GiB (plan, CPU compile, 2026-11-24, GPipe order and fp32 stage
    # weights; docs/benchmarks.md).
    sequence_parallel=True,
  )
  c.train = dict(
    steps=0,
    train_samples=220_000_000,
    global_batch_size=2048,
    micro_batch_size=2,
    seq_len=2048,
    seed=42,
    rampup_batch_size=(192, 16, 9_765_625),  # --rampup-batch-size 192 16 9_765_625
    # The ramp-up compiles the step for each of its 117 micro-batch counts. N > 0 rounds them
    # up, the rest padding the pipeline computes: N=8 gives 15 programs, 0.31% of the run's
    # micro-batches padding (docs/pipeline.md, "Batch-size ramp-up"; `python -m t5x_like.plan`
    # times a compilation).
    rampup_microbatch_multiple=0,
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
  # tr11's data: Megatron-DeepSpeed's --train-weighted-split-paths (0:0.950 of each of the 28
  # datasets, by catalogue weight) and --valid-weighted-split-paths (0.950:1.0: the same blend as
  # 'valid', and each dataset alone as 'valid_<name>'), no test set; docs/data.md. data.root is
  # tr11's directory: point it at yours (--config.data.root=/path/to/merged-meg-ds_v3_pii).
  c.data = dict(
    train_path='',
    split='969,30,1',
    valid_path={},
    skip_train_iteration_range=(),
    train_weighted_split_paths=tr11_group('train', '0:0.950'),
    valid_weighted_split_paths=(tr11_group('valid', '0.950:1.0'),)
    + tuple(f'valid_{name}: 1 0.950:1.0 {tr11_prefix(name)}' for name, _ in TR11_DATASETS),
    test_weighted_split_paths=(),
    root='/gpfswork/rech/six/commun/bigscience-training/merged-meg-ds_v3_pii',
  )
  c.eval = dict(interval=1000, iters=1)  # --eval-interval 1000 --eval-iters 1
  c.mesh = dict(data=8, pipeline=12, tensor=4)
  # 1F1B: a stage keeps 23 micro-batches' inputs, not 139 (peak 34.50 vs 40.98 GiB per device
  # with grad_sync='tick', plan, CPU compile, 2026-11-24), at GPipe's bubble and, under 'full',
  # GPipe's FLOPs. grad_sync 'auto' is 'step' for this ZeRO-1 pipeline: each data rank sums its
  # own gradients, which cross the data ranks once an iteration, not at each of the 150 ticks
  # (plan --estimate on tr11's cluster: 114 s an iteration against 2,231), for 58.45 GiB per
  # device instead of 31.36 (2026-11-26).
  c.pipeline = dict(repeats=1, microbatch_group=0, schedule='1f1b', grad_sync='auto')
  # tr11 saved every 100 iterations (about 3 hours) and lost up to that much at each hardware
  # failure; a temporary save each hour bounds the loss to about one (docs/checkpoints.md).
  c.checkpoint = dict(
    save_interval=100,
    save_interval_mins=60.0,
    max_to_keep=3,
    keep_period=0,
    init_from='',
    load_optimizer=True,
    override_lr_scheduler=False,
    load_rng=True,
  )
  # tr11: --exit-duration-in-mins 1190 under SLURM's 20 h limit; set kill_switch_path per run.
  # No progress for 30 minutes (tr11: 105 s iterations, 40 s saves) ends the job with the
  # stacks of every thread (exit 4), instead of the chronicles' hours-long NCCL hangs.
  # Every replicated array's copies compared every 1000 iterations (the chronicles' TP drift).
  # Compiled programs stored in WORKDIR/compilation_cache: a restart loads them (minutes each).
  c.runtime = dict(
    kill_switch_path='',
    exit_duration_mins=1190.0,
    hang_timeout_mins=30.0,
    replica_check_interval=1000,
    compilation_cache_dir='compilation_cache',
  )
  return c
