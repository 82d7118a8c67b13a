"""An analytical cost model of one training iteration on GPUs: time, TFLOP/s and memory per GPU.

`estimate(cfg, gpu)` answers, in milliseconds and without compiling anything, what the step of
`cfg` (its model, global batch and mesh) would cost on `cfg.mesh.num_devices` GPUs of kind
`gpu` (a key of GPUS). The parts (docs/planner.md):

* compute: the matmul and attention FLOPs of each pass a GPU runs per micro-batch (forward,
  backward = 2 forwards, and the recomputed forward of remat_policy='full' or the 1F1B order) at
  `efficiency(work)` of the bf16 peak, the one place the two fitted constants enter;
* the pipeline: (M R + P - 1) ticks of one stage's work per micro-batch (the bubble is the P - 1);
* tensor-parallel collectives over NVLink (two all-reduces, or all-gather + reduce-scatter under
  sequence parallelism, per layer and pass), not overlapped with compute (as Megatron runs them);
* pipeline transfers: each tick sends an activation forward and a gradient back, 1/TP of it per
  GPU (Megatron's scatter-gather; sequence parallelism splits it the same way);
* data-parallel ZeRO-1 collectives once per iteration over the inter-node network: the fp32
  gradients reduce-scattered, the bf16 weights all-gathered; and the embedding's gradient summed
  over the stages that each hold a whole copy (when tensor x pipeline does not divide it);
* the optimizer: Adam reads and writes its shard of the state at HBM bandwidth;
* memory per GPU in t5x_like/planning/memory_report.py's categories, by the layout t5x_like's step
  uses (ZeRO-1 state, a gathered bf16 copy of the stage, fp32 gradients in the ZeRO layout, kept
  stage inputs, the recomputed layers' matmul outputs, one layer's backward).

Every hardware constant is in GPUS with its source; the two fitted constants are FITTED (fitted by
benchmarks/fit_planner.py on one table of the chronicles, docs/planner.md). Nothing here starts
a JAX backend: the Megatron FLOPs come from accounting.megatron_flops_per_iteration (the log line's
formula), everything else is arithmetic on the config.
"""

from __future__ import annotations

import dataclasses
import math
import os

