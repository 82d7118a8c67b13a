"""`python -m t5x_like.from_megatron`: launch scripts in the shapes of the chronicles' runs
(tr8-104B, tr8b-104B with curriculum learning and 8-bit Adam, tr11-176B-ml) become configs."""

import contextlib
import importlib.util
import io
import json
import os

import pytest
from conftest import REPO, run_cli

from t5x_like.cli import from_megatron
from t5x_like.config import Config, load_config_file

# tr8-104B: unmodified Megatron GPT-2 in the 'wide' shape, fp16, batch ramp-up, 32 nodes x 4 GPUs.
TR8_SCRIPT = r"""#!/bin/bash
#SBATCH --job-name=tr8-104B
#SBATCH --constraint=v100-32g
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1          # crucial - only 1 task per dist per node!
#SBATCH --gres=gpu:4                 # number of gpus
#SBATCH --time 20:00:00              # maximum execution time (HH:MM:SS)

set -x -e
source $six_ALL_CCFRWORK/start-prod

OUTPUT_PATH=$six_ALL_CCFRSCRATCH/checkpoints/tr8-104B/
MEGATRON_DEEPSPEED_REPO=$OUTPUT_PATH/code/Megatron-DeepSpeed
VOCAB_FILE=$MEGATRON_DEEPSPEED_REPO/data/gpt2-vocab.json
MERGE_FILE=$MEGATRON_DEEPSPEED_REPO/data/gpt2-merges.txt
DATA_PATH=$six_ALL_CCFRWORK/datasets-custom/oscar-en/meg-gpt2_text_document
CHECKPOINT_PATH=$OUTPUT_PATH/checkpoints

cd $MEGATRON_DEEPSPEED_REPO

MASTER_ADDR=`perl -le '$_=$ENV{"SLURM_JOB_NODELIST"}; s/,.*//; s/-.*//; s/\[//; print'`
MASTER_PORT=6000

GPUS_PER_NODE=4
NNODES=32
PP_SIZE=32 # NLAYERS must be a multiple of PP_SIZE here
TP_SIZE=4
DP_SIZE=$((NNODES*GPUS_PER_NODE/(PP_SIZE*TP_SIZE)))

MICRO_BATCH_SIZE=1
GLOBAL_BATCH_SIZE=2048

NLAYERS=32
NHIDDEN=16384
NHEADS=32
FFN_HIDDEN_SIZE=$((NHIDDEN * 4))
SEQ_LEN=2048
SAVE_INTERVAL=300

OPTIMIZER_ARGS=" \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 6e-5 \
    --min-lr 6e-6 \
    --lr-decay-style cosine \
    --lr-decay-samples 126_953_125 \
    --lr-warmup-samples 216_320 \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    "

EXIT_OPTS=" \
    --exit-duration-in-mins 1190 \
    "

GPT_ARGS=" \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --ffn-hidden-size $FFN_HIDDEN_SIZE \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --rampup-batch-size 32 32 6_000_000 \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples 300_000_000 \
    --vocab-file $VOCAB_FILE \
    --merge-file $MERGE_FILE \
    --init-method-std 0.006 \
    --fp16 \
    --seed 42 \
    --checkpoint-activations \
    $OPTIMIZER_ARGS \
    $EXIT_OPTS \
    "

OUTPUT_ARGS=" \
    --log-interval 1 \
    --save-interval $SAVE_INTERVAL \
    --eval-interval 1000 \
    --eval-iters 5 \
    --tensorboard-dir $OUTPUT_PATH/tensorboard \
    --tensorboard-queue-size 5 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "

ZERO_STAGE=1

config_json="./ds_config.$SLURM_JOBID.json"

# Deepspeed figures out GAS dynamically from dynamic GBS via set_train_batch_size()
cat <<EOT > $config_json
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config ${config_json} \
    --zero-stage ${ZERO_STAGE} \
    --deepspeed-activation-checkpointing \
    "

export LAUNCHER="python -u -m torch.distributed.launch \
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT \
    "

export CMD=" \
    `pwd`/pretrain_gpt.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path $DATA_PATH \
    --data-impl mmap \
    --split 949,50,1 \
    --distributed-backend nccl \
     $DEEPSPEED_ARGS \
    "

echo $CMD

# to debug - add echo (it exits and prints what it would have launched)
srun --jobid $SLURM_JOBID bash -c '$LAUNCHER --node_rank $SLURM_PROCID $CMD' 2>&1 \
    | tee $OUTPUT_PATH/main_log.txt
"""

