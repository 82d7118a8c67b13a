"""The one typed, validated configuration of a run.

Two front ends produce the same `Config`:

* ml_collections config files (`configs/*.py` with `get_config()`), overridden on the command line
  with `--config.section.key=value`;
* gin files (`configs/*.gin`) that bind `section.key = value`, overridden with `--gin_bindings`.

Both are turned into frozen dataclasses here and validated once at start-up
(`startup.check_config`: `Config.validate` here, then the checks of the modules that own the mesh,
the attention kernels, the schedule and the data); the rest of the code trusts the result.
Unknown keys are errors, never silently ignored. This module is a leaf: it imports nothing of the
package but errors.py, so that every module can import it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import typing
from typing import Any, Literal

from t5x_like.errors import ConfigError  # re-exported: config.ConfigError is public

# What each key may hold is declared with the key, and `Config.check_values` checks it once:
#
# * its type: the type of its default (an int where a float is wanted is a float);
# * a `Literal[...]` annotation: the values it may take, read back by `allowed_values`;
# * a number's range, `_ranged(default, lowest, highest, bounds)`: bounds '[' or '(' for whether
#   lowest is allowed and ']' or ')' for highest, read back by `numeric_range`. A number declared
#   without one must be >= 0 (counts, intervals, durations). Every float must be finite.
#
# `Config.validate` then checks what relates keys to each other, one method per section.

_INF = math.inf


def _ranged(default: float, low: float, high: float = _INF, bounds: str = '[]') -> Any:
  """A numeric field with its default and the range [low, high] (per `bounds`) it must be in."""
  return dataclasses.field(default=default, metadata={'range': (low, high, bounds)})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  # 'bloom': ALiBi, embedding LayerNorm.
  # 'gpt2': learned absolute positions, no embedding LayerNorm.
  architecture: Literal['bloom', 'gpt2'] = 'bloom'
  num_layers: int = _ranged(2, 1)
  hidden_size: int = _ranged(64, 1)
  num_heads: int = _ranged(4, 1)
  ffn_hidden_size: int = 0  # 0 means 4 * hidden_size.
  vocab_size: int = _ranged(256, 1)  # Real tokens; the embedding is padded (see padded_vocab_size).
  # 0: pad to a multiple of 128 * mesh.tensor (Megatron's --make-vocab-size-divisible-by).
  pad_vocab_size_to: int = 0
  max_position_embeddings: int = _ranged(2048, 1)  # gpt2 only.
  layernorm_epsilon: float = _ranged(1e-5, 0, bounds='(]')  # 0: 0/0 on a constant input
  hidden_dropout: float = _ranged(0.0, 0, 1, '[)')
  attention_dropout: float = _ranged(0.0, 0, 1, '[)')
  # Std of all weights; output projections use init_std / sqrt(2 * num_layers). 0: sqrt(1/(3h)).
  init_std: float = 0.0
  dtype: str = 'float32'  # Compute dtype, 'float32' or 'bfloat16'; params stay fp32.
  # 'xla': plain JAX (the reference); 'pallas': the fused flash-attention kernels of
  # t5x_like.kernels (Triton on GPU, interpret mode on CPU); 'cudnn': jax.nn.dot_product_attention
  # on cuDNN (GPU only, materialised ALiBi bias); 'tokamax': tokamax.dot_product_attention (Mosaic
  # GPU kernels from compute capability 9.0, Triton below, XLA on CPU); 'mosaic': our Mosaic GPU
  # kernels for Hopper (compute capability 9.0; interpret mode on CPU). The fused ones have no
  # attention dropout. 'auto': the fastest of them that runs the model on the device it runs on
  # (model/attention.py's AUTO_ORDER; 'xla' on CPU, and wherever attention_dropout > 0).
  attention_impl: Literal['auto', 'xla', 'pallas', 'cudnn', 'tokamax', 'mosaic'] = 'auto'
  # False: a fused attention_impl that cannot run this shape/dtype/platform is an error naming the
  # constraint (Megatron's --abort-on-unmet-fused-kernel-constraints). True: warn and run 'xla'.
  attention_fallback: bool = False
  # 'dense': full fp32 logits then the loss. 'chunked': the loss from the final hidden states and
  # the tied embedding, cross_entropy_chunk vocabulary rows at a time (never tokens x vocab fp32).
  # 'fused': the loss and its gradient in one forward pass, cross_entropy_chunk tokens at a time
  # (no recomputation; fastest on CPU; with mesh.pipeline > 1 only under pipeline.schedule='1f1b').
  cross_entropy_impl: Literal['dense', 'chunked', 'fused'] = 'dense'
  cross_entropy_chunk: int = _ranged(4096, 1)
  # 'none': keep every activation; 'full': recompute each block in backward;
  # 'save_dots': keep matmul outputs, recompute the rest.
  remat_policy: Literal['none', 'full', 'save_dots'] = 'none'
  # Unroll the layer, micro-batch and pipeline scans. Compile time then grows with depth; XLA's
  # cost analysis counts a loop body once, so `plan --unroll` uses this to count every FLOP.
  scan_unroll: bool = False
  # Unroll the layer scan only, in training (the params keep their stacked layout; the
  # micro-batch and pipeline loops stay loops). XLA then drops the scan's per-layer slices of the
  # weights, its stacked residuals and their zero fills, and merges the layers' recomputation
  # into their forward (so 'full' is refused with it): a faster step for more memory, and a longer
  # compile (the figures: docs/benchmarks.md, "The GPU suite").
  unroll_layers: bool = False
  # Megatron-LM's sequence parallelism: between the tensor-parallel matmuls the residual stream,
  # LayerNorms and dropout (and the pipeline's kept stage inputs) are split over mesh.tensor
  # along the sequence; all-gather before QKV / h->4h, reduce-scatter after attn-out / 4h->h.
  sequence_parallel: bool = False
  # bitsandbytes' StableEmbedding (what Megatron-DeepSpeed's --use-bnb-optimizer uses): a
  # Xavier-uniform embedding (fan of the whole padded vocabulary, however it is split), the
  # embedding LayerNorm (bloom's; gpt2 gains one, before its positions are added), and fp32
  # optimizer state for the embedding under adamw_8bit.
  stable_embedding: bool = False

  @property
  def ffn_size(self) -> int:
    return self.ffn_hidden_size or 4 * self.hidden_size

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def weight_init_std(self) -> float:
    return self.init_std or math.sqrt(1.0 / (3 * self.hidden_size))

  def padded_vocab_size(self, tensor: int) -> int:
    if self.pad_vocab_size_to:
      return self.pad_vocab_size_to
    multiple = 128 * tensor
    return -(-self.vocab_size // multiple) * multiple

  def num_params(self, tensor: int = 1) -> int:
    """Megatron's model-size formula (padded vocabulary, learned positions for gpt2)."""
    h, L = self.hidden_size, self.num_layers
    ffn = self.ffn_size
    block = 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h  # attn, mlp, two LNs
    total = L * block + self.padded_vocab_size(tensor) * h + 2 * h
    if self.architecture == 'gpt2':
      total += self.max_position_embeddings * h
    if self.architecture == 'bloom' or self.stable_embedding:
      total += 2 * h  # embedding LayerNorm
    return total


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 0  # Cap on iterations; 0 means no cap (then train_samples must be set).
  train_samples: int = 0  # Megatron's --train-samples; 0 means no sample-based stop.
  global_batch_size: int = _ranged(8, 1)
  micro_batch_size: int = _ranged(4, 1)
  seq_len: int = _ranged(64, 1)
  # jax.random.PRNGKey without 64-bit mode keeps 32 bits: 2**32 would be the same key as 0.
  seed: int = _ranged(1234, 0, 2**32 - 1)
  # Megatron's --rampup-batch-size START INCREMENT SAMPLES; () means no ramp-up.
  rampup_batch_size: tuple = ()
  # 0: the step is compiled for every micro-batch count of the ramp-up (tr11's: 117 programs of a
  # 176B pipelined step). N > 0: the step runs each count rounded up to a multiple of N (at most
  # the full batch's), the added micro-batches all padding (losses.PAD_ID) outside the loss, so
  # the ramp-up compiles about (full count - first count) / N programs. The same losses and
  # gradients either way; the pipeline computes the padding micro-batches, the non-pipelined
  # step skips them.
  rampup_microbatch_multiple: int = 0
  # The ramp-up and the run's length in iterations and samples: t5x_like/training/schedule.py.


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  lr: float = 1e-3
  min_lr: float = 1e-4
  beta1: float = _ranged(0.9, 0, 1, '[)')
  beta2: float = _ranged(0.95, 0, 1, '[)')
  eps: float = _ranged(1e-8, 0, bounds='(]')  # 0: 0/0 for a parameter whose gradient is 0
  weight_decay: float = 0.1
  clip_grad: float = 1.0  # Global-norm clipping threshold; 0 disables clipping.
  warmup_samples: int = 0
  decay_samples: int = 0  # Samples at which the decay reaches min_lr; 0 means no decay.
  decay_style: Literal['cosine', 'linear', 'constant'] = 'cosine'
  # Megatron's --lr-decay-tokens: > 0 decays by consumed tokens instead of samples, from the
  # tokens consumed when the (sample-based) warm-up ends to this many (the curriculum runs of
  # tr8b, whose early iterations hold fewer tokens per sample). 0: decay by samples.
  decay_tokens: int = 0
  # 'adamw': fp32 Adam moments (8 bytes per param). 'adamw_8bit': both moments as 8-bit codes
  # with block-wise dynamic quantisation (bitsandbytes' Adam8bit; about 2 bytes per param):
  # blocks of quant_block_size values, one fp32 absmax each; tensors with fewer than
  # quant_min_size values per layer keep fp32 moments (t5x_like/optim/quantized_adam.py).
  name: Literal['adamw', 'adamw_8bit'] = 'adamw'
  # One of QUANT_BLOCK_SIZES. 256: more blocks split evenly over more shards (BLOOM-176B's hidden
  # 14336 is 56 blocks, 7 of 2048), docs/benchmarks.md's plan figures.
  quant_block_size: int = 256
  quant_min_size: int = 4096