from t5x_like.config import Config, ConfigError
from t5x_like.training import (
  accounting,  # the log line's FLOPs and peaks; imports JAX, starts no backend
)

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU kind and the node it comes in. Bandwidths in GB/s (1e9 bytes), one direction."""

  peak_bf16_tflops: float  # dense, without sparsity
  hbm_gib: float  # what the device reports (nvidia-smi's total)
  hbm_gb_s: float
  nvlink_gb_s: float  # per GPU, one direction (half the data sheet's bidirectional figure)
  network_gb_s: float  # per node, one direction, the NICs that carry NCCL's traffic together
  gpus_per_node: int
  sources: str

  def network_per_gpu_gb_s(self) -> float:
    """Each GPU's share of the node's network when all of them talk across nodes at once."""
    return self.network_gb_s / self.gpus_per_node


GPUS = {
  'a100-80gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['A100'],
    hbm_gib=80.0,
    hbm_gb_s=2039.0,
    nvlink_gb_s=300.0,
    network_gb_s=50.0,
    gpus_per_node=8,
    sources='NVIDIA A100 data sheet (SXM4 80GB: 312 TFLOPS bf16 dense, 80 GB HBM2e at 2,039 '
    'GB/s, NVLink 600 GB/s bidirectional); the node and network of Jean Zay, where BLOOM and '
    'the chronicles ran (BLOOM model card, Hardware: 8 GPUs per node, 4 Omni-Path links of '
    '100 Gb/s each)',
  ),
  'a100-40gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['A100'],
    hbm_gib=40.0,
    hbm_gb_s=1555.0,
    nvlink_gb_s=300.0,
    network_gb_s=200.0,
    gpus_per_node=8,
    sources='NVIDIA A100 data sheet (SXM4 40GB: 312 TFLOPS bf16 dense, 40 GB HBM2 at 1,555 '
    'GB/s, NVLink 600 GB/s bidirectional); NVIDIA DGX A100 data sheet (8 GPUs, 8 x 200 Gb/s '
    'HDR InfiniBand for compute)',
  ),
  'h100-80gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['H100'],
    hbm_gib=79.6,
    hbm_gb_s=3350.0,
    nvlink_gb_s=450.0,
    network_gb_s=400.0,
    gpus_per_node=8,
    sources='NVIDIA H100 data sheet (SXM5: 989 TFLOPS bf16 dense, 80 GB HBM3 at 3.35 TB/s '
    '(81,559 MiB reported), NVLink 900 GB/s bidirectional); NVIDIA DGX H100 data sheet (8 '
    'GPUs, 8 x 400 Gb/s ConnectX-7)',
  ),
  'h200': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['H200'],
    hbm_gib=140.4,
    hbm_gb_s=4800.0,
    nvlink_gb_s=450.0,
    network_gb_s=400.0,
    gpus_per_node=8,
    sources='NVIDIA H200 data sheet (SXM: 989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s '
    '(143,771 MiB reported), NVLink 900 GB/s bidirectional); NVIDIA DGX H200 data sheet (8 '
    'GPUs, 8 x 400 Gb/s ConnectX-7)',
  ),
}


@dataclasses.dataclass(frozen=True)
class Fitted:
  """The model's only fitted constants (benchmarks/fit_planner.py, docs/planner.md).

  The matmul and attention kernels run at efficiency(work) = peak_fraction x work / (work +
  half_work) of the bf16 peak, work being one layer's forward FLOPs for one micro-batch on one
  GPU: what does not grow with the kernels (launches, the memory-bound kernels' fixed share,
  synchronisation, the pipeline engine's per-micro-batch steps) costs about half_work /
  (peak_fraction x peak) seconds per layer and micro-batch pass, a share that grows as the
  micro-batch shrinks or tensor parallelism splits a layer finer."""

  peak_fraction: float
  half_work: float  # FLOPs


# Fitted by benchmarks/fit_planner.py on seed 004's 02-25 table "Tweaking TP for the first time"
# (its 9 timed rows: NLAYERS 72, NHIDDEN 14336, NHEADS 64, A100 80GB on Jean Zay; rms log error
# 0.050): 71.7% of the peak for large kernels, half of that at 587 GFLOP per layer and
# micro-batch (tr11's 5.2 TFLOP: 64% of the peak).
FITTED = Fitted(peak_fraction=0.717, half_work=5.87e11)


def efficiency(work: float, fitted: Fitted = FITTED) -> float:
  """The share of the bf16 peak kernels of `work` FLOPs (one layer, one micro-batch, one GPU)
  reach."""
  return fitted.peak_fraction * work / (work + fitted.half_work)


# The share of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; 0.75 when it
# is unset: JAX's documentation, "GPU memory allocation"): the budget a run fits in, not the HBM.
DEFAULT_JAX_MEMORY_FRACTION = 0.75


def jax_memory_fraction() -> float:
  """What this environment lets JAX allocate on a GPU, as a share of its memory."""
  text = os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION', '')
  try:
    fraction = float(text) if text else DEFAULT_JAX_MEMORY_FRACTION
  except ValueError:
    raise ConfigError(
      f'XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} is not a number; set it to a '
      'share of GPU memory such as 0.9, or unset it (JAX takes 0.75)'
    ) from None
  if not 0 < fraction <= 1:
    raise ConfigError(
      f'XLA_PYTHON_CLIENT_MEM_FRACTION={text} is not in (0, 1]; set a share of '
      'GPU memory such as 0.9, or unset it (JAX takes 0.75)'
    )
  return fraction


def gpu_spec(kind: str, nodes_of: int | None = None) -> Gpu:
  """GPUS[kind], with `nodes_of` GPUs per node when given (the node's network shared by them)."""
  if kind not in GPUS:
    raise ConfigError(f'unknown --gpu {kind!r}; known kinds: {", ".join(GPUS)}')
  if nodes_of is not None and nodes_of < 1:
    raise ConfigError(
      f'--nodes-of must be a number of GPUs per node >= 1, got {nodes_of}; '
      f"leave it out for the kind's {GPUS[kind].gpus_per_node}"
    )
  spec = GPUS[kind]
  return dataclasses.replace(spec, gpus_per_node=nodes_of) if nodes_of else spec


def check_topology(cfg: Config, gpu: Gpu) -> None:
  """Why `cfg`'s mesh cannot run as planned, as one ConfigError (the rest is Config.validate's
  and schedule.check's): tensor parallelism stays within a node, and a run over several nodes
  fills them."""
  n, tensor = cfg.mesh.num_devices, cfg.mesh.tensor
  if tensor > gpu.gpus_per_node or gpu.gpus_per_node % tensor:
    raise ConfigError(
      f'mesh.tensor={tensor} must divide the {gpu.gpus_per_node} GPUs of a node: '
      'tensor-parallel collectives run every layer and need NVLink; use a '
      f'mesh.tensor that divides {gpu.gpus_per_node}'
    )
  if n > gpu.gpus_per_node and n % gpu.gpus_per_node:
    raise ConfigError(
      f'the mesh needs {n} GPUs, which is more than one node and not a multiple '
      f'of its {gpu.gpus_per_node} GPUs; use whole nodes'
    )


def stage_slots(cfg: Config) -> int:
  """Layer slots a stage holds (pipeline.place_layers's chunk x repeats: padding slots included)."""
  p, r = cfg.mesh.pipeline, cfg.pipeline.repeats
  return math.ceil(cfg.model.num_layers / (p * r)) * r


def layer_params(cfg: Config) -> int:
  m = cfg.model
  h, ffn = m.hidden_size, m.ffn_size
  return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h


def embedding_split_over_pipeline(cfg: Config) -> bool:
  """Whether the vocabulary is split over tensor x pipeline (else over tensor, whole per stage)."""
  return (
    cfg.mesh.pipeline > 1 and cfg.padded_vocab_size % (cfg.mesh.tensor * cfg.mesh.pipeline) == 0
  )


def local_params(cfg: Config) -> tuple[float, float]:
  """(the stage's layer params, the embedding's) one GPU computes with, before ZeRO's split."""
  t = cfg.mesh.tensor
  stage = stage_slots(cfg) * layer_params(cfg) / t
  embedding = cfg.padded_vocab_size * cfg.model.hidden_size / t
  if embedding_split_over_pipeline(cfg):
    embedding /= cfg.mesh.pipeline
  return stage, embedding


def adam_bytes_per_param(cfg: Config, stage: float, embedding: float) -> float:
  """Both Adam moments' bytes per param: 8 in fp32; under optimizer.name='adamw_8bit' one byte
  each plus an fp32 absmax per quant_block_size values (the embedding's always fp32:
  quantized_adam.FP32_STATE), as optim.bytes_per_param counts them."""
  o = cfg.optimizer
  if o.name != 'adamw_8bit':
    return 8.0
  quantized = 2 + 2 * 4 / o.quant_block_size
  return (quantized * stage + 8 * embedding) / (stage + embedding)


def memory_bytes(cfg: Config) -> dict[str, float]:
  """Bytes per GPU by memory_report's categories, for t5x_like's step on a GPU."""
  m, mesh, b, s = cfg.model, cfg.mesh, cfg.train.micro_batch_size, cfg.train.seq_len
  h, t, p, dp = m.hidden_size, mesh.tensor, mesh.pipeline, mesh.data
  heads = m.num_heads // t
  stage, embedding = local_params(cfg)
  state = stage + embedding
  compute_bytes = 2 if m.dtype == 'bfloat16' else 4
  split_seq = t if m.sequence_parallel else 1
  activation = b * s * h * compute_bytes  # one micro-batch's hidden states, whole
  scores = b * heads * s * s  # one layer's attention scores on this GPU
  # A layer's matmul outputs: QKV, the scores, the context, the attention and MLP projections
  # (before their reduction: whole), h -> 4h.
  dots = activation * (3 / t + 1 / t + 2 + m.ffn_size / h / t) + scores * compute_bytes
  slots = stage_slots(cfg)
  out = dict.fromkeys(
    (
      'master weights (fp32 params)',
      'Adam moments',
      'batch and step scalars',
      'kept stage inputs',
      'kept activations',
      'recomputation workspace',
      'gradient accumulators',
      'backward workspace',
      'weight copies',
      'other temporaries',
    ),
    0.0,
  )
  out['master weights (fp32 params)'] = 4 * state / dp
  out['Adam moments'] = adam_bytes_per_param(cfg, stage, embedding) * state / dp
  out['batch and step scalars'] = 2 * 4 * cfg.train.global_batch_size / dp * s
  if p > 1:
    if cfg.pipeline.schedule == '1f1b':
      kept = 2 * p - 1
    else:
      group = cfg.pipeline.microbatch_group or cfg.num_microbatches
      kept = group * cfg.pipeline.repeats + p - 1
    out['kept stage inputs'] = kept * activation / split_seq
  elif m.remat_policy == 'full':
    out['kept activations'] = m.num_layers * activation / split_seq  # each layer's input
  if p > 1 or m.remat_policy == 'full':
    # The backward of a tick (or a layer) recomputes its forward keeping the matmul outputs of
    # every layer but the one whose backward runs.
    out['recomputation workspace'] = (slots - 1 if p > 1 else 0) * dots
  else:
    keep = dots if m.remat_policy == 'save_dots' else dots + 3 * scores * compute_bytes
    out['kept activations'] = m.num_layers * keep
  # fp32 gradients in the ZeRO layout, and the embedding's whole before its reduction.
  out['gradient accumulators'] = 4 * state / dp + 4 * embedding
  # One layer's backward: its matmul outputs, and the softmax's f32 probabilities, their
  # gradient and the dropout mask's.
  out['backward workspace'] = dots + 3 * 4 * scores
  # The bf16 copy of the stage and embedding gathered over data, and the embedding's fp32
  # gather it is cast from.
  out['weight copies'] = compute_bytes * state + 4 * embedding
  vocab = cfg.padded_vocab_size / t
  if m.cross_entropy_impl == 'dense':
    logits = 2 * 4 * b * s * vocab  # fp32 logits and their gradient
  else:
    logits = 2 * 4 * b * s * min(vocab, m.cross_entropy_chunk)
  out['other temporaries'] = logits
  return out


def _allreduce_bytes(size: float, ranks: int) -> float:
  """Bytes each rank sends in a ring all-reduce of `size` bytes (reduce-scatter + all-gather)."""
  return 2 * (ranks - 1) / ranks * size


def estimate(cfg: Config, gpu: str, fitted: Fitted = FITTED, nodes_of: int | None = None) -> dict:
  """The cost of one iteration of `cfg`'s step (at its full global batch) on its mesh of GPUs
  of kind `gpu` (`nodes_of` GPUs per node; None: the kind's): times in seconds, bytes per GPU per
  iteration. `cfg` is a validated config (Config.validate, schedule.check)."""
  spec = gpu_spec(gpu, nodes_of)
  check_topology(cfg, spec)
  m, mesh, train = cfg.model, cfg.mesh, cfg.train
  h, s, b = m.hidden_size, train.seq_len, train.micro_batch_size
  t, p, dp, r = mesh.tensor, mesh.pipeline, mesh.data, cfg.pipeline.repeats
  n = mesh.num_devices
  micro = cfg.num_microbatches
  slots = stage_slots(cfg)
  compute_bytes = 2 if m.dtype == 'bfloat16' else 4
  recompute = m.remat_policy == 'full' or (p > 1 and cfg.pipeline.schedule == '1f1b')

  # FLOPs of one micro-batch's forward through one stage on one GPU.
  matmul = slots * (2 * b * s * (4 * h * h + 2 * h * m.ffn_size)) / t
  attention = slots * 4 * b * s * s * h / t
  # The head (tied embedding's logits) in every tick's path: split over the stages when the
  # vocabulary is, else run whole by the stage holding it.
  head = 2 * b * s * h * cfg.padded_vocab_size / t
  if embedding_split_over_pipeline(cfg):
    head /= p
  layer_work = (matmul + attention) / slots
  flops_per_second = spec.peak_bf16_tflops * 1e12 * efficiency(layer_work, fitted)
  tick_matmul = 3 * (matmul + head) / flops_per_second
  tick_attention = 3 * attention / flops_per_second
  tick_recompute = (matmul + attention) / flops_per_second if recompute else 0.0

  # Tensor parallelism: per layer and pass, two all-reduces of one micro-batch's hidden states
  # (sequence parallelism's all-gather + reduce-scatter move the same bytes).
  passes = 3 if recompute else 2
  tp_bytes_tick = (
    slots * passes * 2 * _allreduce_bytes(b * s * h * compute_bytes, t) if t > 1 else 0.0
  )
  tick_tp = tp_bytes_tick / (spec.nvlink_gb_s * 1e9)

  # Pipeline transfers: an activation forward and a gradient back per tick, 1/t per GPU, over
  # the network when consecutive stages sit on different nodes.
  crosses_nodes = t * p > spec.gpus_per_node
  pp_bandwidth = (spec.network_per_gpu_gb_s() if crosses_nodes else spec.nvlink_gb_s) * 1e9
  pp_bytes_tick = 2 * b * s * h * compute_bytes / t if p > 1 else 0.0
  tick_pp = pp_bytes_tick / pp_bandwidth

  # The schedule: each micro-batch passes each of a stage's R chunks once; P - 1 chunk-ticks of
  # fill and drain per schedule (per group under pipeline.microbatch_group).
  groups = micro // cfg.pipeline.microbatch_group if cfg.pipeline.microbatch_group else 1
  bubble_ticks = groups * (p - 1) / r
  stage_tick = tick_matmul + tick_attention + tick_recompute + tick_tp + tick_pp

  # ZeRO-1 over data, once per iteration: fp32 gradients reduce-scattered, bf16 weights
  # all-gathered; over the network when a data rank's peers are on other nodes.
  stage, embedding = local_params(cfg)
  state = stage + embedding
  dp_bytes = (dp - 1) / dp * state * (4 + compute_bytes) if dp > 1 else 0.0
  dp_bandwidth = (spec.network_per_gpu_gb_s() if n > spec.gpus_per_node else spec.nvlink_gb_s) * 1e9
  # The embedding held whole by every stage: its gradient summed over the stages.
  embedding_bytes = (
    _allreduce_bytes(4 * embedding, p) if p > 1 and not embedding_split_over_pipeline(cfg) else 0.0
  )
  # Adam reads the fp32 params, both moments and the gradient and writes the first three and
  # the bf16 copy, on its 1/data shard.
  optimizer_bytes = state / dp * (4 * 4 + 3 * 4 + compute_bytes)

  parts = {
    'matmul_s': micro * tick_matmul,
    'attention_s': micro * tick_attention,
    'recompute_s': micro * tick_recompute,
    'tensor_parallel_s': micro * tick_tp,
    'pipeline_transfer_s': micro * tick_pp,
    'pipeline_bubble_s': bubble_ticks * stage_tick,
    'data_parallel_s': dp_bytes / dp_bandwidth,
    'embedding_sync_s': embedding_bytes / pp_bandwidth,
    'optimizer_s': optimizer_bytes / (spec.hbm_gb_s * 1e9),
  }
  step = sum(parts.values())
  memory = memory_bytes(cfg)
  memory_gib = sum(memory.values()) / GIB
  fraction = jax_memory_fraction()
  usable_gib = spec.hbm_gib * fraction
  model_flops = accounting.megatron_flops_per_iteration(cfg, train.global_batch_size, s)
  report = {
    'gpu': gpu,
    'mesh': [dp, p, t],
    'micro_batch_size': b,
    'num_microbatches': micro,
    'estimated_step_s': step,
    'estimated_tflops_per_gpu': model_flops / step / n / 1e12,
    'estimated_memory_gib': memory_gib,
    'fits': memory_gib <= usable_gib,
    'hbm_gib': spec.hbm_gib,
    'usable_gib': usable_gib,
    **parts,
    'compute_efficiency': efficiency(layer_work, fitted),
    'bubble_fraction': bubble_ticks / (micro + bubble_ticks),
    'matmul_flops_per_gpu': micro * 3 * (matmul + head),
    'attention_flops_per_gpu': micro * 3 * attention,
    'recompute_flops_per_gpu': micro * (matmul + attention) if recompute else 0.0,
    'tensor_parallel_bytes_per_gpu': micro * tp_bytes_tick,
    'pipeline_transfer_bytes_per_gpu': micro * pp_bytes_tick,
    'data_parallel_bytes_per_gpu': dp_bytes,
    'embedding_sync_bytes_per_gpu': embedding_bytes,
    'memory_gib_by_category': {k: v / GIB for k, v in memory.items()},
  }
  if not report['fits']:
    report['why_not'] = (
      f'{memory_gib:.1f} GiB per GPU exceeds the {usable_gib:.1f} GiB JAX may '
      f'use of one {gpu} ({fraction:g} of {spec.hbm_gib:g} GiB; '
      'XLA_PYTHON_CLIENT_MEM_FRACTION raises it)'
    )
  return report


def _divisors(n: int) -> list[int]:
  """n's divisors in increasing order, in O(sqrt(n)) steps."""
  small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
  return small + [n // d for d in reversed(small) if d * d != n]


def max_gpus(cfg: Config, spec: Gpu) -> tuple[int, str]:
  """(the most GPUs any topology of `cfg`'s model and batch can use on `spec`'s nodes, why): tensor
  at most the largest divisor of the heads within a node, and data x pipeline at most the
  smallest batch of the run (its ramp-up's first), since every micro-batch holds a sample and
  every stage needs a micro-batch."""
  from t5x_like.training import schedule

  heads, node = cfg.model.num_heads, spec.gpus_per_node
  tensor = max(t for t in _divisors(heads) if t <= node and node % t == 0)
  batch = min(schedule.ramp_batch_sizes(cfg.train))
  which = (
    "train.rampup_batch_size's first batch"
    if cfg.train.rampup_batch_size
    else 'train.global_batch_size'
  )
  return tensor * batch, (
    f'tensor at most {tensor}, dividing the {heads} heads and a node of '
    f'{node}, x data x pipeline at most {batch}, the {which}: a sample '
    'per micro-batch, a micro-batch per stage'
  )


def search(cfg: Config, gpus: int, gpu: str, nodes_of: int | None = None) -> list[dict]:
  """Every valid (data, pipeline, tensor, micro-batch) for `gpus` GPUs of kind `gpu` at `cfg`'s
  model, sequence and global batch (and ramp-up), each with its estimate: those that fit first,
  then those that do not, each group by estimated seconds per iteration.

  Valid: tensor divides the heads, hidden and FFN sizes and the node; the layers go over the
  stages with at most one padding slot each; the global batch and every ramp-up batch divide by
  micro-batch x data, into at least as many micro-batches as stages (Config.validate and
  schedule.check decide, as for a run). More GPUs than `max_gpus` is a ConfigError."""
  from t5x_like.training import schedule

  spec = gpu_spec(gpu, nodes_of)
  if gpus < 1:
    raise ConfigError(f'--gpus must be >= 1, got {gpus}')
  if gpus > spec.gpus_per_node and gpus % spec.gpus_per_node:
    raise ConfigError(
      f'--gpus {gpus} spans several nodes of {spec.gpus_per_node} GPUs and is '
      f'not a multiple of {spec.gpus_per_node}; use whole nodes (or --nodes-of)'
    )
  # Refused before enumerating: the loops below take time with the divisors of the count.
  limit, why = max_gpus(cfg, spec)
  if gpus > limit:
    raise ConfigError(
      f'--gpus {gpus} is more than any topology of this model and batch can use: '
      f'at most {limit} ({why}); use --gpus {limit} or fewer, or a larger '
      'batch'
    )
  m = cfg.model
  batches = schedule.ramp_batch_sizes(cfg.train)
  results = []
  for tensor in _divisors(m.num_heads):
    if gpus % tensor or spec.gpus_per_node % tensor:
      continue
    for pipeline in _divisors(gpus // tensor):
      if pipeline > m.num_layers:
        break
      slots = math.ceil(m.num_layers / (pipeline * cfg.pipeline.repeats))
      if slots * pipeline * cfg.pipeline.repeats - m.num_layers > pipeline:
        continue  # more than one padding slot per stage
      data = gpus // (tensor * pipeline)
      for micro in _divisors(
        cfg.train.global_batch_size // data if cfg.train.global_batch_size % data == 0 else 0
      ):
        if any(b % (micro * data) or b // (micro * data) < pipeline for b in batches):
          continue
        try:
          candidate = cfg.replace(
            mesh={'data': data, 'pipeline': pipeline, 'tensor': tensor},
            train={'micro_batch_size': micro},
          ).validate()
          schedule.check(candidate)
        except ConfigError:
          continue  # a divisibility the loops above do not check (FFN, vocabulary, groups)
        results.append(estimate(candidate, gpu, nodes_of=nodes_of))
  results.sort(key=lambda r: (not r['fits'], r['estimated_step_s']))
  return results