# tr8b-104B: the 64-layer shape with the sequence-length curriculum (in the DeepSpeed JSON),
# token-based decay, 8-bit Adam and the data skipped past the spikes; 64 nodes x 8 GPUs.
TR8B_SCRIPT = r"""#!/bin/bash
#SBATCH --job-name=tr8b-104B-cl-bnb
#SBATCH --nodes=64
#SBATCH --gres=gpu:8

source $six_ALL_CCFRWORK/start-prod
DATA_PATH=${DATA_PATH:-$six_ALL_CCFRWORK/datasets-custom/oscar-en/meg-gpt2_text_document}
CHECKPOINT_PATH=$six_ALL_CCFRSCRATCH/checkpoints/tr8b-104B/checkpoints/cl-bnb

GPUS_PER_NODE=8
NNODES=$SLURM_NNODES
PP_SIZE=32
TP_SIZE=4

MICRO_BATCH_SIZE=2
GLOBAL_BATCH_SIZE=2048
TRAIN_SAMPLES=600_000_000  # doubled: --train-tokens ends the run
TRAIN_TOKENS=300_000_000_000

NLAYERS=64
NHIDDEN=11600
NHEADS=80
SEQ_LEN=2048
VOCAB_SIZE=50257

SAVE_INTERVAL=150
LR_WARMUP_SAMPLES=3_750_000
LR_DECAY_TOKENS=260_000_000_000  # SEQ_LEN x the samples of the baseline's decay

ZERO_STAGE=${ZERO_STAGE:-1}

OPTIMIZER_ARGS=" \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 6e-5 \
    --min-lr 6e-6 \
    --lr-decay-style cosine \
    --lr-decay-tokens $LR_DECAY_TOKENS \
    --lr-warmup-samples $LR_WARMUP_SAMPLES \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    --use-bnb-optimizer \
    "
GPT_ARGS=" \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples $TRAIN_SAMPLES \
    --train-tokens $TRAIN_TOKENS \
    --vocab-file $six_ALL_CCFRWORK/gpt2-vocab.json \
    --merge-file $six_ALL_CCFRWORK/gpt2-merges.txt \
    --init-method-std 0.006 \
    --fp16 \
    --seed 43 \
    --checkpoint-activations \
    --skip-train-iteration-range 13251-14000 16651-19500 \
    $OPTIMIZER_ARGS \
    "
OUTPUT_ARGS="--log-interval 1 --save-interval $SAVE_INTERVAL --eval-interval 150 --eval-iters 5"

config_json="./ds_config.$SLURM_JOBID.json"
cat <<EOT > $config_json
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1,
    "initial_scale_power": 12
  },
  "curriculum_learning": {
    "enabled": true,
    "curriculum_type": "seqlen",
    "min_difficulty": 64,
    "max_difficulty": $SEQ_LEN,
    "schedule_type": "fixed_linear",
    "schedule_config": {
      "total_curriculum_step": 36000,
      "difficulty_step": 8
    }
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT

DEEPSPEED_ARGS="--deepspeed --deepspeed_config ${config_json} --zero-stage ${ZERO_STAGE}"
DEEPSPEED_ARGS+=" --deepspeed-activation-checkpointing"

export LAUNCHER="python -u -m torch.distributed.launch \
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    "
export CMD=" \
    `pwd`/pretrain_gpt.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --data-path $DATA_PATH \
    --data-impl mmap \
    --split 949,50,1 \
    --distributed-backend nccl \
    $DEEPSPEED_ARGS \
    "
srun --jobid $SLURM_JOBID bash -c "$LAUNCHER --node_rank \$SLURM_PROCID $CMD"
"""