# The block sizes optimizer.quant_block_size may take (bitsandbytes' block-wise kernels' range).
QUANT_BLOCK_SIZES = (256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """Sequence-length curriculum (DeepSpeed's `curriculum_type: seqlen`, tr8b's runs): iteration
  n trains on the first `seq_len_at(n)` tokens of each sample, rising from min_seq_len to
  train.seq_len over total_iterations; evaluation always uses the full length."""

  min_seq_len: int = 0  # DeepSpeed's min_difficulty; 0: no curriculum.
  total_iterations: int = 0  # total_curriculum_step: iterations until train.seq_len.
  difficulty_step: int = _ranged(8, 1)  # Every length is a multiple of this (tensor-core shapes).
  # 'fixed_linear', or 'fixed_root': the length follows (n / total_iterations) ** (1/root_degree).
  schedule: Literal['fixed_linear', 'fixed_root'] = 'fixed_linear'
  root_degree: int = _ranged(2, 1)  # fixed_root only.
  # 0: the step is compiled for every length (tr8b's settings: 249 compilations). N > 0: each
  # iteration runs at its length rounded up to a multiple of N (at most train.seq_len), the extra
  # positions padding outside the loss (losses.PAD_ID), so at most seq_len / N programs are
  # compiled, for the padding's compute. The same losses and gradients either way.
  pad_to_multiple: int = 0

  @property
  def enabled(self) -> bool:
    return self.min_seq_len > 0

  # The lengths it gives each iteration: t5x_like/training/schedule.py.


@dataclasses.dataclass(frozen=True)
class DataConfig:
  # Megatron's --data-path: 'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...', each PREFIX naming a
  # PREFIX.bin + PREFIX.idx pair (Megatron's mmap format). '': the embedded default corpus.
  train_path: str = ''
  # Megatron's --split: train,valid,test shares of each dataset's documents, in file order.
  split: str = '969,30,1'
  # Further validation sets, each read whole: {name: data path}, stored as ((name, path), ...).
  valid_path: tuple = ()
  # Megatron's --skip-train-iteration-range: ('A-B', ...), iterations (1-based, inclusive) whose
  # data is consumed but not trained on.
  skip_train_iteration_range: tuple = ()
  # Megatron-DeepSpeed's --(train|valid|test)-weighted-split-paths, instead of train_path and
  # split: one group 'NAME: W1 START:END PREFIX1, W2 START:END PREFIX2, ...' (a string) or several
  # (a tuple of strings); START:END are fractions of each dataset's documents. Train takes one
  # group; each valid group is a named validation set (docs/data.md).
  train_weighted_split_paths: tuple = ()
  valid_weighted_split_paths: tuple = ()
  test_weighted_split_paths: tuple = ()
  # The directory that relative prefixes of the weighted split paths are read under; '': as given.
  root: str = ''
  # A registered seqio Task or Mixture to train on, instead of train_path and split: a Mixture's
  # rates are the blend weights, each Task's validation splits named validation sets. It is
  # materialised once into .bin/.idx under cache_dir (docs/data.md, "seqio Tasks and Mixtures").
  mixture_or_task: str = ''
  # A module that registers the user's Tasks and Mixtures, imported before the name is looked
  # up (t5x's MIXTURE_OR_TASK_MODULE); the project's own (data/seqio_tasks.py) always are.
  mixture_or_task_module: str = ''
  # Where materialised Tasks are kept; '': $T5X_LIKE_CACHE or ~/.cache/t5x_like, under seqio/.
  cache_dir: str = ''
  # How a blend orders its datasets' samples (data/blending.py): 'quota', every prefix within one
  # sample of each weight; 'divisor', the order of runs started before it. A resumed run keeps
  # its checkpoint's order; a recorded config without this key had 'divisor'.
  blend_order: Literal['quota', 'divisor'] = 'quota'

  def skip_ranges(self) -> list[tuple[int, int]]:
    """skip_train_iteration_range as [(first, last)]; a ConfigError names a bad one."""
    return [
      iteration_range('data.skip_train_iteration_range', r, '("13251-14000",)')
      for r in self.skip_train_iteration_range
    ]

  def skips(self, iteration: int) -> bool:
    return any(a <= iteration <= b for a, b in self.skip_ranges())


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  interval: int = 0  # Iterations between evaluations of the validation sets; 0: none.
  iters: int = _ranged(
    1, 1
  )  # Batches (of the current global batch size) per validation set and evaluation.
  # lm-evaluation-harness tasks run on the live params during training (docs/evaluation.md),
  # comma-separated ('' for none): every harness_interval iterations (0: only at the end), on
  # at most harness_limit documents per task (0: all), with the task YAMLs of
  # harness_include_path besides the harness's own.
  harness_tasks: str = ''
  harness_interval: int = _ranged(0, 0)
  harness_limit: int = _ranged(0, 0)
  harness_include_path: str = ''
  harness_batch_size: int = _ranged(8, 1)  # Requests per batch of the harness backend.
  # The tokenizer the run's data was tokenized with, for the harness's text: a tokenizer.json
  # or a SentencePiece .model file ('': the shipped one, the embedded corpus's).
  harness_tokenizer: str = ''


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  data: int = _ranged(1, 1)
  pipeline: int = _ranged(1, 1)
  tensor: int = _ranged(1, 1)
  # How the fp32 state is split over `data` (docs/parallelism.md). 1: ZeRO-1, the fp32 master
  # params and Adam moments are split and the step gathers one compute-dtype copy of the whole
  # model. 3: ZeRO-3 (fully sharded), the compute-dtype copy stays split too: each layer's
  # weights are gathered just before use and freed after, and its gradients reduce-scattered.
  zero_stage: Literal[1, 3] = 1
  # Data ranks that split one copy of the state (hybrid sharding); the data // zero_group copies
  # are replicated, so the gathers stay inside a group (a node). 0: all of `data`.
  zero_group: int = _ranged(0, 0)

  @property
  def zero_group_size(self) -> int:
    """Data ranks one copy of the state is split over (mesh.zero_group, 0 meaning all)."""
    return self.zero_group or self.data

  @property
  def num_devices(self) -> int:
    return self.data * self.pipeline * self.tensor


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  # Circular (interleaved) schedule: each stage holds `repeats` groups of layers and micro-batches
  # loop `repeats` times, shrinking the bubble to (P-1)/(M*repeats + P-1).
  repeats: int = _ranged(1, 1)
  # 0: one schedule over all M micro-batches (each one's stage inputs kept until the backward
  # pass). G > 0: the step runs the schedule over groups of G micro-batches one after another,
  # each group's forward and backward done before the next starts, so only G*repeats + P-1
  # ticks of stage inputs are kept, at a bubble of (P-1)/(G*repeats + P-1). G >= P, and G must
  # divide every micro-batch count of the run.
  microbatch_group: int = 0
  # The order of the forward and backward passes (docs/pipeline.md). 'gpipe': every forward,
  # then every backward (the transpose of the forward scan); a stage keeps the input of each of
  # the M * repeats + P - 1 ticks. '1f1b': a micro-batch's backward starts as soon as it leaves
  # the last stage, so a stage keeps at most 2P - 1 inputs whatever M, at the same bubble; the
  # backward always recomputes the stage's forward from its input (as remat_policy='full' does).
  # One repeat only.
  schedule: Literal['gpipe', '1f1b'] = 'gpipe'
  # When the data ranks' gradients are summed, with data parallelism, with or without a pipeline
  # (docs/pipeline.md, docs/parallelism.md). 'step' (ZeRO-1): each data rank runs its own
  # micro-batch loop or schedule on its rows and adds its micro-batches' gradients up in fp32,
  # the whole gradient (a stage's) on every rank (Megatron-DeepSpeed's fp32 gradient
  # accumulation), and the ranks' sums are reduce-scattered once a step. 'tick': one loop or
  # schedule over all ranks, each micro-batch's gradient reduce-scattered into an accumulator
  # split over them (with a pipeline each tick's all-reduced: XLA's partitioning of it); less
  # memory, more traffic. For tr11 on its cluster: an estimated 114 s an iteration against
  # 2,231, for 58.5 GiB per GPU against 31.4. ZeRO-3 gathers each layer over `data` where it is
  # used, inside one loop: 'tick' only. 'auto': 'step' for a ZeRO-1 pipeline, else 'tick'
  # (`Config.grad_sync`): without a pipeline 'step' holds the whole model's fp32 gradient on
  # every rank, which a config asks for where it fits (configs/bloom_1b3.py). Hybrid sharding's
  # copies (mesh.zero_group) each run their own loop or schedule and are summed once a step
  # under either.
  grad_sync: Literal['auto', 'step', 'tick'] = 'auto'


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  save_interval: int = 0  # Iterations between saves; 0 saves only at the end.
  # Also a save once this many minutes of wall clock passed since this job's last save or its
  # first iteration, so a crash loses at most that much training whatever an iteration takes
  # (the batch-size ramp-up changes it); every process saves at the same iteration. 0: none.
  save_interval_mins: float = 0.0
  max_to_keep: int = _ranged(3, 1)  # The latest K checkpoints are kept...
  keep_period: int = 0  # ...plus, for good, every step that is a multiple of this (0: none).
  init_from: str = ''  # A checkpoint whose weights start a new run (optimizer starts fresh).
  # Restart controls, applied when a run resumes from its workdir (docs/checkpoints.md).
  load_optimizer: bool = True  # False: fresh Adam moments and step count 0 (--no-load-optim).
  # With load_optimizer=False: the first this many iterations after the reset train at lr 0
  # while the fresh Adam moments warm up (the chronicles' recipe; about 5 / (1 - beta2)), then
  # the schedule goes on. Recorded in the checkpoints, so a restart inside them keeps lr 0.
  reset_warmup_iterations: int = 0
  override_lr_scheduler: bool = False  # True: the config's schedule wins (--override-lr-scheduler).
  load_rng: bool = True  # False: dropout follows the config's train.seed (--no-load-rng).


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
  # A file whose presence stops the run: at start-up without work, during training after a save.
  kill_switch_path: str = ''
  # Save and exit before this many minutes of wall clock (--exit-duration-in-mins); 0: no limit.
  exit_duration_mins: float = 0.0
  # Exit with code 4 and every thread's stack when training makes no progress (an iteration, an
  # evaluation, a save) for this many minutes; compilation is not counted. 0: never.
  hang_timeout_mins: float = 0.0
  # TensorBoard event files of the training and evaluation scalars (--tensorboard-dir), relative
  # to the workdir unless absolute; '': none.
  tensorboard_dir: str = 'tensorboard'
  # Every this many iterations, compare the copies that devices hold of each replicated array
  # (LayerNorms and biases across tensor ranks, ...) and log the result; 0: never.
  replica_check_interval: int = 0
  # Loss-spike report (watches.SpikeWatch): an lm loss more than spike_loss_threshold (a fraction)
  # above the median of the previous spike_window iterations, or a grad norm above
  # spike_grad_factor times theirs; 0 turns that check off.
  spike_window: int = _ranged(50, 1)
  spike_loss_threshold: float = 0.15
  spike_grad_factor: float = 4.0
  # JAX's persistent compilation cache: the run's compiled programs are stored here and a later
  # job (a restart, a requeue) loads them instead of compiling again, as it does each curriculum
  # length. Relative to the workdir unless absolute; '': none.
  compilation_cache_dir: str = ''
  # A shell command run in the background on each event an operator must act on (training/
  # alerts.py: spike, slowdown, replica_mismatch, hang, crashed, stopped, finished), with
  # T5X_LIKE_EVENT, T5X_LIKE_MESSAGE, T5X_LIKE_ITERATION, T5X_LIKE_WORKDIR, T5X_LIKE_PROCESS in
  # its environment; '': none.
  alert_command: str = ''
  # Stop the run (exit code 5, DIVERGED) after this many consecutive iterations with a non-finite
  # loss or gradient norm, keeping the state of the last finite one; 0: never stop for it.
  max_consecutive_nan: int = 10
  # A JAX profiler trace of these iterations, 'FIRST-LAST' (e.g. '20-25'), under tensorboard_dir
  # in plugins/profile/ for TensorBoard's Profile tab and Perfetto (docs/monitoring.md); '': none.
  profile_steps: str = ''
  # The process (jax.process_index()) that records the traces.
  profile_process: int = 0
  # Also a trace of profile_length iterations each time this many minutes passed since the last
  # one (clu.periodic_actions), the first that long after the job's first iteration: e.g. 360 for
  # a trace every 6 hours, to set beside an early one when a run slows down days in; 0: none.
  profile_every_mins: float = _ranged(0.0, 0)
  profile_length: int = _ranged(3, 1)

  def profile_range(self) -> tuple[int, int] | None:
    """profile_steps as (first, last), None for ''; a ConfigError names a bad one."""
    if not self.profile_steps:
      return None
    return iteration_range('runtime.profile_steps', self.profile_steps, "'20-25' ('' for none)")


def iteration_range(key: str, text: Any, example: str) -> tuple[int, int]:
  """'FIRST-LAST' (iterations, 1-based, inclusive) as (first, last); a ConfigError naming `key`
  and the form, with `example`, for anything else."""
  parts = str(text).split('-')
  if (
    len(parts) != 2
    or not all(p.strip().isdecimal() for p in parts)  # isdigit takes '²', which int() refuses
    or not 1 <= int(parts[0]) <= int(parts[1])
  ):
    raise ConfigError(
      f'{key}: {text!r} is not a range of iterations FIRST-LAST with 1 <= FIRST <= LAST, '
      f'e.g. {example}'
    )
  return int(parts[0]), int(parts[1])


SECTIONS = {
  'model': ModelConfig,
  'train': TrainConfig,
  'optimizer': OptimizerConfig,
  'curriculum': CurriculumConfig,
  'data': DataConfig,
  'eval': EvalConfig,
  'mesh': MeshConfig,
  'pipeline': PipelineConfig,
  'checkpoint': CheckpointConfig,
  'runtime': RuntimeConfig,
}


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig()
  train: TrainConfig = TrainConfig()
  optimizer: OptimizerConfig = OptimizerConfig()
  curriculum: CurriculumConfig = CurriculumConfig()
  data: DataConfig = DataConfig()
  eval: EvalConfig = EvalConfig()
  mesh: MeshConfig = MeshConfig()
  pipeline: PipelineConfig = PipelineConfig()
  checkpoint: CheckpointConfig = CheckpointConfig()
  runtime: RuntimeConfig = RuntimeConfig()

  @property
  def num_microbatches(self) -> int:
    return self.microbatches_for(self.train.global_batch_size)

  def microbatches_for(self, global_batch_size: int) -> int:
    """The micro-batches a global batch fills."""
    return global_batch_size // (self.train.micro_batch_size * self.mesh.data)

  @property
  def padded_vocab_size(self) -> int:
    return self.model.padded_vocab_size(self.mesh.tensor)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def to_json(self) -> str:
    return json.dumps(self.to_dict(), indent=2, sort_keys=True)

  @classmethod
  def from_dict(cls, raw: dict[str, Any]) -> Config:
    """Builds a Config from nested dicts; unknown sections or keys are errors."""
    raw = _without_retired_keys(raw)
    unknown = set(raw) - set(SECTIONS)
    if unknown:
      raise ConfigError(
        f'unknown config section(s) {sorted(unknown)}; known sections are {sorted(SECTIONS)}'
      )
    sections = {}
    for name, section_cls in SECTIONS.items():
      values = dict(raw.get(name) or {})
      fields = {f.name: f for f in dataclasses.fields(section_cls)}
      bad = set(values) - set(fields)
      if bad:
        raise ConfigError(
          f'unknown config key(s) {[f"{name}.{k}" for k in sorted(bad)]}; '
          f'known keys of {name!r}: {sorted(fields)}'
        )
      for key, value in values.items():
        values[key] = _coerce(f'{name}.{key}', value, type(getattr(section_cls(), key)))
      sections[name] = section_cls(**values)
    return cls(**sections)

  def replace(self, **sections: dict[str, Any]) -> Config:
    """Returns a copy with some keys of some sections changed, e.g. replace(mesh={'data': 2})."""
    raw = self.to_dict()
    for name, values in sections.items():
      raw.setdefault(name, {}).update(values)
    return Config.from_dict(raw)

  def check_values(self) -> Config:
    """Every key against its declaration: the type of its default, the values of its `Literal`
    annotation (allowed_values), the range of a number (numeric_range, finite); one
    ConfigError naming the key, the value and what it may be."""
    for name, section_cls in SECTIONS.items():
      section = getattr(self, name)
      for f in dataclasses.fields(section_cls):
        key, value = f'{name}.{f.name}', getattr(section, f.name)
        _coerce(key, value, type(f.default))  # raises on a value of the wrong type
        _check_allowed(key, value)
        _check_range(key, value)
    return self

  @property
  def grad_sync(self) -> str:
    """pipeline.grad_sync resolved: 'step' or 'tick'. 'auto' is 'step' for a ZeRO-1 pipeline,
    whose data ranks then each hold their stage's whole fp32 gradient, and 'tick' otherwise:
    without a pipeline 'step' holds the whole model's on every rank (4 bytes a parameter)."""
    if self.pipeline.grad_sync != 'auto':
      return self.pipeline.grad_sync
    return 'step' if self.mesh.zero_stage == 1 and self.mesh.pipeline > 1 else 'tick'

  def validate(self) -> Config:
    """Checks each key (check_values) and the constraints between keys that this module can
    check by itself, section by section; raises one ConfigError naming the fix. The checks that
    need the modules owning the mesh, the attention kernels, the schedule and the data run with
    these in `startup.check_config`, which every command calls once before any compilation."""
    self.check_values()
    self._check_mesh()
    self._check_model()
    self._check_train()
    self._check_pipeline()
    self._check_optimizer()
    self._check_curriculum()
    self._check_runtime()
    self._check_checkpoint()
    self._check_data()
    return self

  def _check_model(self) -> None:
    m, t, tensor = self.model, self.train, self.mesh.tensor
    _need(
      m.hidden_size % m.num_heads == 0,
      f'model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads '
      f'({m.num_heads}); pick a head count that divides it',
    )
    _need(
      m.num_heads % tensor == 0,
      f'model.num_heads ({m.num_heads}) must be divisible by mesh.tensor ({tensor}): '
      'tensor parallelism splits whole heads; use a mesh.tensor that divides the head count',
    )
    _need(
      m.ffn_size % tensor == 0,
      f'the FFN size ({m.ffn_size}) must be divisible by mesh.tensor ({tensor})',
    )
    _need(
      not m.sequence_parallel or t.seq_len % tensor == 0,
      f'model.sequence_parallel splits the sequence over mesh.tensor, so train.seq_len '
      f'({t.seq_len}) must be divisible by mesh.tensor ({tensor}); change one of them '
      'or set model.sequence_parallel=False',
    )
    padded = self.padded_vocab_size
    _need(
      padded >= m.vocab_size,
      f'model.pad_vocab_size_to ({m.pad_vocab_size_to}) is smaller than model.vocab_size '
      f'({m.vocab_size})',
    )
    _need(
      padded % tensor == 0,
      f'the padded vocabulary ({padded}) must be divisible by mesh.tensor ({tensor}); '
      'set model.pad_vocab_size_to to a multiple of it',
    )
    # fp16 gradients underflow without Megatron's dynamic loss scaling, which this trainer does
    # not have; bf16 (BLOOM's choice after tr8's fp16 divergences) has fp32's range.
    _need(
      m.dtype != 'float16',
      "model.dtype='float16' needs dynamic loss scaling, which t5x_like does not implement "
      "(its gradients would underflow); use 'bfloat16', as BLOOM-176B did, or 'float32'",
    )
    _need(
      m.dtype in ('float32', 'bfloat16'),
      f"model.dtype must be 'float32' or 'bfloat16', got {m.dtype!r}",
    )
    # 'auto' with dropout resolves to 'xla' on every device (model/attention.py).
    _need(
      m.attention_impl in ('xla', 'auto') or m.attention_dropout == 0.0,
      f"model.attention_dropout={m.attention_dropout} needs model.attention_impl='xla' (or "
      f"'auto', which then runs xla): the fused {m.attention_impl!r} attention has no dropout; "
      'set model.attention_dropout=0',
    )
    # Unrolled, the layers' checkpoints (prevent_cse=False, safe in a scan only) no longer keep
    # XLA from merging the backward's recomputed forward into the forward.
    _need(
      not (m.unroll_layers and m.remat_policy == 'full'),
      "model.unroll_layers=True under model.remat_policy='full' recomputes nothing: XLA merges "
      "the recomputed forward into the forward and keeps what 'save_dots' keeps (more than "
      "twice the memory of scanned layers); use remat_policy='save_dots' with unrolled layers, "
      "or scanned layers for 'full'",
    )
    _need(
      m.architecture != 'gpt2' or t.seq_len <= m.max_position_embeddings,
      f'train.seq_len ({t.seq_len}) exceeds model.max_position_embeddings '
      f'({m.max_position_embeddings}) of the gpt2 architecture',
    )

  def _check_mesh(self) -> None:
    mesh = self.mesh
    _need(
      mesh.data % mesh.zero_group_size == 0,
      f'mesh.zero_group ({mesh.zero_group}) must divide mesh.data ({mesh.data}): each group of '
      'zero_group data ranks splits one copy of the state; use a divisor of mesh.data, or 0 '
      'for all of them',
    )

  def _check_train(self) -> None:
    t, data = self.train, self.mesh.data
    _need(
      t.steps > 0 or t.train_samples > 0,
      'set train.steps (iterations) or train.train_samples (samples) so the run can end',
    )
    per_step = t.micro_batch_size * data
    _need(
      t.global_batch_size % per_step == 0,
      f'train.global_batch_size ({t.global_batch_size}) must be divisible by '
      f'train.micro_batch_size x mesh.data ({t.micro_batch_size} x {data} = {per_step})',
    )
    if t.rampup_batch_size:
      _need(
        len(t.rampup_batch_size) == 3
        and all(
          isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in t.rampup_batch_size
        ),
        f'train.rampup_batch_size must be (start, increment, samples) of positive ints, got '
        f'{t.rampup_batch_size}',
      )
      start, increment, _ = t.rampup_batch_size
      _need(
        start < t.global_batch_size and (t.global_batch_size - start) % increment == 0,
        f'train.rampup_batch_size: global_batch_size - start ({t.global_batch_size} - {start}) '
        f'must be a positive multiple of the increment ({increment})',
      )
    _need(
      not t.rampup_microbatch_multiple or bool(t.rampup_batch_size),
      f'train.rampup_microbatch_multiple ({t.rampup_microbatch_multiple}) pads the micro-batch '
      'counts of a batch-size ramp-up, and there is none (train.rampup_batch_size is empty); '
      'set train.rampup_batch_size, or train.rampup_microbatch_multiple=0',
    )

  def _check_pipeline(self) -> None:
    m, pl = self.model, self.pipeline
    p, r = self.mesh.pipeline, pl.repeats
    _need(
      p * r <= m.num_layers,
      f'mesh.pipeline x pipeline.repeats ({p} x {r}) exceeds model.num_layers '
      f'({m.num_layers}): every stage needs at least one layer per repeat',
    )
    if r > 1:
      fits = [
        k
        for k in range(1, m.num_layers // p + 1)
        if k * -(-m.num_layers // (p * k)) == -(-m.num_layers // p)
      ]
      _need(
        r in fits,
        f'pipeline.repeats={r} does not fit {m.num_layers} layers on {p} stages: every stage '
        f'would hold more than one padding slot; repeats that fit: {fits}',
      )
    _need(
      self.mesh.zero_stage == 1 or pl.grad_sync != 'step',
      "pipeline.grad_sync='step' needs mesh.zero_stage=1: ZeRO-3 gathers each layer's weights "
      'over `data` where it is used, inside one loop over all the data ranks; set '
      "pipeline.grad_sync='tick', or mesh.zero_stage=1",
    )
    if p == 1:
      return
    if pl.schedule == '1f1b':
      _need(
        r == 1,
        f"pipeline.schedule='1f1b' runs one repeat, and pipeline.repeats is {r}; use "
        "pipeline.repeats=1 with '1f1b', or pipeline.schedule='gpipe' for the circular "
        'schedule',
      )
      _need(
        not pl.microbatch_group,
        f"pipeline.schedule='1f1b' already keeps at most 2P - 1 stage inputs, and "
        f'pipeline.microbatch_group={pl.microbatch_group} would only add a fill '
        "and drain per group; set pipeline.microbatch_group=0 with '1f1b'",
      )
    _need(
      m.cross_entropy_impl != 'fused' or pl.schedule == '1f1b',
      "model.cross_entropy_impl='fused' keeps an embedding-sized gradient from each "
      "micro-batch's forward to its backward pass, which pipeline.schedule='gpipe' runs after "
      "all the micro-batches' forwards; use pipeline.schedule='1f1b' (each micro-batch's "
      "backward at once), or 'chunked' (or 'dense') with mesh.pipeline > 1",
    )

  def _check_optimizer(self) -> None:
    o = self.optimizer
    _need(
      o.min_lr <= o.lr,
      f'optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr}): the schedule '
      'decays from lr down to min_lr; lower min_lr or raise lr',
    )
    _need(
      o.decay_samples == 0 or o.decay_samples > o.warmup_samples,
      f'optimizer.decay_samples ({o.decay_samples}) must exceed optimizer.warmup_samples '
      f'({o.warmup_samples}), or be 0 for no decay',
    )
    _need(
      o.name != 'adamw_8bit' or o.quant_block_size in QUANT_BLOCK_SIZES,
      f'optimizer.quant_block_size must be one of {", ".join(map(str, QUANT_BLOCK_SIZES))} '
      f"with optimizer.name='adamw_8bit', got {o.quant_block_size}; set one of these",
    )

  def _check_curriculum(self) -> None:
    c, seq = self.curriculum, self.train.seq_len
    if not c.enabled:
      _need(
        not c.pad_to_multiple,
        f'curriculum.pad_to_multiple ({c.pad_to_multiple}) pads the lengths of a '
        'sequence-length curriculum, and there is none (curriculum.min_seq_len '
        '= 0); set curriculum.min_seq_len, or curriculum.pad_to_multiple=0',
      )
      return
    fix = 'set curriculum.min_seq_len=0 for no curriculum'
    _need(
      c.total_iterations >= 1,
      f'curriculum.total_iterations ({c.total_iterations}) must be >= 1 with a curriculum '
      f'(curriculum.min_seq_len={c.min_seq_len}); {fix}',
    )
    # DeepSpeed rounds every length down to the step: a train.seq_len off the step is never
    # reached, and a min_seq_len below it starts at length 0.
    _need(
      not (c.min_seq_len % c.difficulty_step or seq % c.difficulty_step),
      f'curriculum.min_seq_len ({c.min_seq_len}) and train.seq_len ({seq}) must '
      f'be multiples of curriculum.difficulty_step ({c.difficulty_step}), or the '
      'schedule would never reach train.seq_len; change one of them',
    )
    _need(
      c.min_seq_len < seq,
      f'curriculum.min_seq_len ({c.min_seq_len}) must be below train.seq_len '
      f'({seq}), where the curriculum ends; {fix}',
    )
    # Padded lengths stay on the step's grid (tensor-core shapes), as every unpadded one is.
    _need(
      c.pad_to_multiple % c.difficulty_step == 0,
      f'curriculum.pad_to_multiple ({c.pad_to_multiple}) must be 0 (no padding) '
      f'or a positive multiple of curriculum.difficulty_step '
      f'({c.difficulty_step}), e.g. {8 * c.difficulty_step}',
    )

  def _check_runtime(self) -> None:
    rt = self.runtime
    _need(
      rt.profile_range() is None or bool(rt.tensorboard_dir),
      f'runtime.profile_steps={rt.profile_steps!r} writes its trace under '
      "runtime.tensorboard_dir, which is ''; set a tensorboard_dir or profile_steps=''",
    )
    _need(
      not rt.profile_every_mins or bool(rt.tensorboard_dir),
      f'runtime.profile_every_mins={rt.profile_every_mins} writes its traces under '
      "runtime.tensorboard_dir, which is ''; set a tensorboard_dir or profile_every_mins=0",
    )

  def _check_data(self) -> None:
    d = self.data
    d.skip_ranges()  # raises on a bad range
    _need(
      not d.mixture_or_task_module or bool(d.mixture_or_task),
      f'data.mixture_or_task_module={d.mixture_or_task_module!r} registers seqio '
      'Tasks for data.mixture_or_task, which is empty; name the Task or Mixture '
      "to train on, or set data.mixture_or_task_module=''",
    )

  def _check_checkpoint(self) -> None:
    _need(
      not self.checkpoint.reset_warmup_iterations or not self.checkpoint.load_optimizer,
      f'checkpoint.reset_warmup_iterations={self.checkpoint.reset_warmup_iterations} is the '
      'lr-0 warm-up after an optimizer reset; set checkpoint.load_optimizer=False with it',
    )
    init_from = self.checkpoint.init_from
    _need(
      not init_from or os.path.isdir(init_from),
      f'checkpoint.init_from={init_from!r} is not a directory; point it at a '
      "checkpoint directory (a run's WORKDIR/checkpoints or one step inside it)",
    )


def _need(ok: bool, message: str) -> None:
  if not ok:
    raise ConfigError(message)


# Keys that earlier versions wrote into config.json (so into checkpoints), with the one value
# they could hold; a saved config that has them still loads.
_RETIRED_KEYS = {('data', 'corpus'): 'embedded'}


# Keys added with a new default that changes the run: a recorded config (a checkpoint's, a job's
# in config_history.jsonl) without one was written before it existed, and reads with the value
# that reproduces its run.
_VALUES_BEFORE_KEYS = {('data', 'blend_order'): 'divisor'}


def with_values_before_keys(raw: dict[str, Any]) -> dict[str, Any]:
  """A recorded config's sections (raw dicts), with the keys newer than the record filled in as
  its run had them; `Config.from_dict` of it is the recorded run's config."""
  raw = dict(raw)
  for (section, key), value in _VALUES_BEFORE_KEYS.items():
    values = raw.get(section)
    if isinstance(values, dict) and key not in values:
      raw[section] = {**values, key: value}
  return raw


def _without_retired_keys(raw: dict[str, Any]) -> dict[str, Any]:
  raw = dict(raw)
  for (section, key), only_value in _RETIRED_KEYS.items():
    values = raw.get(section)
    if isinstance(values, dict) and key in values and values[key] == only_value:
      raw[section] = {k: v for k, v in values.items() if k != key}
  return raw


def _field(key: str) -> dataclasses.Field:
  section, _, name = key.partition('.')
  return {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]


def numeric_range(key: str) -> tuple[float, float, str]:
  """(lowest, highest, bounds) that the numeric config key `key` ('section.name') must be in:
  what its field declares with `_ranged`, else [0, inf]."""
  return _field(key).metadata.get('range', (0, _INF, '[]'))


@functools.cache
def _literals(section_cls: type) -> dict[str, tuple]:
  """{field: the values of its Literal annotation} of one section dataclass."""
  hints = typing.get_type_hints(section_cls)  # the annotations are strings (__future__)
  return {
    name: typing.get_args(hint)
    for name, hint in hints.items()
    if typing.get_origin(hint) is Literal
  }


def allowed_values(key: str) -> tuple | None:
  """The values the key `key` ('section.name') may take, from its `Literal[...]` annotation;
  None for a key without one."""
  section, _, name = key.partition('.')
  return _literals(SECTIONS[section]).get(name)


def literal_keys() -> list[str]:
  """Every key annotated `Literal[...]`, as 'section.name'."""
  return [f'{name}.{key}' for name, cls in SECTIONS.items() for key in _literals(cls)]


def _check_allowed(key: str, value: Any) -> None:
  choices = allowed_values(key)
  if choices is None or any(value == c and type(value) is type(c) for c in choices):
    return
  *rest, last = map(repr, choices)
  listed = f'{", ".join(rest)} or {last}' if rest else last
  hint = [c for c in choices if isinstance(value, str) and str(c).lower() == value.lower()]
  raise ConfigError(
    f'{key} must be {listed}, got {value!r}'
    + (f' (the values are case-sensitive: {hint[0]!r})' if hint else '')
  )


def describe_range(low: float, high: float, bounds: str) -> str:
  """'>= 1', '> 0', 'in [0, 1)': the range as a message shows it."""
  if high == _INF:
    return f'{">=" if bounds[0] == "[" else ">"} {low}'
  return f'in {bounds[0]}{low}, {high}{bounds[1]}'


def _check_range(key: str, value: Any) -> None:
  # bool is an int subclass; switches such as attention_fallback are not numbers.
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return
  low, high, bounds = numeric_range(key)
  inside = (
    math.isfinite(value)
    and (low <= value if bounds[0] == '[' else low < value)
    and (value <= high if bounds[1] == ']' else value < high)
  )
  if not inside:
    kind = '' if isinstance(value, int) else ' and finite'
    raise ConfigError(
      f'{key} must be {describe_range(low, high, bounds)}{kind}, got {value!r}; '
      'set it within that range'
    )


def _coerce(key: str, value: Any, want: type) -> Any:
  """Converts ints to floats where a float is wanted; rejects other type mismatches."""
  if want is tuple and isinstance(value, dict):
    # A mapping (data.valid_path) is kept as its (key, value) pairs: hashable, and in order.
    return tuple((k, v) for k, v in value.items())
  if want is tuple and isinstance(value, str) and key.endswith('_weighted_split_paths'):
    return (value,)  # one group, as Megatron's flag takes one quoted group
  if want is tuple and isinstance(value, (list, tuple)):
    # Nested lists come back from config.json; tuples keep the config hashable.
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
  if want is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if want is int and isinstance(value, float) and value.is_integer():
    return int(value)
  if not isinstance(value, want) or (want is int and isinstance(value, bool)):
    raise ConfigError(f'{key} must be of type {want.__name__}, got {value!r}')
  return value


# --------------------------------------------------------------------------- front ends


def load_config_file(path: str, overrides: dict[str, Any] | None = None) -> Config:
  """Loads `configs/*.py` (a `get_config()` returning a ConfigDict) plus dotted overrides."""
  import importlib.util

  if not os.path.isfile(path):
    raise ConfigError(
      f'config file {path!r} not found; pass an existing file such as configs/tiny.py'
    )
  if path.endswith('.gin'):
    raise ConfigError(
      f'{path} is a gin file; pass it with --gin_file (--config takes a Python '
      'file with get_config(), such as configs/tiny.py)'
    )
  if not path.endswith('.py'):
    raise ConfigError(
      f'config file {path!r} is not a Python file; --config takes a .py file '
      'with get_config() (such as configs/tiny.py), --gin_file a .gin file'
    )
  spec = importlib.util.spec_from_file_location('_t5x_like_config', path)
  assert spec is not None and spec.loader is not None  # a .py path always has a source loader
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    raise ConfigError(f'{path}, line {e.lineno}: syntax error ({e.msg}); fix the file') from None
  except Exception as e:  # the file is the user's code: whatever it raises is a bad config
    raise ConfigError(
      f'{path} raised {type(e).__name__}: {e} while loading; fix the file'
    ) from None
  if not callable(getattr(module, 'get_config', None)):
    raise ConfigError(
      f'{path} defines no get_config() function; config files define one that '
      'returns an ml_collections.ConfigDict (see configs/tiny.py)'
    )
  try:
    raw = module.get_config()
  except Exception as e:  # as above: the user's code
    raise ConfigError(
      f'{path}: get_config() raised {type(e).__name__}: {e}; fix the file'
    ) from None
  raw = raw.to_dict() if hasattr(raw, 'to_dict') else raw
  if not isinstance(raw, dict) or not all(isinstance(v, dict) or v is None for v in raw.values()):
    raise ConfigError(
      f'{path}: get_config() returned {_one_line(repr(raw))[:60]}, not a '
      'mapping of sections to their keys (an ml_collections.ConfigDict or dict '
      "such as {'train': {'steps': 10}}); return one, as configs/tiny.py does"
    )
  raw = dict(raw)
  for dotted, value in (overrides or {}).items():
    apply_override(raw, dotted, value)
  return Config.from_dict(raw)


class CommandLineValue(str):
  """The text of a `--config.a.b=VALUE` override, parsed once the key's type is known."""


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
  section, _, key = dotted.partition('.')
  if section not in SECTIONS or not key:
    raise ConfigError(f'unknown config key {dotted!r}; keys look like model.num_layers')
  known = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
  if key not in known:
    raise ConfigError(f'unknown config key {dotted!r}; known keys of {section!r}: {sorted(known)}')
  if isinstance(value, CommandLineValue):
    # A string key takes the text as it is ('969,30,1' is a split, not a tuple).
    want_str = isinstance(getattr(SECTIONS[section](), key), str)
    value = str(value) if want_str else parse_override_value(value)
  raw.setdefault(section, {})[key] = value


def parse_override_value(text: str) -> Any:
  """`--config.a.b=VALUE` values: Python/JSON literals, else the raw string."""
  import ast

  lowered = text.strip().lower()
  if lowered in ('true', 'false'):
    return lowered == 'true'
  if lowered in ('nan', 'inf', '+inf', '-inf', 'infinity', '-infinity'):
    return float(lowered)  # a number, so validate() names the range it is outside of
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return str(text)


def parse_overrides(rest: list[str]) -> dict:
  """`--config.a.b=value` or `--config.a.b value` pairs (`train` and `plan` take them); anything
  else is an error."""
  overrides, i = {}, 0
  while i < len(rest):
    arg = rest[i]
    if not arg.startswith('--config.'):
      raise ConfigError(
        f'unrecognised argument {arg!r}; overrides look like --config.train.steps=10'
      )
    key, eq, value = arg[len('--config.') :].partition('=')
    if not eq:
      if i + 1 >= len(rest):
        raise ConfigError(f'{arg} needs a value')
      i += 1
      value = rest[i]
    overrides[key] = CommandLineValue(value)
    i += 1
  return overrides


_GIN_MAKERS: dict[str, Any] = {}


def _gin_makers() -> dict[str, Any]:
  """Registers each section dataclass with gin once, under its section name."""
  import gin

  if not _GIN_MAKERS:
    for name, section_cls in SECTIONS.items():
      _GIN_MAKERS[name] = gin.external_configurable(section_cls, name=name)
  return _GIN_MAKERS


def _one_line(text: str) -> str:
  return ' '.join(line.strip() for line in text.splitlines() if line.strip())


def load_gin(files: list[str], bindings: list[str]) -> Config:
  """Loads gin files binding `section.key = value` (the same names as the config files)."""
  import gin

  for path in files:
    if not os.path.isfile(path):
      raise ConfigError(
        f'gin file {path!r} not found; pass an existing file such as configs/tiny.gin'
      )
  gin.clear_config()
  makers = _gin_makers()
  try:
    gin.parse_config_files_and_bindings(files, bindings, finalize_config=False)
    sections = {name: maker() for name, maker in makers.items()}
  except Exception as e:  # gin raises many types for bad text (SyntaxError,
    # tokenize.TokenError, IOError for a missing include, ValueError, ...): all are bad input.
    where = ', '.join([*files, *(f'--gin_bindings {b!r}' for b in bindings)])
    raise ConfigError(
      f'gin configuration error in {where}: {type(e).__name__}: '
      f'{_one_line(str(e))}; bindings look like train.steps = 10'
    ) from None
  finally:
    gin.clear_config()
  # Round-trip through from_dict so both front ends get the same type coercion.
  return Config.from_dict({k: dataclasses.asdict(v) for k, v in sections.items()})