# tr11-176B-ml: BLOOM, the weighted multilingual splits from files the script generates.
TR11_SCRIPT = r"""#!/bin/bash
#SBATCH --job-name=tr11-176B-ml
#SBATCH --partition=gpu_p5
#SBATCH --nodes=48
#SBATCH --ntasks-per-node=1          # crucial - only 1 task per dist per node!
#SBATCH --cpus-per-task=64           # number of cores per tasks
#SBATCH --gres=gpu:8                 # number of gpus
#SBATCH --time 20:00:00              # maximum execution time (HH:MM:SS)

set -x -e

source $six_ALL_CCFRWORK/start-tr11-176B-ml

echo "START TIME: $(date)"

variant=main

DATA_OUTPUT_PATH=$six_ALL_CCFRSCRATCH/checkpoints/tr11-176B-ml
CHECKPOINT_PATH=$DATA_OUTPUT_PATH/checkpoints/$variant
REPO_PATH=$DATA_OUTPUT_PATH/tr11-176B-ml-logs
TENSORBOARD_PATH=$REPO_PATH/tensorboard/$variant
LOGS_PATH=$REPO_PATH/logs/$variant
mkdir -p $LOGS_PATH

MEGATRON_DEEPSPEED_REPO=$six_ALL_CCFRWORK/code/tr11-176B-ml/Megatron-DeepSpeed
cd $MEGATRON_DEEPSPEED_REPO

KILL_SWITCH_PATH=$MEGATRON_DEEPSPEED_REPO/kill-switch-tr11-176B-exp1

BIGSCIENCE_REPO=$six_ALL_CCFRWORK/code/tr11-176B-ml/bigscience
TRAIN_DATA_PATH=$MEGATRON_DEEPSPEED_REPO/data/train-splits.txt
VALID_DATA_PATH=$MEGATRON_DEEPSPEED_REPO/data/valid-splits.txt
CATALOGUE_JSON_PATH=$BIGSCIENCE_REPO/data/catalogue/training_dataset_ratios_nigercongo_v3.json
LOAD_RATIOS_SCRIPT=$BIGSCIENCE_REPO/data/catalogue/load_ratios_meg_ds_format.py
python $LOAD_RATIOS_SCRIPT --dataset-ratios-path $CATALOGUE_JSON_PATH --split train \
    --output-meg-ds-ratio-file $TRAIN_DATA_PATH
python $LOAD_RATIOS_SCRIPT --dataset-ratios-path $CATALOGUE_JSON_PATH --split valid \
    --output-meg-ds-ratio-file $VALID_DATA_PATH

TOKENIZER_NAME_OR_PATH=bigscience-catalogue-data-dev/byte-level-bpe-tokenizer-no-norm-250k
TOKENIZER_NAME_OR_PATH+=-whitespace-and-eos-regex-alpha-v3-dedup-lines-articles

# defining the right environment variables
export TRANSFORMERS_CACHE=$six_ALL_CCFRWORK/models
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1

# so processes know who to talk to
MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)
MASTER_PORT=6000

GPUS_PER_NODE=8
NNODES=$SLURM_NNODES

TP_SIZE=4
PP_SIZE=12

MICRO_BATCH_SIZE=2  # was MBS=1 till GBS=784
GLOBAL_BATCH_SIZE=2048  # 4.2M tokens. It is larger than the initial plan of 3.2M tokens

NHIDDEN=14336
NLAYERS=70
NHEADS=112
SEQ_LEN=2048

SAVE_INTERVAL=100

TRAIN_SAMPLES=220_000_000  # 450B tokens
LR_DECAY_SAMPLES=200_000_000  # Decay for the first 410B tokens then continue at fixed --min-lr
LR_WARMUP_SAMPLES=183_105  # 375M tokens

ZERO_STAGE=0 # important: bf16 must use z0! it implements its own zero stage 1 equivalent

config_json="./ds_config.$SLURM_JOBID.json"

# Deepspeed figures out GAS dynamically from dynamic GBS via set_train_batch_size()
cat <<EOT > $config_json
{
  "train_micro_batch_size_per_gpu": $MICRO_BATCH_SIZE,
  "train_batch_size": $GLOBAL_BATCH_SIZE,
  "gradient_clipping": 1.0,
  "zero_optimization": {
    "stage": $ZERO_STAGE
  },
  "bf16": {
    "enabled": true
  },
  "steps_per_print": 2000,
  "wall_clock_breakdown": false
}
EOT

DEEPSPEED_ARGS=" \
    --deepspeed \
    --deepspeed_config ${config_json} \
    --zero-stage ${ZERO_STAGE} \
    --deepspeed-activation-checkpointing \
    "

export LAUNCHER="python -u -m torch.distributed.run \
    --nproc_per_node $GPUS_PER_NODE \
    --nnodes $NNODES \
    --rdzv_endpoint $MASTER_ADDR:$MASTER_PORT \
    --rdzv_backend c10d \
    --max_restarts 0 \
    --tee 3 \
    "

OPTIMIZER_ARGS=" \
    --optimizer adam \
    --adam-beta1 0.9 \
    --adam-beta2 0.95 \
    --adam-eps 1e-8 \
    --lr 6e-5 \
    --min-lr 6e-6 \
    --lr-decay-style cosine \
    --lr-decay-samples $LR_DECAY_SAMPLES \
    --lr-warmup-samples $LR_WARMUP_SAMPLES \
    --clip-grad 1.0 \
    --weight-decay 1e-1 \
    "
# for 20h 1190, for 100h 5990
#    --exit-duration-in-mins 1190 \
EXIT_OPTS=" \
    --exit-duration-in-mins 1190 \
    "

GPT_ARGS=" \
    --pp-partition-method 'type:transformer|embedding' \
    --num-layers $NLAYERS \
    --hidden-size $NHIDDEN \
    --num-attention-heads $NHEADS \
    --seq-length $SEQ_LEN \
    --max-position-embeddings $SEQ_LEN \
    --micro-batch-size $MICRO_BATCH_SIZE \
    --rampup-batch-size 192 16 9_765_625 \
    --global-batch-size $GLOBAL_BATCH_SIZE \
    --train-samples $TRAIN_SAMPLES \
    --tokenizer-type PretrainedFromHF \
    --tokenizer-name-or-path $TOKENIZER_NAME_OR_PATH \
    --init-method-std 0.0048 \
    --embed-layernorm \
    --sync-tp-duplicated-parameters \
    --bf16 \
    --seed 42 \
    --position-embedding-type alibi \
    --checkpoint-activations \
    --abort-on-unmet-fused-kernel-constraints \
    --kill-switch-path $KILL_SWITCH_PATH \
    --pad-vocab-size-to 250880 \
    $OPTIMIZER_ARGS \
    $EXIT_OPTS \
    "

OUTPUT_ARGS=" \
    --log-interval 1 \
    --save-interval $SAVE_INTERVAL \
    --eval-interval 1000 \
    --eval-iters 1 \
    --tensorboard-dir $TENSORBOARD_PATH \
    --tensorboard-queue-size 5 \
    --log-timers-to-tensorboard \
    --log-batch-size-to-tensorboard \
    --log-validation-ppl-to-tensorboard \
    "

export CMD=" \
    `pwd`/pretrain_gpt.py \
    --tensor-model-parallel-size $TP_SIZE \
    --pipeline-model-parallel-size $PP_SIZE \
    $GPT_ARGS \
    $OUTPUT_ARGS \
    --save $CHECKPOINT_PATH \
    --load $CHECKPOINT_PATH \
    --train-weighted-split-paths-path $TRAIN_DATA_PATH \
    --valid-weighted-split-paths-path $VALID_DATA_PATH \
    --data-impl mmap \
    --distributed-backend nccl \
     $DEEPSPEED_ARGS \
    "

echo $CMD

# do not remove or the training will hang and nodes will be lost w/o this workaround
export CUDA_LAUNCH_BLOCKING=1

# force crashing on nccl issues like hanging broadcast
export NCCL_ASYNC_ERROR_HANDLING=1

clear; srun --jobid $SLURM_JOBID bash -c "$LAUNCHER --node_rank \$SLURM_PROCID $CMD" 2>&1 \
    | tee -a $LOGS_PATH/main_log.txt

echo "END TIME: $(date)"
"""

BLOOM_CONFIG = os.path.join(REPO, 'configs', 'bloom_176b.py')


def convert_file(tmp_path, text, *sets, name='run.slurm'):
  """(exit code, config dict, report) of the command on `text`; stderr is the report."""
  script = tmp_path / name
  script.write_text(text)
  out = tmp_path / f'{name}.py'
  # --overwrite: a test may convert several scripts into the same file.
  args = [str(script), '--out', str(out), '--overwrite']
  for s in sets:
    args += ['--set', s]
  err = io.StringIO()
  with contextlib.redirect_stderr(err):
    code = from_megatron.main(args)
  return code, config_sections(out) if out.exists() else None, err.getvalue(), out


def config_sections(path):
  """The sections and keys a config file sets (its get_config(), as a dict)."""
  spec = importlib.util.spec_from_file_location('config_file', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config().to_dict()


def tr11_files(tmp_path):
  """The split files tr11's script generates (load_ratios_meg_ds_format.py: one quoted group a
  line), here with configs/bloom_176b.py's groups, where the script's paths point once
  six_ALL_CCFRWORK=tmp_path."""
  data = tmp_path / 'code' / 'tr11-176B-ml' / 'Megatron-DeepSpeed' / 'data'
  data.mkdir(parents=True)
  bloom = load_config_file(BLOOM_CONFIG).data
  for name, groups in (
    ('train', bloom.train_weighted_split_paths),
    ('valid', bloom.valid_weighted_split_paths),
  ):
    (data / f'{name}-splits.txt').write_text(''.join(f'"{g}"\n' for g in groups))
  return f'six_ALL_CCFRWORK={tmp_path}'


def typed(section, key, value):
  """A config value as the loader types it (a one-group string becomes a tuple, ...)."""
  return getattr(getattr(Config.from_dict({section: {key: value}}), section), key)


TR8_EXPECTED = {
  'model': dict(
    architecture='gpt2',
    num_layers=32,
    hidden_size=16384,
    num_heads=32,
    ffn_hidden_size=65536,
    vocab_size=50257,
    pad_vocab_size_to=0,
    max_position_embeddings=2048,
    layernorm_epsilon=1e-5,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    init_std=0.006,
    dtype='bfloat16',
    remat_policy='full',
  ),
  'train': dict(
    steps=0,
    train_samples=300_000_000,
    global_batch_size=2048,
    micro_batch_size=1,
    seq_len=2048,
    seed=42,
    rampup_batch_size=(32, 32, 6_000_000),
  ),
  'optimizer': dict(
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
    decay_tokens=0,
  ),
  'data': dict(
    train_path='/data/datasets-custom/oscar-en/meg-gpt2_text_document',
    split='949,50,1',
    skip_train_iteration_range=(),
  ),
  'eval': dict(interval=1000, iters=5),
  'mesh': dict(data=1, pipeline=32, tensor=4),
  'checkpoint': dict(
    save_interval=300, load_optimizer=True, override_lr_scheduler=False, load_rng=True
  ),
  'runtime': dict(exit_duration_mins=1190.0, kill_switch_path=''),
}

TR8B_EXPECTED = {
  'model': dict(
    architecture='gpt2',
    num_layers=64,
    hidden_size=11600,
    num_heads=80,
    ffn_hidden_size=0,
    vocab_size=50257,
    pad_vocab_size_to=0,
    max_position_embeddings=2048,
    layernorm_epsilon=1e-5,
    hidden_dropout=0.1,
    attention_dropout=0.1,
    init_std=0.006,
    dtype='bfloat16',
    remat_policy='full',
    stable_embedding=True,
  ),
  'train': dict(
    steps=0,
    train_samples=600_000_000,
    global_batch_size=2048,
    micro_batch_size=2,
    seq_len=2048,
    seed=43,
    rampup_batch_size=(),
  ),
  'optimizer': dict(
    lr=6e-5,
    min_lr=6e-6,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    clip_grad=1.0,
    warmup_samples=3_750_000,
    decay_samples=600_000_000,
    decay_style='cosine',
    decay_tokens=260_000_000_000,
    name='adamw_8bit',
  ),
  'curriculum': dict(
    min_seq_len=64, total_iterations=36000, difficulty_step=8, schedule='fixed_linear'
  ),
  'data': dict(
    train_path='/data/datasets-custom/oscar-en/meg-gpt2_text_document',
    split='949,50,1',
    skip_train_iteration_range=('13251-14000', '16651-19500'),
  ),
  'eval': dict(interval=150, iters=5),
  'mesh': dict(data=4, pipeline=32, tensor=4),
  'checkpoint': dict(
    save_interval=150, load_optimizer=True, override_lr_scheduler=False, load_rng=True
  ),
  'runtime': dict(exit_duration_mins=0.0, kill_switch_path=''),
}


def test_tr8_baseline_converts_key_by_key_and_reports_fp16(tmp_path):
  code, raw, report, _ = convert_file(tmp_path, TR8_SCRIPT, 'six_ALL_CCFRWORK=/data')
  assert raw == TR8_EXPECTED
  # fp16 has no equivalent here (no loss scaling): the closest setting is written, exit code 1.
  assert code == 1
  not_mapped = report.split('NOT MAPPED (1):')[1]
  assert '--fp16: fp16 needs dynamic loss scaling' in not_mapped
  assert '--checkpoint-activations -> model.remat_policy = ' in report
  assert '32 nodes x 4 GPUs / (4 x 32) -> mesh.data = 1' in report
  assert '(default) --hidden-dropout 0.1 -> model.hidden_dropout = 0.1' in report
  assert 'DeepSpeed train_batch_size: 2048: duplicates --global-batch-size' in report


def test_tr8b_curriculum_and_bnb_convert_and_report_what_is_missing(tmp_path):
  code, raw, report, out = convert_file(tmp_path, TR8B_SCRIPT, 'six_ALL_CCFRWORK=/data')
  assert raw == TR8B_EXPECTED
  assert code == 1
  not_mapped = report.split('NOT MAPPED (2):')[1]
  # bnb's Adam8bit and StableEmbedding map (gpt2 gains the embedding LayerNorm).
  assert "--use-bnb-optimizer -> optimizer.name = 'adamw_8bit'" in report
  assert '--use-bnb-optimizer -> model.stable_embedding = True' in report
  assert '--fp16:' in not_mapped and '--train-tokens 300_000_000_000:' in not_mapped
  assert '-> mesh.data = 4' in report  # $SLURM_NNODES from #SBATCH --nodes=64
  assert '# NOT MAPPED' in out.read_text()


def test_bnb_optimizer_on_bloom_maps_to_8bit_adam_and_stable_embedding(tmp_path):
  script = TR11_SCRIPT.replace(
    '    --embed-layernorm \\\n', '    --embed-layernorm \\\n    --use-bnb-optimizer \\\n'
  )
  assert '--use-bnb-optimizer' in script
  code, raw, report, _ = convert_file(tmp_path, script, tr11_files(tmp_path))
  assert code == 0, report
  assert raw['optimizer']['name'] == 'adamw_8bit' and raw['model']['stable_embedding'] is True
  assert '--use-bnb-optimizer -> model.stable_embedding = True' in report


def test_tr11_converts_to_configs_bloom_176b_on_every_shared_key(tmp_path):
  code, raw, report, _ = convert_file(tmp_path, TR11_SCRIPT, tr11_files(tmp_path))
  assert code == 0, report
  reference = config_sections(BLOOM_CONFIG)
  shared = [(s, k) for s in raw for k in raw[s] if k in (reference.get(s) or {})]
  assert len(shared) >= 40
  differ = {
    f'{s}.{k}': (raw[s][k], reference[s][k])
    for s, k in shared
    if typed(s, k, raw[s][k]) != typed(s, k, reference[s][k])
  }
  # The kill switch is a path given with --set; every other shared key is the same.
  assert differ == {
    'runtime.kill_switch_path': (
      str(tmp_path / 'code/tr11-176B-ml/Megatron-DeepSpeed/kill-switch-tr11-176B-exp1'),
      '',
    )
  }
  assert {'train_weighted_split_paths', 'valid_weighted_split_paths'} <= set(raw['data'])
  assert len(raw['data']['valid_weighted_split_paths']) == 29  # the blend and 28 languages
  assert raw['mesh'] == dict(data=8, pipeline=12, tensor=4)
  assert '--pp-partition-method type:transformer|embedding: stages hold' in report


# The tiny model's shape and scale over a converted config: what each run's own script sets
# stays (architecture, seed, betas, dropout, the optimizer and curriculum kinds).
TINY_SHAPE = [
  'model.num_layers=1',
  'model.hidden_size=32',
  'model.num_heads=4',
  'model.ffn_hidden_size=0',
  'model.vocab_size=8192',
  'model.pad_vocab_size_to=0',
  'model.dtype=float32',
  'model.remat_policy=none',
  'train.train_samples=0',
  'train.steps=2',
  'train.seq_len=32',
  'train.global_batch_size=4',
  'train.micro_batch_size=2',
  'train.rampup_batch_size=()',
  'optimizer.warmup_samples=4',
  'optimizer.decay_samples=8',
  'mesh.data=1',
  'mesh.pipeline=1',
  'mesh.tensor=1',
  'eval.interval=0',
  'checkpoint.save_interval=0',
  'runtime.kill_switch_path=',
  'runtime.exit_duration_mins=0',
  'runtime.tensorboard_dir=',  # clu's writer imports TensorFlow (docs/tests.md)
]
# Each run's data and schedule scaled to the embedded corpus and 2 iterations of 32 tokens.
EMBEDDED_DATA = {
  'tr8': ['data.train_path=', 'data.split=959,30,11'],
  'tr8b': [
    'data.train_path=',
    'data.split=959,30,11',
    'optimizer.decay_tokens=256',
    'curriculum.min_seq_len=8',
    'curriculum.total_iterations=2',
  ],
  'tr11': ['data.train_weighted_split_paths=()', 'data.valid_weighted_split_paths=()'],
}


@pytest.mark.parametrize('run', ['tr8', 'tr8b', 'tr11'])
def test_converted_config_trains_the_tiny_model(tmp_path, run):
  script, sets, expected = {
    'tr8': (TR8_SCRIPT, ['six_ALL_CCFRWORK=/data'], TR8_EXPECTED),
    'tr8b': (TR8B_SCRIPT, ['six_ALL_CCFRWORK=/data'], TR8B_EXPECTED),
    'tr11': (TR11_SCRIPT, [tr11_files(tmp_path)], None),
  }[run]
  code, raw, report, out = convert_file(tmp_path, script, *sets)
  assert code in (0, 1), report  # tr8 and tr8b report their fp16 (exit code 1)
  workdir = tmp_path / 'run'
  overrides = [f'--config.{o}' for o in TINY_SHAPE + EMBEDDED_DATA[run]]
  r = run_cli(['-m', 't5x_like.train', '--config', str(out), '--workdir', str(workdir), *overrides])
  assert r.returncode == 0, r.stderr[-3000:]
  with open(workdir / 'metrics.jsonl') as f:
    rows = [json.loads(line) for line in f]
  assert [row['iteration'] for row in rows] == [1, 2]
  with open(workdir / 'config.json') as f:
    recorded = json.load(f)
  # What the conversion set and the overrides left alone reached the run.
  kept = [
    (section, key)
    for section, key in (
      ('train', 'seed'),
      ('model', 'architecture'),
      ('optimizer', 'beta2'),
      ('optimizer', 'name'),
      ('model', 'hidden_dropout'),
      ('data', 'skip_train_iteration_range'),
    )
    if key in raw[section]
  ]
  assert len(kept) >= 4
  for section, key in kept:
    want = raw[section][key]
    assert recorded[section][key] == (list(want) if isinstance(want, tuple) else want), key
  if expected is not None:
    assert recorded['model']['architecture'] == expected['model']['architecture'] == 'gpt2'
  if run == 'tr8b':  # bnb's 8-bit Adam, StableEmbedding and the DeepSpeed JSON's curriculum
    assert recorded['optimizer']['name'] == 'adamw_8bit' and recorded['model']['stable_embedding']
    assert recorded['curriculum']['schedule'] == 'fixed_linear'
    assert rows[0]['seq_len'] < rows[1]['seq_len'] == 32
  if run == 'tr11':
    assert recorded['train']['seed'] == 42 and recorded['model']['architecture'] == 'bloom'
    assert recorded['optimizer']['beta2'] == 0.95 and recorded['model']['hidden_dropout'] == 0.1


MINIMAL = """NLAYERS=${NLAYERS:-2}
deepspeed --num_nodes 1 --num_gpus 2 pretrain_gpt.py --num-layers $NLAYERS --hidden-size 64 \\
  --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 \\
  --global-batch-size 8 --train-iters 10 --lr 1e-3 --vocab-file v.json --merge-file m.txt \\
  --train-weighted-split-paths "train: 0.6 0:0.9 /d/a, 0.4 0:0.9 /d/b" \\
  --valid-weighted-split-paths "valid_a: 1 0.9:1 /d/a" "valid_b: 1 0.9:1 /d/b" {extra}
"""


def test_a_flag_it_cannot_map_is_reported_and_sets_exit_code_1(tmp_path):
  code, raw, report, _ = convert_file(tmp_path, MINIMAL.replace('{extra}', ''))
  assert code == 0, report
  assert 'NOT MAPPED' not in report
  assert raw['train']['steps'] == 10 and raw['mesh']['data'] == 2
  # Megatron's iteration-based decay defaults to --train-iters x the global batch.
  assert raw['optimizer']['decay_samples'] == 80
  assert raw['data']['train_weighted_split_paths'] == ('train: 0.6 0:0.9 /d/a, 0.4 0:0.9 /d/b',)
  assert raw['data']['valid_weighted_split_paths'] == (
    'valid_a: 1 0.9:1 /d/a',
    'valid_b: 1 0.9:1 /d/b',
  )
  assert 'split' not in raw['data']  # Megatron has no --split with weighted split paths
  code, raw, report, _ = convert_file(
    tmp_path, MINIMAL.replace('{extra}', '--glu-activation swiglu')
  )
  assert code == 1
  assert report.split('NOT MAPPED (1):\n')[1].startswith(
    '  --glu-activation swiglu: the MLP here is GeLU'
  )
  code, _, report, _ = convert_file(tmp_path, MINIMAL.replace('{extra}', '--some-new-flag 3'))
  assert code == 1 and '--some-new-flag 3: no rule for this flag here' in report


def test_shell_subset():
  shell = from_megatron.read_script(
    r"""#SBATCH --nodes=3
A=${A:-7}  # comment
B=${UNSET:-x}$A
export C="a \
b"; D=$((A * 2 + 1)) E='$A'
GROUP=" --x $A \
  --y 'q r' "
F=${F:=$A}
cat <<EOT > /tmp/out.json
{"a": $A, "b": "$B"}
EOT
G=$(date)/x
P=$HOME
echo run $GROUP
""",
    {'A': '5', 'P': 'kept'},
  )
  v = shell.variables
  assert shell.lookup('A') == '5'  # --set wins over the script's assignment
  assert (v['B'], v['C'], v['D'], v['E'], v['F']) == ('x5', 'a b', '11', '$A', '5')
  assert v['SLURM_NNODES'] == '3'
  assert shell.lookup('P') == 'kept' and shell.overridden
  assert json.loads(shell.files['/tmp/out.json']) == {'a': 5, 'b': 'x5'}
  assert from_megatron.unknowns(v['G']) == ['$(date)']
  assert shell.commands[-1].words == ['echo', 'run', '--x', '5', '--y', "'q", "r'"]


@pytest.mark.parametrize(
  'text, message',
  [
    ('if [ -z "$A" ]; then A=1; fi\npython pretrain_gpt.py --lr 1\n', 'line 1: "if" blocks'),
    ('A="open\npython pretrain_gpt.py\n', 'line 1: a double quote is never closed'),
    ('python train.py --lr 1\n', 'no command runs pretrain_gpt.py'),
    (
      'cat <<EOT > c.json\n{"a": $X}\nEOT\npython pretrain_gpt.py --deepspeed_config c.json\n',
      'the DeepSpeed config c.json is not JSON',
    ),
  ],
)
def test_a_script_it_cannot_read_exits_2_with_one_message(tmp_path, capsys, text, message):
  script = tmp_path / 'bad.slurm'
  script.write_text(text)
  assert from_megatron.main([str(script), '--out', str(tmp_path / 'c.py')]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and message in err and err.count('\n') == 1
  assert not (tmp_path / 'c.py').exists()


def test_written_config_loads_with_the_config_loader(tmp_path):
  _, _, _, out = convert_file(tmp_path, TR8_SCRIPT, 'six_ALL_CCFRWORK=/data')
  cfg = load_config_file(str(out))
  assert cfg.model.dtype == 'bfloat16' and cfg.mesh.pipeline == 32 and cfg.eval.iters == 5


def test_an_existing_out_file_is_kept_unless_overwrite(tmp_path, capsys):
  """As `data preprocess` does: an existing --out is an error (exit 2, one message, the file
  untouched, nothing converted) until --overwrite says to replace it."""
  script = tmp_path / 'run.slurm'
  script.write_text(MINIMAL.replace('{extra}', ''))
  out = tmp_path / 'mine.py'
  out.write_text('# my edited config\n')
  assert from_megatron.main([str(script), '--out', str(out)]) == 2
  captured = capsys.readouterr()
  assert (
    captured.err
    == (
      f'error: --out {out} already exists; pass --overwrite to replace it or choose another --out\n'
    )
    and captured.out == ''
  )
  assert out.read_text() == '# my edited config\n'
  assert from_megatron.main([str(script), '--out', str(out), '--overwrite']) == 0
  assert config_sections(out)['train']['steps'] == 10
