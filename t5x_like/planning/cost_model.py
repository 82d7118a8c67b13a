"""An analytical cost model of one training iteration on GPUs: time, TFLOP/s and memory per GPU.

`estimate(cfg, gpu)` answers, in milliseconds and without compiling anything, what the step of
`cfg` (its model, global batch and mesh, ZeRO stage and group included) would cost on
`cfg.mesh.num_devices` GPUs of kind `gpu` (a key of GPUS). The parts (docs/planner.md):

* compute: the matmul and attention FLOPs of each pass a GPU runs per micro-batch (forward,
  backward = 2 forwards, and what the backward recomputes: the forward under
  remat_policy='full' or the 1F1B order, attention's under 'save_dots', the logits under the
  chunked cross-entropy). On a GPU without measured kernel rates (and under Megatron-DeepSpeed)
  at `efficiency(work)` of the bf16 peak, the A100 fit's two constants; on one with them
  (Gpu.measured: H100, H200) t5x_like's matmuls at the measured GEMM rate less a fixed cost per
  layer pass (MEASURED_HALF_WORK, fitted on the one measured step), attention at its
  implementation's measured kernel rates (attention_impl 'auto' resolved as on the kind);
* the attention scores' HBM traffic (bytes read and written per score element by the kernels
  that materialise them), which grows with the head count (in the measured rates where there
  are some);
* with measured rates, the memory-bound kernels (LayerNorms, GeLU, bias and residual adds, the
  loss's fp32 logits, the gradients' accumulation) at HBM bandwidth (`memory_bound_bytes`);
* the pipeline: (M R + P - 1) ticks of one stage's work per micro-batch (the bubble is the P - 1);
* tensor-parallel collectives (two all-reduces, or all-gather + reduce-scatter under sequence
  parallelism, per layer and pass) at nccl-tests' measured bus bandwidths, not overlapped with
  compute (as Megatron runs them);
* pipeline transfers: each tick sends an activation forward and a gradient back, 1/TP of it per
  GPU (Megatron's scatter-gather; sequence parallelism splits it the same way);
* ZeRO over a group of G data ranks (mesh.zero_stage, mesh.zero_group): ZeRO-1's gradient
  reduce-scatter (once a step in fp32 under pipeline.grad_sync 'step'; under 'tick' each
  micro-batch's in the compute dtype without a pipeline, an all-reduce at every tick with one)
  and weight all-gather, or ZeRO-3's per-layer gathers and reduce-scatters in every
  micro-batch, over NVLink when the group fits in a node and the network otherwise; with
  hybrid sharding (G < data) an all-reduce of the 1/G gradient shards across the data / G
  copies, once a step; and the embedding's gradient summed over the stages that each hold a
  whole copy;
* the optimizer: Adam reads and writes its shard of the state at HBM bandwidth;
* memory per GPU in t5x_like/planning/memory_report.py's categories, by the layout t5x_like's step
  uses (the ZeRO-split state, the gathered bf16 copy of the stage under ZeRO-1 or gathered
  layers under ZeRO-3, fp32 gradients split over the group or, under grad_sync 'step', whole
  on every data rank, kept stage inputs, the recomputed layers' matmul outputs, what
  save_dots keeps, one layer's backward, a micro-batch's gradient before it is accumulated;
  without a pipeline the largest of the phases XLA's peak can be in).

`framework='megatron-deepspeed'` estimates the same config as the chronicles measured it (seed
004's tables): the head on the last stage only, Megatron's fused-softmax constraint and
Megatron-DeepSpeed's memory layout (half-precision weights and gradients whole on every rank).

Every hardware constant is in GPUS with its source (measured kernel rates in Gpu.measured); the
fitted constants are FITTED (fitted by benchmarks/fit_planner.py on one table of the
chronicles) and MEASURED_HALF_WORK (by the same script on the H100 step), docs/planner.md.
Nothing here starts a JAX backend: the Megatron FLOPs come from
accounting.megatron_flops_per_iteration (the log line's formula), everything else is arithmetic
on the config.
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
# The memory model's largest underestimates of XLA's GPU compiles and of the H100's peaks are
# under 6% (tests/test_cost_model.py; docs/planner.md): a topology estimated to fit with less
# headroom than this is `near_limit`, and only a compile (`plan --gpu`, `--search --aot`) says.
MEMORY_ERROR = 0.06

# t5x_like's own step (the planner's subject), or the same config as Megatron-DeepSpeed ran it in
# the chronicles (what their tables measured; the validation tests use it).
FRAMEWORKS = ('t5x_like', 'megatron-deepspeed')


@dataclasses.dataclass(frozen=True)
class Measured:
  """Kernel rates measured by this project's GPU suite (benchmarks/gpu_suite.py) on one GPU of a
  kind. With them `estimate` prices t5x_like's step by what its kernels were measured to do:
  the matmuls at the bf16 GEMM probe's rate, attention at its implementation's measured forward
  and backward rates, the memory-bound kernels at HBM bandwidth (`memory_bound_bytes`)."""

  matmul_tflops: float  # bf16 GEMM, 8192^3 random values (the suite's matmul probe)
  # attention_impl -> ((seq, forward TFLOP/s, backward TFLOP/s), ...): causal attention with ALiBi,
  # head_dim 128, counting benchmarks/attention.py's FLOPs (forward 2 b H s^2 d, half of the
  # s^2 by causality; backward 2.5 x forward). Interpolated in log(seq) between the measured
  # lengths, the nearest one outside them.
  attention_tflops: dict[str, tuple[tuple[int, float, float], ...]]
  sources: str


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU kind and the node it comes in. Bandwidths in GB/s (1e9 bytes): nccl-tests' bus
  bandwidths (busbw) measured on such nodes at large payloads, not the data sheets' link speeds
  (those are in `sources`)."""

  peak_bf16_tflops: float  # dense, without sparsity
  hbm_gib: float  # what the device reports (nvidia-smi's total)
  hbm_gb_s: float
  nvlink_allreduce_gb_s: float  # all-reduce busbw over the node's NVLink/NVSwitch
  nvlink_gb_s: float  # busbw of all-gather, reduce-scatter and point-to-point over NVLink
  network_gb_s: float  # the inter-node busbw of one node, all its NICs together
  gpus_per_node: int
  compute_capability: str  # CUDA's, for what attention_impl='auto' runs (attention_impl_on)
  sources: str
  # What this project measured on one GPU of the kind: t5x_like's own step is then estimated
  # from these rates (`Measured`) instead of the A100 fit's efficiency curve. None: not measured.
  measured: Measured | None = None

  def network_per_gpu_gb_s(self) -> float:
    """Each GPU's share of the node's network when all of them talk across nodes at once."""
    return self.network_gb_s / self.gpus_per_node


# nccl-tests' busbw grows with the payload: in the one published sweep we found by payload size
# (all_reduce on 8 x H200, NVLink 4, nccl 2.27.7: stas00/ml-engineering, network/benchmarks/
# results/all-reduce-8xH200.md), busbw = peak x S / (S + S_half) with S_half = 23.9-27.1 MiB for
# the payloads of 32-256 MiB (219.9 GB/s at 16 MiB, 346.5 at 64 MiB, 436.2 at 256 MiB, 482.3 at
# 16 GiB). The same shape is assumed for every kind and link (no A100 sweep was found).
HALF_BANDWIDTH_BYTES = 25 * 2**20

# One H100 80GB HBM3 (SXM, driver 580.159.04), jax/jaxlib 0.11.2 (CUDA 13), 2026-11-24: the GPU
# suite's bf16 matmul probe and benchmarks/attention.py at 16 heads of 128, batch x seq = 16384
# tokens (docs/benchmarks.md, "The GPU suite" and "Attention kernels").
H100_MEASURED = Measured(
  matmul_tflops=671.0,
  attention_tflops={
    'pallas': ((2048, 210.0, 230.0), (4096, 263.0, 262.0)),
    'cudnn': ((2048, 155.0, 134.0), (4096, 177.0, 145.0)),
    'xla': ((2048, 36.2, 58.5), (4096, 40.8, 59.9)),
  },
  sources='benchmarks/gpu_suite.py on one H100 80GB HBM3 SXM, jax 0.11.2, 2026-11-24 '
  '(docs/benchmarks.md): bf16 matmul 8192^3 of random values 671 TFLOP/s (68% of the data '
  "sheet's 989); benchmarks/attention.py, causal ALiBi attention, 16 heads of 128, forward and "
  'backward TFLOP/s of pallas (Triton flash kernels, 128-row tiles), cudnn '
  '(jax.nn.dot_product_attention with a materialised bias) and xla (attention_reference) at seq '
  '2048 (batch 8) and 4096 (batch 4)',
)

GPUS = {
  'a100-80gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['A100'],
    hbm_gib=80.0,
    hbm_gb_s=2039.0,
    nvlink_allreduce_gb_s=235.0,
    nvlink_gb_s=235.0,
    network_gb_s=135 / 8,
    gpus_per_node=8,
    compute_capability='8.0',
    sources='NVIDIA A100 data sheet (SXM4 80GB: 312 TFLOPS bf16 dense, 80 GB HBM2e at 2,039 '
    'GB/s, NVLink 600 GB/s bidirectional); nccl-tests all_reduce_perf on an 8 x A100 node: 235 '
    'GB/s busbw, 80% of the 300 GB/s one-way NVLink (S. Bekman, stas00/ml-engineering, '
    'network/README.md, "Unidirectional vs Bidirectional"; A100 has no NVLink SHARP, so its '
    'ring all-gather and reduce-scatter reach the same); the node and network of Jean Zay, where '
    'BLOOM and the chronicles ran (BLOOM model card, Hardware: 8 GPUs per node, 4 x 100 Gb/s '
    'Omni-Path), of which 135 Gb/s per node was measured (ml-engineering, network/README.md, '
    '"Omni-Path": "I used this technology at JeanZay ... It was only 135Gbps")',
  ),
  'a100-40gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['A100'],
    hbm_gib=40.0,
    hbm_gb_s=1555.0,
    nvlink_allreduce_gb_s=235.0,
    nvlink_gb_s=235.0,
    network_gb_s=200.0,
    gpus_per_node=8,
    compute_capability='8.0',
    sources='NVIDIA A100 data sheet (SXM4 40GB: 312 TFLOPS bf16 dense, 40 GB HBM2 at 1,555 '
    'GB/s, NVLink 600 GB/s bidirectional); NVLink busbw as for a100-80gb (nccl-tests, 235 GB/s); '
    'NVIDIA DGX A100 data sheet (8 GPUs, 8 x 200 Gb/s HDR InfiniBand for compute): the network '
    'is the data sheet line rate, no published nccl-tests figure for it was found',
  ),
  'h100-80gb': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['H100'],
    hbm_gib=79.6,
    hbm_gb_s=3350.0,
    nvlink_allreduce_gb_s=480.0,
    nvlink_gb_s=370.0,
    network_gb_s=8 * 47.0,
    gpus_per_node=8,
    compute_capability='9.0',
    sources='NVIDIA H100 data sheet (SXM5: 989 TFLOPS bf16 dense, 80 GB HBM3 at 3.35 TB/s '
    '(81,559 MiB reported), NVLink 900 GB/s bidirectional); NCCL maintainers on nccl-tests '
    '(NVIDIA/nccl-tests#212): "On 8 GPUs, you should reach a peak busBw of ~480GB/s" for '
    'all_reduce (NVLink SHARP), and "an effective NVLink bandwidth of 370GB/s, which you can '
    'observe as BusBw when running non-allreduce operations"; NVIDIA/nccl-tests#290: "For NDR @ '
    '400Gbps you should see 46-48GB/s per NIC", x 8 ConnectX-7 NICs of the DGX H100 data sheet',
    measured=H100_MEASURED,
  ),
  'h200': Gpu(
    peak_bf16_tflops=accounting.BF16_PEAK_TFLOPS['H200'],
    hbm_gib=140.4,
    hbm_gb_s=4800.0,
    nvlink_allreduce_gb_s=480.0,
    nvlink_gb_s=370.0,
    network_gb_s=8 * 47.0,
    gpus_per_node=8,
    compute_capability='9.0',
    sources='NVIDIA H200 data sheet (SXM: 989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s '
    '(143,771 MiB reported), NVLink 900 GB/s bidirectional); NVLink 4 busbw as for h100-80gb '
    '(8 x H200 all_reduce sweep: 482.3 GB/s at 16 GiB, stas00/ml-engineering network/benchmarks/'
    'results/all-reduce-8xH200.md); NDR network as for h100-80gb (NVIDIA/nccl-tests#290)',
    # Not measured on an H200: the same GH100 compute at the same peak, so the H100's kernel rates
    # stand in (its faster HBM speeds the memory-bound parts through hbm_gb_s only).
    measured=H100_MEASURED,
  ),
}


@dataclasses.dataclass(frozen=True)
class Fitted:
  """The efficiency curve's fitted constants (benchmarks/fit_planner.py, docs/planner.md), for
  GPUs without measured kernel rates and Megatron-DeepSpeed's step.

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
# 0.050) with the measured bus bandwidths of GPUS: 90.8% of the peak for large kernels (cuBLAS's
# large bf16 GEMMs), half of that at 980 GFLOP per layer and micro-batch (tr11's 5.2 TFLOP: 76%).
FITTED = Fitted(peak_fraction=0.941, half_work=1.02e12)


def efficiency(work: float, fitted: Fitted = FITTED) -> float:
  """The share of the bf16 peak kernels of `work` FLOPs (one layer, one micro-batch, one GPU)
  reach."""
  return fitted.peak_fraction * work / (work + fitted.half_work)


# t5x_like's step on a GPU with measured kernel rates (Gpu.measured): its matmuls run at
# matmul_tflops x work / (work + MEASURED_HALF_WORK), work being one layer's forward matmul FLOPs
# for one micro-batch on one GPU, i.e. each forward-sized pass of a layer costs
# MEASURED_HALF_WORK / matmul_tflops more than its FLOPs at the probe's rate (0.215 ms on an
# H100, against the A100 fit's 3.5 ms of Megatron-DeepSpeed): what the counted kernels leave out
# (gaps between XLA's kernels, GEMMs smaller than the 8192^3 probe). Fitted by
# benchmarks/fit_planner.py on one measurement, the H100 BLOOM-1.3B step with pallas attention
# (951 ms); the same step's cudnn and xla rows are held out (docs/planner.md).
MEASURED_HALF_WORK = 1.44e11


def attention_impl_on(cfg: Config, gpu: str | None = None, framework: str = 't5x_like') -> str:
  """The attention implementation `cfg`'s step runs on GPUs of kind `gpu`: model.attention_impl,
  'auto' resolved as t5x_like/model/attention.py resolves it on that kind's compute capability
  (on an A100 when the kind is not given; 'pallas' on both today, 'xla' with attention dropout).
  Megatron-DeepSpeed's attention materialises the scores as 'xla' does; every other
  implementation ('pallas', 'cudnn', 'tokamax', 'mosaic') keeps them on chip."""
  if framework == 'megatron-deepspeed':
    return 'xla'
  from t5x_like.model import attention  # imports JAX, starts no backend

  capability = GPUS[gpu].compute_capability if gpu in GPUS else '8.0'
  return attention.resolved(cfg.model, attention.Device('gpu', compute_capability=capability))


def one_f_one_b(cfg: Config) -> bool:
  """Whether the config runs a pipeline in the 1F1B order, whose every tick's backward
  recomputes its stage's forward."""
  return cfg.mesh.pipeline > 1 and cfg.pipeline.schedule == '1f1b'


def per_rank_gradients(cfg: Config, framework: str = 't5x_like') -> bool:
  """Whether t5x_like's step runs each data rank's own micro-batch loop or schedule, its fp32
  gradient (a stage's) whole on every rank and reduced once a step (training/step.py's
  `own_gradient_axes` under grad_sync 'step')."""
  return framework == 't5x_like' and cfg.mesh.data > 1 and cfg.grad_sync == 'step'


def adds_gradients_in_place(
  cfg: Config, framework: str = 't5x_like', in_place: bool | None = None
) -> bool:
  """Whether t5x_like's no-pipeline loop adds each micro-batch's gradients into its fp32
  accumulator in place, no stacked gradient of the layers beside it, and scatters the looked-up
  rows' into the token table's (training/step.py's `holds_whole_gradient`): ZeRO-1 where the
  accumulator is whole, under grad_sync 'step' or where one rank holds a copy of the state (one
  data rank, or hybrid groups of one). `in_place` False: as the steps measured before
  2026-11-28 ran (fit_planner.H100_STEP_GRADIENTS_IN_PLACE)."""
  mesh = cfg.mesh
  whole = mesh.zero_group_size == 1 or per_rank_gradients(cfg, framework)
  can = framework == 't5x_like' and mesh.pipeline == 1 and mesh.zero_stage == 1 and whole
  return can and in_place is not False


def unrolled_layers(cfg: Config, framework: str = 't5x_like') -> bool:
  """Whether t5x_like's step runs its layers unrolled (model.unroll_layers) without a pipeline:
  no layer scan, so no per-pass fixed cost (MEASURED_HALF_WORK, fitted on scanned steps: the
  H200's unrolled 1.3B step, 702 ms, is estimated at 693 without it, 781 with it;
  docs/benchmarks.md). A pipeline's unrolled stages are not modelled."""
  return framework == 't5x_like' and cfg.model.unroll_layers and cfg.mesh.pipeline == 1


def merges_recomputation(cfg: Config, framework: str = 't5x_like') -> bool:
  """Whether XLA merges the layers' recomputed forward into a forward: layers unrolled
  (model.unroll_layers) under 'save_dots', without a pipeline (into the forward) or in the 1F1B
  schedule (into the stage's forward each backward tick recomputes). The layers' checkpoints'
  prevent_cse=False is safe in a scan only; unrolled, each layer keeps what its backward would
  have recomputed. GPipe's ticks, differentiated as a scan, keep it apart. XLA's GPU compiles of
  configs/bloom_1b3.py (docs/benchmarks.md): without a pipeline within 1% under ZeRO-1, +6.6%
  under ZeRO-3; see tests/test_cost_model.py for the 1F1B rows."""
  m = cfg.model
  if framework != 't5x_like' or not m.unroll_layers or m.remat_policy != 'save_dots':
    return False
  return cfg.mesh.pipeline == 1 or one_f_one_b(cfg)


def per_rank_pipeline(cfg: Config, framework: str = 't5x_like') -> bool:
  """`per_rank_gradients` with a pipeline."""
  return cfg.mesh.pipeline > 1 and per_rank_gradients(cfg, framework)


def keeps_attention_residuals(impl: str, residuals_kept: bool | None = None) -> bool:
  """Whether remat_policy='save_dots' keeps `impl`'s output and log-sum-exp, so that its
  backward runs no second forward: `residuals_kept` where given (estimate's), else as this code
  does (t5x_like/model/attention.py's KEEPS_RESIDUALS_UNDER_SAVE_DOTS)."""
  if residuals_kept is not None:
    return residuals_kept
  from t5x_like.model import attention  # imports JAX, starts no backend

  return impl in attention.KEEPS_RESIDUALS_UNDER_SAVE_DOTS


def measured_attention_tflops(measured: Measured, impl: str, seq: int) -> tuple[float, float]:
  """(forward, backward) TFLOP/s of `impl`'s causal attention at sequence length `seq`, from
  `measured` (log-linear between the measured lengths, the nearest outside them). An
  implementation without a measurement ('tokamax', 'mosaic') is taken at the Pallas kernels'
  rates."""
  points = measured.attention_tflops.get(impl) or measured.attention_tflops['pallas']
  points = tuple(sorted(points))
  if seq <= points[0][0]:
    return points[0][1], points[0][2]
  for (s0, f0, b0), (s1, f1, b1) in zip(points, points[1:]):
    if seq <= s1:
      x = math.log(seq / s0) / math.log(s1 / s0)
      return f0 + x * (f1 - f0), b0 + x * (b1 - b0)
  return points[-1][1], points[-1][2]


# The share of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION; 0.75 when it
# is unset: JAX's documentation, "GPU memory allocation"): the budget a run fits in, not the HBM.
DEFAULT_JAX_MEMORY_FRACTION = 0.75

# The CUDA context and kernels a PyTorch process holds on an A100 before allocating anything (seed
# 004: "also need to take into account the cuda kernels (1271MiB)").
TORCH_CONTEXT_BYTES = 1271 * 2**20
# Elements of the flat bucket DeepSpeed's pipeline engine all-reduces gradients in
# (MEMORY_OPT_ALLREDUCE_SIZE in deepspeed/runtime/pipe/engine.py).
DEEPSPEED_ALLREDUCE_BUCKET = 500_000_000


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


def _check_framework(framework: str) -> None:
  if framework not in FRAMEWORKS:
    raise ConfigError(f'unknown framework {framework!r}; known: {", ".join(FRAMEWORKS)}')


def stage_slots(cfg: Config) -> int:
  """Layer slots a stage holds (pipeline.place_layers's chunk x repeats: padding slots included)."""
  p, r = cfg.mesh.pipeline, cfg.pipeline.repeats
  return math.ceil(cfg.model.num_layers / (p * r)) * r


def layer_params(cfg: Config) -> int:
  m = cfg.model
  h, ffn = m.hidden_size, m.ffn_size
  return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h


def embedding_split_over_pipeline(cfg: Config, framework: str = 't5x_like') -> bool:
  """Whether the vocabulary is split over tensor x pipeline (else over tensor, whole per stage).
  Megatron-DeepSpeed never split it over the stages: the first stage embeds, the last computes
  the logits."""
  return (
    framework == 't5x_like'
    and cfg.mesh.pipeline > 1
    and cfg.padded_vocab_size % (cfg.mesh.tensor * cfg.mesh.pipeline) == 0
  )


def local_params(cfg: Config, framework: str = 't5x_like') -> tuple[float, float]:
  """(the stage's layer params, the embedding's) one GPU computes with, before ZeRO's split."""
  t = cfg.mesh.tensor
  stage = stage_slots(cfg) * layer_params(cfg) / t
  embedding = cfg.padded_vocab_size * cfg.model.hidden_size / t
  if embedding_split_over_pipeline(cfg, framework):
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


def fused_softmax_available(cfg: Config) -> bool:
  """Whether Megatron's fused scale-mask-softmax kernel runs this config's attention
  (FusedScaleMaskSoftmax.is_kernel_available, bigscience-workshop/Megatron-DeepSpeed
  megatron/model/fused_softmax.py): half-precision scores, 16 < seq <= 4096, seq divisible by 4,
  and micro-batch x heads per tensor rank divisible by the kernel's batches per block (4 for
  keys longer than 128, else 8). The chronicles name it: "the constraint is (HEADS/TP)*MBS % 4 =
  0" (seed 004, NHEADs comparison). Otherwise PyTorch's unfused softmax runs, in fp32."""
  m, s = cfg.model, cfg.train.seq_len
  batches = cfg.train.micro_batch_size * m.num_heads // cfg.mesh.tensor
  per_block = 4 if s > 128 else 8
  return (
    m.dtype in ('bfloat16', 'float16')
    and 16 < s <= 4096
    and s % 4 == 0
    and batches % per_block == 0
  )


def score_traffic_bytes(
  cfg: Config, framework: str = 't5x_like', gpu: str | None = None
) -> tuple[float, float]:
  """(forward, backward) HBM bytes per attention score element, per layer and micro-batch: the
  head-count effect. b x heads/TP x s x s scores per layer, so at a fixed hidden size this traffic
  grows with the number of heads while the FLOPs do not.

  Counted on Megatron's kernels with half-precision scores: the forward's QK^T writes the scores
  (2 bytes), the fused softmax reads and writes them (4), dropout reads them and writes them and
  a byte mask (5), the context matmul reads them (2); the backward writes the probabilities'
  gradient (2), reads the probabilities for dV (2), runs dropout's (5) and the softmax's (6)
  backward and reads the scores' gradient for dQ and dK (4). Without attention dropout, 8 and 14.
  Megatron's unfused path (fused_softmax_available False) casts to fp32 and runs scale, mask,
  softmax and the cast back as separate kernels: 33 more bytes forward and 35 backward. The
  same counts stand for t5x_like's attention_impl='xla' (materialised fp32 scores; XLA's GPU
  fusions were not counted: no GPU HLO was read); the others keep the scores on chip
  (attention_impl_on: 'auto' as it resolves on `gpu`)."""
  m = cfg.model
  if attention_impl_on(cfg, gpu, framework) != 'xla':
    return 0.0, 0.0
  dropout = m.attention_dropout > 0
  forward, backward = (13.0, 19.0) if dropout else (8.0, 14.0)
  if framework == 'megatron-deepspeed' and not fused_softmax_available(cfg):
    forward, backward = forward + 33, backward + 35
  return forward, backward


@dataclasses.dataclass(frozen=True)
class Zero:
  """How the state is split over `data`: ZeRO stage, group size G and copies R = data / G."""

  stage: int
  group: int
  copies: int


def zero_of(cfg: Config, framework: str = 't5x_like') -> Zero:
  """The config's ZeRO layout; Megatron-DeepSpeed's runs in the chronicles were ZeRO-1 over all of
  data."""
  mesh = cfg.mesh
  if framework == 'megatron-deepspeed':
    return Zero(1, mesh.data, 1)
  return Zero(mesh.zero_stage, mesh.zero_group_size, mesh.data // mesh.zero_group_size)


def memory_bytes(
  cfg: Config,
  framework: str = 't5x_like',
  gpu: str | None = None,
  residuals_kept: bool | None = None,
  gradients_in_place: bool | None = None,
  fused_chunks_at_once: int = 1,
) -> dict[str, float]:
  """Bytes per GPU by memory_report's categories, for t5x_like's step on a GPU of kind `gpu` (its
  attention_impl='auto' resolved there: attention_impl_on), or, under
  framework='megatron-deepspeed', for Megatron-DeepSpeed's as the chronicles ran it.
  `residuals_kept`: whether 'save_dots' keeps the attention kernel's output and log-sum-exp
  (None: as this code does, keeps_attention_residuals; False: as a step measured before it did).
  `gradients_in_place`: False as a step measured before `adds_gradients_in_place` did.
  `fused_chunks_at_once`: 2 as the steps measured before 2026-11-29 ran the fused loss
  (`fused_loss_bytes`)."""
  _check_framework(framework)
  if framework == 'megatron-deepspeed':
    return _megatron_memory_bytes(cfg)
  m, mesh, b, s = cfg.model, cfg.mesh, cfg.train.micro_batch_size, cfg.train.seq_len
  h, t, p, dp = m.hidden_size, mesh.tensor, mesh.pipeline, mesh.data
  zero = zero_of(cfg, framework)
  g = zero.group
  heads = m.num_heads // t
  stage, embedding = local_params(cfg, framework)
  state = stage + embedding
  layer = layer_params(cfg) / t
  compute_bytes = 2 if m.dtype == 'bfloat16' else 4
  split_seq = t if m.sequence_parallel else 1
  activation = b * s * h * compute_bytes  # one micro-batch's hidden states, whole
  impl = attention_impl_on(cfg, gpu, framework)
  # One layer's attention scores on this GPU, where the implementation materialises them ('xla');
  # the fused kernels keep them on chip.
  scores = b * heads * s * s if impl == 'xla' else 0
  # A layer's matmul outputs: QKV, the scores, the context, the attention and MLP projections
  # (before their reduction: whole), h -> 4h.
  dots = activation * (3 / t + 1 / t + 2 + m.ffn_size / h / t) + scores * compute_bytes
  # The matmul outputs a layer's recomputation keeps by name (model/transformer.py's
  # LAYER_MATMUL_OUTPUTS): QKV, h -> 4h, and the two output projections, after their reduction
  # (split over tensor with sequence parallelism). The scores' and the context's are recomputed.
  saved_matmuls = activation * (3 / t + m.ffn_size / h / t + 2 / split_seq)
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
  # The fp32 master and both moments split over the G ranks of a ZeRO group (hybrid sharding
  # keeps data / G copies of them).
  out['master weights (fp32 params)'] = 4 * state / g
  out['Adam moments'] = adam_bytes_per_param(cfg, stage, embedding) * state / g
  out['batch and step scalars'] = 2 * 4 * cfg.train.global_batch_size / dp * s
  # What the remat policy keeps of one layer for its backward: under 'full' its input; under
  # 'save_dots' the matmul outputs without batch dimensions (the saved ones; not the scores' and
  # the context's, batched over micro-batch and heads) and the layer's input, which the scan
  # keeps; not the MLP's output projection, which no backward reads (XLA drops it although it
  # is named: its GPU compiles of bloom_1b3's step keep QKV, h -> 4h and two [24, 4, 2048,
  # 2048] stacks). Our fused kernels' output and float32 log-sum-exp are kept too, by name.
  # Under 'none', everything: the MLP's tanh-GeLU leaves nine [tokens, ffn] intermediates, QKV
  # and the attention's output four [tokens, h / TP], the LayerNorms, the output projection and
  # the residual four [tokens, h], and a materialised softmax its fp32 scores and bf16
  # probabilities (XLA's GPU compiles of bloom_1b3's step with pallas and xla attention).
  # ZeRO-3 without a pipeline keeps the matmul outputs under 'none' too: its layers gather their
  # weights again in the backward pass (model/transformer.py).
  policy = m.remat_policy
  if policy == 'none' and zero.stage == 3 and p == 1:
    policy = 'save_dots'
  # Unrolled, what a layer's backward would have recomputed is kept with what it saves
  # (`merges_recomputation`): the tanh-GeLU's two [tokens, ffn] products and both LayerNorms'
  # outputs; and under ZeRO-1 each layer's weights as sliced from the compute copy's stacks
  # (ZeRO-3 gathers a layer's where it is used).
  merged = merged_slices = 0.0
  if merges_recomputation(cfg, framework):
    merged = activation * (2 * m.ffn_size / h / t + 2 / split_seq)
    merged_slices = compute_bytes * stage if zero.stage == 1 else 0.0
  if policy == 'full':
    layer_keep = activation / split_seq
  elif policy == 'save_dots':
    layer_keep = saved_matmuls
    if keeps_attention_residuals(impl, residuals_kept):
      layer_keep += activation / t + b * heads * s * 4
    layer_keep += merged
  else:
    ffn = m.ffn_size / h / t
    layer_keep = activation * (9 * ffn + 4 / t + 4 / split_seq) + 3 * scores * compute_bytes
  ticks_1f1b = one_f_one_b(cfg)
  if p > 1:
    if ticks_1f1b:
      kept = 2 * p - 1
    else:
      group = cfg.pipeline.microbatch_group or cfg.num_microbatches
      kept = group * cfg.pipeline.repeats + p - 1
    out['kept stage inputs'] = kept * activation / split_seq
    if not ticks_1f1b and m.remat_policy != 'full':
      # GPipe differentiates its whole schedule: only under 'full' does a tick recompute its
      # stage from the kept input; under the other policies every tick in flight keeps what
      # the policy keeps of each layer of its stage (XLA's GPU compile of configs/bloom_1b3.py,
      # 17 ticks of 12 layers under save_dots: 77.5 GiB per H100; docs/benchmarks.md).
      out['kept activations'] = kept * slots * layer_keep
      if m.remat_policy == 'none':
        # and, no layer checkpointed, its stage's weights in the compute dtype
        out['kept activations'] += kept * compute_bytes * stage
      # and the backward's copy of one tick's, sliced from those stacks.
      out['backward workspace'] += slots * layer_keep
  else:
    out['kept activations'] = m.num_layers * layer_keep
  if p > 1 and (ticks_1f1b or m.remat_policy == 'full'):
    # The backward of a tick recomputes its stage's forward keeping every layer's saved matmul
    # outputs, stacked by the layer scan (XLA's GPU compiles of tr11 and the chronicles' rows
    # hold exactly these [slots, ...] stacks at their peaks); under 'none' everything it keeps,
    # the stage's weights in the compute dtype among it (no layer is checkpointed).
    out['recomputation workspace'] = slots * (saved_matmuls + merged)
    if m.remat_policy == 'none':
      out['recomputation workspace'] = slots * layer_keep + compute_bytes * stage
  # fp32 gradients in the ZeRO layout, and with a pipeline the embedding's whole before its
  # reduction (not under 1F1B, whose embedding backward scatters its rows into the accumulator);
  # under ZeRO-3 also one layer's whole gradient before its reduce-scatter.
  whole_embedding = 0.0 if ticks_1f1b or p == 1 else 4 * embedding
  out['gradient accumulators'] = 4 * state / g + whole_embedding
  if per_rank_pipeline(cfg, framework) or (ticks_1f1b and dp == 1):
    # Each data rank adds its own micro-batches' fp32 gradients up, the stage's whole (with one
    # data rank, the 1F1B schedule's too). Under 1F1B each layer's backward adds its gradient
    # into the accumulator in place: no tick's gradient of the stage is held beside it.
    out['gradient accumulators'] = 4 * state + whole_embedding
    if not ticks_1f1b:
      out['backward workspace'] += compute_bytes * stage
  elif ticks_1f1b:
    # The accumulator split over data, carried by the tick loop, once at the peak: each layer's
    # backward adds into it in place (XLA's GPU compiles of tr11 under ZeRO-1, ZeRO-3 and
    # hybrid ZeRO-1, the chronicles' rows, and 13B and 70B under ZeRO-3; docs/benchmarks.md).
    out['gradient accumulators'] = 4 * state / g
  gpipe = p > 1 and not ticks_1f1b
  if gpipe and m.remat_policy == 'full':
    # A conditional skips the head before the first micro-batch leaves; its transpose returns
    # the head's whole fp32 table gradient beside the accumulators.
    out['gradient accumulators'] += 4 * embedding
  if gpipe and 0 < cfg.pipeline.microbatch_group < cfg.num_microbatches:
    # A schedule per group of micro-batches: each returns its fp32 gradient, which the step
    # adds to its own accumulator after (training/step.py's `schedules_loss_and_grads`).
    out['gradient accumulators'] += 4 * state / (1 if per_rank_pipeline(cfg, framework) else g)
  # One layer's backward: its matmul outputs, and the softmax's f32 probabilities, their
  # gradient and the dropout mask's ('xla'; 2.93 GiB of the 49.07 GiB the H100 measured for
  # bloom_1b3's step against pallas's 46.14). cuDNN's ALiBi is a materialised [heads, s, s]
  # bias and its gradient, which jax's cuDNN attention always returns; tokamax's backward writes
  # the score gradient in bf16 whenever a bias is given (model/attention.py).
  out['backward workspace'] += dots + 3 * 4 * scores
  alibi = m.architecture == 'bloom'
  if impl == 'cudnn' and alibi:
    out['backward workspace'] += 2 * compute_bytes * heads * s * s
  if impl == 'tokamax' and alibi:
    out['backward workspace'] += 2 * b * heads * s * s
  if ticks_1f1b and per_rank_pipeline(cfg, framework):
    # Inside each data rank's shard_map a layer's gradient is scatter-added into the stage's
    # accumulator from an fp32 copy XLA makes of it: where a layer's MLP kernels outweigh its
    # activations, their gradients in the compute dtype and in fp32 are the ticks' peak (XLA's
    # GPU compile of DP 8 TP 2 PP 24: 4.6 GiB there; docs/benchmarks.md).
    mlp_gradients = (compute_bytes + 4) * 2 * h * m.ffn_size / t
    out['backward workspace'] = max(out['backward workspace'], mlp_gradients)
  if p == 1:
    # Without a pipeline the backward of a micro-batch returns the tied embedding's gradient from
    # the logits, whole, in the compute dtype (the chunked loss's chunks stacked), before it is
    # added to the accumulator; and, unless the loop adds in place (`adds_gradients_in_place`),
    # the layers' stacked by the scan in the compute dtype, split over the group like the
    # accumulator (each layer's reduce-scattered as the scan computes it). Both are live
    # through the layers' backward in XLA's GPU compiles of 1.3B to 70B steps
    # (docs/benchmarks.md); the lookup's scatter-add comes after it, where less is live.
    # Under grad_sync 'step' each data rank adds its own gradient up: the accumulator whole.
    in_place = adds_gradients_in_place(cfg, framework, gradients_in_place)
    layers_gradient = 0.0 if in_place else stage / g
    out['backward workspace'] += compute_bytes * (layers_gradient + embedding)
    if per_rank_gradients(cfg, framework):
      out['gradient accumulators'] = 4 * state
    elif zero.copies > 1 and not in_place:
      # Hybrid sharding: each copy accumulates its own gradient inside a shard_map, where XLA
      # fills the lookup's fp32 scatter-add with zeros before the layers' backward, its rows
      # split over the group, not over tensor.
      out['gradient accumulators'] += 4 * cfg.padded_vocab_size * h / g
  if zero.stage == 3 and ticks_1f1b:
    # The split bf16 copy and one layer's MLP weights gathered: where the recomputed forward's
    # attention is the peak (tensor 1) XLA has gathered them ahead of the MLP, elsewhere a
    # smaller gathered weight is there. The embedding gathered at its use and a layer's whole
    # gradient before its reduce-scatter are not live at the ticks' peak (XLA's GPU compiles
    # under ZeRO-3, 2026-11-27 and 28; docs/benchmarks.md).
    mlp_weights = 2 * m.hidden_size * m.ffn_size / t
    out['weight copies'] = compute_bytes * (state / g + mlp_weights)
  elif zero.stage == 3 and p == 1:
    # The split bf16 copy and one layer gathered (the embedding gathered for the logits is the
    # loss's: _no_pipeline_peak); a layer's whole fp32 gradient before its reduce-scatter is not
    # live at the peak (XLA's GPU compiles, docs/benchmarks.md).
    out['weight copies'] = compute_bytes * (state / g + layer)
  elif zero.stage == 3:
    out['gradient accumulators'] += 4 * layer
    # The split bf16 copy, two layers gathered whole (the one computing and the next, gathered
    # just before use) and the embedding gathered where it is used.
    out['weight copies'] = compute_bytes * (state / g + 2 * layer + embedding)
  else:
    # The bf16 copy of the stage and embedding gathered over data, and the embedding's fp32
    # gather it is cast from (none on one rank: the copy is cast from the master; none under
    # 1F1B or without a pipeline either, where it is gone before the peak).
    gathered = 4 * embedding if g > 1 and not ticks_1f1b and p > 1 else 0
    out['weight copies'] = compute_bytes * state + gathered
  out['weight copies'] += merged_slices
  vocab = cfg.padded_vocab_size / t
  if embedding_split_over_pipeline(cfg, framework):
    vocab /= mesh.pipeline  # each stage's head computes its rows' logits
  if m.cross_entropy_impl == 'dense':
    logits = 2 * 4 * b * s * vocab  # fp32 logits and their gradient
  elif m.cross_entropy_impl == 'fused':
    logits = fused_loss_bytes(cfg, compute_bytes, vocab, embedding, fused_chunks_at_once)
  else:
    logits = 2 * 4 * b * s * min(vocab, m.cross_entropy_chunk)
  out['other temporaries'] = logits
  if p == 1:
    _no_pipeline_peak(cfg, out, zero, compute_bytes, stage, embedding, scores)
  elif ticks_1f1b and zero.stage == 1 and not per_rank_pipeline(cfg, framework) and dp > 1:
    # Where the data ranks share the schedule, the head's gradient of the token table comes
    # whole in the compute dtype before its reduce-scatter, beside a second copy of the table's
    # split accumulator: with a large vocabulary per tensor rank that phase is the peak, not the
    # layers' backward (XLA's GPU compile of DP 8 PP 24 TP 2 under 'tick'; docs/benchmarks.md).
    head = (compute_bytes + 4 / g) * embedding
    layers = out['recomputation workspace'] + out['backward workspace']
    out['other temporaries'] += max(0.0, head - layers)
  if p > 1 and m.cross_entropy_impl == 'fused' and not merges_recomputation(cfg, framework):
    # The fused loss's peak is in the head, where the recomputed stage holds its stacked QKV and
    # h -> 4h outputs but neither its output projections' nor a layer's backward workspace
    # (XLA's H100 compile of bloom_1b3 at data 8 x pipeline 2, 1F1B, layers scanned: 12.70 GiB).
    idle = slots * activation * 2 / split_seq + out['backward workspace']
    out['other temporaries'] = max(0.0, out['other temporaries'] - idle)
  if p > 1 and merges_recomputation(cfg, framework):
    # The recomputed stage's merged products and weight slices are live in a layer's backward,
    # the loss's temporaries in the loss: the peak is the larger of the two, not their sum.
    out['other temporaries'] = max(0.0, out['other temporaries'] - slots * merged - merged_slices)
  return out


def fused_loss_bytes(
  cfg: Config, compute_bytes: int, vocab: float, embedding: float, chunks_at_once: int = 1
) -> float:
  """What the fused cross-entropy holds at its peak (a token chunk's logits converted to its
  gradient): the chunk's [chunk, V] tile in fp32 and in the compute dtype, and the fp32
  embedding gradient of the chunks before it. `chunks_at_once` 2: as the fused loss ran until
  2026-11-29, when XLA's GPU compiler unrolled its loop of one iteration and ran a micro-batch's
  two chunks side by side (two tiles of each, no gradient yet)."""
  m, tokens = cfg.model, cfg.train.micro_batch_size * cfg.train.seq_len
  chunk = min(tokens, m.cross_entropy_chunk)
  chunks = -(-tokens // chunk)
  held = min(chunks_at_once, chunks)
  earlier = 4 * embedding if chunks > held else 0.0
  return held * (4 + compute_bytes) * chunk * vocab + earlier


def _no_pipeline_peak(
  cfg: Config,
  out: dict[str, float],
  zero: Zero,
  compute_bytes: int,
  stage: float,
  embedding: float,
  scores: float,
) -> None:
  """Without a pipeline XLA's peak is in one of three phases, not all at once (its GPU compiles,
  docs/benchmarks.md): the layers' backward (`out['backward workspace']`), the loss (its logits
  beyond what the backward holds, in 'other temporaries'; under ZeRO-3 the forward too), and
  under ZeRO-1 over G > 1 ranks the gather of the bf16 copy before the first micro-batch. XLA
  gathers each stacked weight with its split dim outermost and transposes it whole into the
  layout the layers read, so an MLP weight's stack is held twice, with its own shard; where that
  is more than the kept activations and the later phases hold, the difference is in 'weight
  copies'."""
  m = cfg.model
  if m.cross_entropy_impl == 'fused':
    loss = out['other temporaries']  # fused_loss_bytes
  else:
    # The logits' fp32 tiles (the dense loss: all of them and their gradient; the H100 held
    # both, where XLA's compile without a GPU holds one) and the embedding's gradient from them.
    loss = out['other temporaries'] + compute_bytes * embedding
  if zero.stage == 3:
    # The embedding gathered for the logits (gone before the layers' backward), and the layers'
    # split bf16 gradient, which XLA has zero-filled by then. Both are live in the forward too,
    # with the zero-filled gradient from the logits and, with materialised scores ('xla'), a
    # layer's fp32 scores, their masked copy and the bf16 probabilities.
    forward = compute_bytes * embedding + (8 + compute_bytes) * scores
    loss = max(loss, forward) + compute_bytes * (embedding + stage / zero.group)
  out['other temporaries'] = max(0.0, loss - out['backward workspace'])
  g = zero.group
  if zero.stage == 1 and g > 1:
    mlp_stack = m.num_layers * m.hidden_size * m.ffn_size / cfg.mesh.tensor
    transposed = compute_bytes * mlp_stack * (1 + 1 / g)
    later = out['kept activations'] + out['backward workspace'] + out['other temporaries']
    out['weight copies'] += max(0.0, transposed - later)


# HBM bytes per logit of the loss's memory-bound kernels, per micro-batch: 'chunked' reads each
# fp32 tile twice in the forward (the running max, then the exponentials' sum) and in the backward
# reads it again (recomputed) and writes the bf16 gradient tile (4 + 2); 'dense' keeps the fp32
# logits, reads them twice and writes and reads their fp32 gradient; 'fused' reads them twice and
# writes the bf16 gradient in its one pass. The matmuls' own reads and writes are in their time.
LOGITS_BYTES = {'chunked': 14.0, 'dense': 16.0, 'fused': 10.0}


def memory_bound_bytes(
  cfg: Config, framework: str = 't5x_like', gradients_in_place: bool | None = None
) -> dict[str, float]:
  """HBM bytes per GPU of the step's memory-bound kernels (with measured kernel rates only:
  `estimate` runs them at HBM bandwidth): 'layers', the elementwise kernels of a micro-batch
  through the stage's layers; 'logits', the loss's per micro-batch (LOGITS_BYTES); 'gradients',
  adding a micro-batch's gradient to the fp32 accumulator; 'step', once per step.

  Per layer, in units of one hidden-state tensor on this GPU (whole under tensor parallelism,
  1/TP under sequence parallelism; the QKV and MLP activations 1/TP), each kernel reading its
  inputs and writing its outputs once, the bias adds fused into the kernel that follows:
  forward 10 (two LayerNorms 2 each, two bias-plus-residual adds 3 each) + 2 QKV + 2 MLP (bias
  and GeLU); backward 12 (two LayerNorm backwards with the residual gradient 5 each, two bias
  gradients 1 each) + 3 QKV (the q, k, v gradients joined, the bias gradient) + 3 MLP (GeLU's
  backward); the recomputed forward of 'save_dots' 7 + 2 QKV + 2 MLP (LayerNorms, a residual
  add, GeLU: everything but the saved matmuls; none where XLA merges it into the forward,
  `merges_recomputation`), of 'full' (and 1F1B ticks) the whole forward.
  The gradients, split over the ZeRO group as the compile of a 7B on 8 devices splits them (whole
  where each data rank adds its own up without a pipeline, grad_sync 'step'): the micro-batch's read
  in the compute dtype and the accumulator's fp32 read and write; the token lookup's fp32
  scatter-add zero-filled and read (none where the loop adds in place, `adds_gradients_in_place`:
  its rows are scattered into the accumulator); under the chunked loss, whole, its label rows' fp32
  scatter-add likewise and its chunk gradients concatenated and read (3 x the compute dtype): the
  loss of the H100 step this model is fitted on. The chunked loss now makes neither
  (kernels/cross_entropy.py); the term goes when a GPU step measures that (docs/planner.md).
  The step: the bf16 weight copy cast from the master (4 + 2 bytes per param), clipping's norm
  and the accumulator's zeroing (4 each)."""
  m, mesh, b, s = cfg.model, cfg.mesh, cfg.train.micro_batch_size, cfg.train.seq_len
  h, t, p = m.hidden_size, mesh.tensor, mesh.pipeline
  compute_bytes = 2 if m.dtype == 'bfloat16' else 4
  split_seq = t if m.sequence_parallel else 1
  hidden = b * s * h * compute_bytes / split_seq
  qkv = b * s * 3 * h * compute_bytes / t
  mlp = b * s * m.ffn_size * compute_bytes / t
  forward = 10 * hidden + 2 * qkv + 2 * mlp
  backward = 12 * hidden + 3 * qkv + 3 * mlp
  if m.remat_policy == 'full' or one_f_one_b(cfg):
    recomputed = forward
  elif m.remat_policy == 'save_dots' and not merges_recomputation(cfg, framework):
    recomputed = 7 * hidden + 2 * qkv + 2 * mlp
  else:
    recomputed = 0.0
  vocab = cfg.padded_vocab_size / t
  if embedding_split_over_pipeline(cfg, framework):
    vocab /= p
  g = zero_of(cfg, framework).group
  if p == 1 and per_rank_gradients(cfg, framework):
    g = 1  # each data rank adds its whole gradient up
  stage, embedding = local_params(cfg, framework)
  # The token table's: in place, the head's gradient read in the compute dtype (its rows'
  # scatter-add into the accumulator is small); else the lookup's fp32 scatter-add too.
  table = compute_bytes if adds_gradients_in_place(cfg, framework, gradients_in_place) else 8
  gradients = (compute_bytes + 8) * stage / g + (table + 8) * embedding / g
  if m.cross_entropy_impl == 'chunked':
    gradients += (8 + 3 * compute_bytes) * embedding
  return {
    'layers': stage_slots(cfg) * (forward + recomputed + backward),
    'logits': b * s * vocab * LOGITS_BYTES[m.cross_entropy_impl],
    'gradients': gradients,
    'step': 14 * (stage + embedding) / g,
  }


def _megatron_memory_bytes(cfg: Config) -> dict[str, float]:
  """Megatron-DeepSpeed's memory per GPU as the chronicles ran it before 02-28 (fp16/bf16 with
  half-precision gradient accumulation, ZeRO-1 over all of data, full activation checkpointing,
  DeepSpeed's 1F1B pipeline), on the busiest stage (the last: its layers and the tied
  embedding for the logits)."""
  m, mesh, b, s = cfg.model, cfg.mesh, cfg.train.micro_batch_size, cfg.train.seq_len
  h, t, p, dp = m.hidden_size, mesh.tensor, mesh.pipeline, mesh.data
  stage, embedding = local_params(cfg, 'megatron-deepspeed')
  state = stage + embedding
  slots = stage_slots(cfg)
  activation = b * s * h * 2
  scores = b * (m.num_heads // t) * s * s
  fused = fused_softmax_available(cfg)
  # One layer's forward outputs in half precision: QKV, context, the attention and MLP outputs
  # (whole), h -> 4h and its GeLU; the scores, probabilities, dropout mask and dropped
  # probabilities (7 bytes each), plus two fp32 copies on the unfused path.
  layer_forward = activation * (3 / t + 1 / t + 2 + 2 * m.ffn_size / h / t) + scores * (
    7 + (0 if fused else 8)
  )
  return {
    'master weights (fp32 params)': 4 * state / dp,
    'Adam moments': 8 * state / dp,
    # Half-precision gradients whole on every rank, and the fp32 gradient partition DeepSpeed's
    # ZeRO-1 step builds.
    'gradient accumulators': 2 * state + 4 * state / dp,
    # The flat half-precision bucket DeepSpeed's pipeline engine all-reduces the gradients in
    # (MEMORY_OPT_ALLREDUCE_SIZE, 500M elements, deepspeed/runtime/pipe/engine.py).
    'gradient all-reduce bucket': 2 * min(DEEPSPEED_ALLREDUCE_BUCKET, state),
    'weight copies': 2 * state,
    # Every layer's input of each micro-batch in flight (P of them on the first stage under
    # 1F1B; activation checkpointing keeps them whole, not split over tensor).
    'kept stage inputs': min(p, cfg.num_microbatches) * slots * activation,
    'recomputation workspace': layer_forward,
    'backward workspace': layer_forward,
    # The logits of the vocabulary shard: half precision, their fp32 copy and fp32 softmax.
    'other temporaries': b * s * cfg.padded_vocab_size / t * (2 + 4 + 4),
    'CUDA context and kernels': TORCH_CONTEXT_BYTES,
  }


def _ring_bytes(kind: str, size: float, ranks: int) -> float:
  """Bytes each rank moves in a ring collective over `ranks` of a `size`-byte array (the whole
  array: an all-reduce's input, an all-gather's output, a reduce-scatter's input), the
  numerator of nccl-tests' busbw: 2 (n - 1)/n for all-reduce, (n - 1)/n for the others."""
  if ranks <= 1:
    return 0.0
  factor = 2 if kind == 'all-reduce' else 1
  return factor * (ranks - 1) / ranks * size


def _bus_gb_s(spec: Gpu, kind: str, size: float, ranks_per_node: int, spans_nodes: bool) -> float:
  """The busbw (GB/s) a collective of `kind` over `size` bytes reaches per rank: NVLink's within
  a node; across nodes, the group's share of each node's network (`ranks_per_node` of the
  node's GPUs are in it, each of the others in a group of its own doing the same), as NCCL's
  rings cross nodes once per channel, one NIC each. Smaller payloads reach less
  (HALF_BANDWIDTH_BYTES)."""
  nvlink = spec.nvlink_allreduce_gb_s if kind == 'all-reduce' else spec.nvlink_gb_s
  bus = nvlink
  if spans_nodes:
    bus = min(nvlink, spec.network_gb_s * ranks_per_node / spec.gpus_per_node)
  return bus * size / (size + HALF_BANDWIDTH_BYTES)


def collective_s(
  spec: Gpu, kind: str, size: float, ranks: int, ranks_per_node: int, spans_nodes: bool
) -> float:
  """Seconds of one ring collective (nccl-tests' model: busbw x time = the ring bytes)."""
  if ranks <= 1 or size <= 0:
    return 0.0
  bus = _bus_gb_s(spec, kind, size, ranks_per_node, spans_nodes)
  return _ring_bytes(kind, size, ranks) / (bus * 1e9)


def _zero_group_geometry(cfg: Config, spec: Gpu, group: int) -> tuple[int, bool]:
  """(ranks of one ZeRO group per node, whether it spans nodes). A group is `group` consecutive
  data ranks (partitioning.make_mesh), pipeline x tensor devices apart in the device order."""
  stride = cfg.mesh.pipeline * cfg.mesh.tensor
  node = spec.gpus_per_node
  span = group * stride
  if span <= node and node % span == 0:
    return group, False
  return max(1, min(group, node // stride)), True


def estimate(
  cfg: Config,
  gpu: str,
  fitted: Fitted = FITTED,
  nodes_of: int | None = None,
  framework: str = 't5x_like',
  measured_half_work: float | None = None,
  residuals_kept: bool | None = None,
  gradients_in_place: bool | None = None,
  fused_chunks_at_once: int = 1,
) -> dict:
  """The cost of one iteration of `cfg`'s step (at its full global batch) on its mesh of GPUs
  of kind `gpu` (`nodes_of` GPUs per node; None: the kind's): times in seconds, bytes per GPU per
  iteration. `cfg` is a validated config (Config.validate, schedule.check). `framework`:
  FRAMEWORKS, t5x_like's step or Megatron-DeepSpeed's as the chronicles measured it.
  `fitted` prices the kernels on a GPU without measured rates (Gpu.measured) or under
  Megatron-DeepSpeed, `measured_half_work` t5x_like's matmuls on one with them (None: the
  fitted MEASURED_HALF_WORK per layer pass, none for `unrolled_layers`).
  `residuals_kept`: whether remat_policy='save_dots' keeps the attention kernel's output and
  log-sum-exp, sparing the backward its forward (None: as this code does for the implementation,
  keeps_attention_residuals; False: as the steps measured before it did, fit_planner.H100_STEP).
  `gradients_in_place`: likewise for `adds_gradients_in_place` (False: as those steps ran).
  `fused_chunks_at_once`: memory_bytes'."""
  _check_framework(framework)
  spec = gpu_spec(gpu, nodes_of)
  check_topology(cfg, spec)
  megatron = framework == 'megatron-deepspeed'
  m, mesh, train = cfg.model, cfg.mesh, cfg.train
  h, s, b = m.hidden_size, train.seq_len, train.micro_batch_size
  t, p, dp, r = mesh.tensor, mesh.pipeline, mesh.data, cfg.pipeline.repeats
  n, node = mesh.num_devices, spec.gpus_per_node
  micro = cfg.num_microbatches
  slots = stage_slots(cfg)
  compute_bytes = 2 if m.dtype == 'bfloat16' else 4
  impl = attention_impl_on(cfg, gpu, framework)
  # What the backward recomputes: each layer's whole forward under remat_policy='full' and in the
  # 1F1B pipeline's ticks; attention's forward under 'save_dots' too, unless the implementation
  # is one of ours, whose output and log-sum-exp the policy keeps by name (its matmuls have batch
  # dimensions and a library's kernel is no matmul: dots_with_no_batch_dims_saveable keeps
  # neither); the logits under the chunked cross-entropy (its backward recomputes each vocabulary
  # chunk).
  recompute = m.remat_policy == 'full' or one_f_one_b(cfg)
  recompute_attention = recompute or (
    not megatron
    and m.remat_policy == 'save_dots'
    and not keeps_attention_residuals(impl, residuals_kept)
  )
  recompute_head = not megatron and m.cross_entropy_impl == 'chunked'
  split_head = embedding_split_over_pipeline(cfg, framework)
  measured = None if megatron else spec.measured

  # FLOPs of one micro-batch's forward through one stage on one GPU.
  matmul = slots * (2 * b * s * (4 * h * h + 2 * h * m.ffn_size)) / t
  attention = slots * 4 * b * s * s * h / t
  # The head (tied embedding's logits) in every tick's path: split over the stages when the
  # vocabulary is, else run whole by the stage holding it.
  head = 2 * b * s * h * cfg.padded_vocab_size / t
  if split_head:
    head /= p
  recomputed = (
    (matmul if recompute else 0.0)
    + (attention if recompute_attention else 0.0)
    + (head if recompute_head else 0.0)
  )
  layer_work = (matmul + attention) / slots
  tick_memory = memory_bytes_tick = 0.0
  if measured is None:
    # The fitted efficiency curve (A100 rows of the chronicles) for every kernel.
    compute_efficiency = efficiency(layer_work, fitted)
    flops_per_second = spec.peak_bf16_tflops * 1e12 * compute_efficiency
    tick_matmul = 3 * (matmul + head) / flops_per_second
    tick_attention = 3 * attention / flops_per_second
    tick_recompute = recomputed / flops_per_second
    # The attention scores' HBM traffic per layer: forward (twice when it is recomputed) and
    # backward.
    scores = b * (m.num_heads // t) * s * s
    forward_bytes, backward_bytes = score_traffic_bytes(cfg, framework, gpu)
    score_bytes_tick = (
      slots * scores * ((2 if recompute_attention else 1) * forward_bytes + backward_bytes)
    )
  else:
    # Measured rates: the matmuls at the GEMM probe's rate less each layer pass's fixed cost
    # (MEASURED_HALF_WORK), attention at its implementation's measured kernel rates (the
    # materialised scores' traffic of 'xla' included), the memory-bound kernels at HBM bandwidth.
    gemm_work = matmul / slots
    if measured_half_work is None:
      measured_half_work = 0.0 if unrolled_layers(cfg, framework) else MEASURED_HALF_WORK
    compute_efficiency = (
      measured.matmul_tflops / spec.peak_bf16_tflops * gemm_work / (gemm_work + measured_half_work)
    )
    flops_per_second = spec.peak_bf16_tflops * 1e12 * compute_efficiency
    forward_tflops, backward_tflops = measured_attention_tflops(measured, impl, s)
    causal = attention / 2  # the kernels skip the masked half (benchmarks/attention.py's count)
    attention_forward = causal / (forward_tflops * 1e12)
    tick_matmul = 3 * (matmul + head) / flops_per_second
    tick_attention = attention_forward + 2.5 * causal / (backward_tflops * 1e12)
    tick_recompute = ((matmul if recompute else 0.0) + (head if recompute_head else 0.0)) / (
      flops_per_second
    ) + (attention_forward if recompute_attention else 0.0)
    score_bytes_tick = 0.0
    traffic = memory_bound_bytes(cfg, framework, gradients_in_place)
    memory_bytes_tick = traffic['layers'] + traffic['logits']
    tick_memory = memory_bytes_tick / (spec.hbm_gb_s * 1e9)
  tick_scores = score_bytes_tick / (spec.hbm_gb_s * 1e9)

  # Tensor parallelism: per layer and pass, two all-reduces of one micro-batch's hidden states,
  # or under sequence parallelism an all-gather and a reduce-scatter for each (the same bytes, at
  # the ring's bus bandwidth rather than the all-reduce's).
  passes = 3 if recompute else 2
  hidden_bytes = b * s * h * compute_bytes
  if m.sequence_parallel and not megatron:
    tp_one = collective_s(spec, 'all-gather', hidden_bytes, t, t, False) + collective_s(
      spec, 'reduce-scatter', hidden_bytes, t, t, False
    )
  else:
    tp_one = collective_s(spec, 'all-reduce', hidden_bytes, t, t, False)
  tick_tp = slots * passes * 2 * tp_one
  tp_bytes_tick = slots * passes * 2 * _ring_bytes('all-reduce', hidden_bytes, t)

  # Pipeline transfers: an activation forward and a gradient back per tick, 1/t per GPU, over
  # the network when consecutive stages sit on different nodes (each GPU's share of its node's
  # NICs: every GPU of the node sends at once).
  crosses_nodes = t * p > node
  pp_bandwidth = (spec.network_per_gpu_gb_s() if crosses_nodes else spec.nvlink_gb_s) * 1e9
  pp_bytes_tick = 2 * hidden_bytes / t if p > 1 else 0.0
  tick_pp = pp_bytes_tick / pp_bandwidth

  # ZeRO over a group of G data ranks (hybrid: R = data / G copies of the state).
  zero = zero_of(cfg, framework)
  g, copies = zero.group, zero.copies
  stage, embedding = local_params(cfg, framework)
  state = stage + embedding
  layer = layer_params(cfg) / t
  per_node, spans = _zero_group_geometry(cfg, spec, g)

  def group_s(kind: str, size: float) -> float:
    return collective_s(spec, kind, size, g, per_node, spans)

  # ZeRO-3: per micro-batch (a stage's tick), each layer's bf16 weights all-gathered for the
  # forward and again for the backward (recomputation), its fp32 gradient reduce-scattered; the
  # embedding likewise where it is used. Not overlapped with compute (docs/planner.md: a layer
  # gathered inside the scanned layer loop is needed by that iteration's first matmul; only
  # XLA's collective pipelining across iterations could hide it, unverified without GPU HLO).
  # Without a pipeline the gradients are reduce-scattered as the backward computes them: each
  # layer's in the compute dtype, the embedding's from the logits in the compute dtype and from
  # the lookup in fp32 (XLA's GPU compiles of 13B on 64 H100s under ZeRO-1 and ZeRO-3); a
  # pipeline's stages widen theirs to fp32 first (pipeline.compute_copy).
  layer_grad_bytes = compute_bytes if p == 1 else 4
  embedding_grad_bytes = compute_bytes + 4 if p == 1 else 4
  tick_zero3 = 0.0
  zero3_bytes_tick = 0.0
  if zero.stage == 3 and g > 1:
    for size, count, grad_bytes in (
      (layer, slots, layer_grad_bytes),
      (embedding, 1, embedding_grad_bytes),
    ):
      tick_zero3 += count * (
        2 * group_s('all-gather', compute_bytes * size)
        + group_s('reduce-scatter', grad_bytes * size)
      )
      zero3_bytes_tick += count * (
        2 * _ring_bytes('all-gather', compute_bytes * size, g)
        + _ring_bytes('reduce-scatter', grad_bytes * size, g)
      )

  # The schedule: each micro-batch passes each of a stage's R chunks once; P - 1 chunk-ticks of
  # fill and drain per schedule (per group under pipeline.microbatch_group).
  groups = micro // cfg.pipeline.microbatch_group if cfg.pipeline.microbatch_group else 1
  bubble_ticks = groups * (p - 1) / r
  stage_tick = (
    tick_matmul
    + tick_attention
    + tick_recompute
    + tick_scores
    + tick_memory
    + tick_tp
    + tick_pp
    + tick_zero3
  )

  # ZeRO-1: the fp32 gradients reduce-scattered over the group, the bf16 weights all-gathered
  # once per step: under grad_sync='step' (and in Megatron-DeepSpeed) once a step. Under 'tick'
  # t5x_like without a pipeline reduce-scatters each micro-batch's gradient as the backward
  # computes it (layer_grad_bytes, embedding_grad_bytes), and with a pipeline all-reduces each
  # tick's (what XLA's partitioner makes of one schedule over all data ranks).
  dp_s = dp_bytes = 0.0
  if zero.stage == 1 and g > 1:
    kind, reductions, size = 'reduce-scatter', 1, 4 * state
    if not megatron and cfg.grad_sync == 'tick':
      if p == 1:
        reductions = micro
        size = layer_grad_bytes * stage + embedding_grad_bytes * embedding
      else:
        kind, reductions = 'all-reduce', groups * ((micro // groups) * r + p - 1)
    dp_s = reductions * group_s(kind, size) + group_s('all-gather', compute_bytes * state)
    dp_bytes = reductions * _ring_bytes(kind, size, g) + _ring_bytes(
      'all-gather', compute_bytes * state, g
    )
  # Hybrid sharding: each rank's 1/G fp32 gradient shard all-reduced across the R copies (ranks
  # G x pipeline x tensor devices apart), once per step: each copy runs its own micro-batch loop
  # or schedule (step.own_gradient_axes).
  replica_s = replica_bytes = 0.0
  if copies > 1:
    shard = 4 * state / g
    apart = g * p * t
    replica_spans = n > node
    replica_per_node = max(1, min(copies, node // apart)) if replica_spans else copies
    replica_s = collective_s(spec, 'all-reduce', shard, copies, replica_per_node, replica_spans)
    replica_bytes = _ring_bytes('all-reduce', shard, copies)

  # The embedding held whole by every stage: its gradient summed over the stages.
  embedding_bytes = _ring_bytes('all-reduce', 4 * embedding, p) if p > 1 and not split_head else 0.0
  # Adam reads the fp32 params, both moments and the gradient and writes the first three and
  # the bf16 copy, on its 1/G shard.
  optimizer_bytes = state / g * (4 * 4 + 3 * 4 + compute_bytes)
  # Measured rates: the memory-bound kernels outside the ticks (the micro-batches' gradients
  # added to the accumulator, the step's weight cast, clipping and zeroing).
  memory_bytes_step = micro * memory_bytes_tick
  if measured is not None:
    memory_bytes_step += micro * traffic['gradients'] + traffic['step']

  parts = {
    'matmul_s': micro * tick_matmul,
    'attention_s': micro * tick_attention,
    'attention_scores_s': micro * tick_scores,
    'memory_bound_s': memory_bytes_step / (spec.hbm_gb_s * 1e9),
    'recompute_s': micro * tick_recompute,
    'tensor_parallel_s': micro * tick_tp,
    'pipeline_transfer_s': micro * tick_pp,
    'zero3_gather_s': micro * tick_zero3,
    'pipeline_bubble_s': bubble_ticks * stage_tick,
    'data_parallel_s': dp_s,
    'replica_allreduce_s': replica_s,
    'embedding_sync_s': embedding_bytes / pp_bandwidth,
    'optimizer_s': optimizer_bytes / (spec.hbm_gb_s * 1e9),
  }
  step = sum(parts.values())
  memory = memory_bytes(
    cfg, framework, gpu, residuals_kept, gradients_in_place, fused_chunks_at_once
  )
  memory_gib = sum(memory.values()) / GIB
  # A PyTorch process may use the whole device; JAX takes its fraction.
  fraction = 1.0 if megatron else jax_memory_fraction()
  usable_gib = spec.hbm_gib * fraction
  model_flops = accounting.megatron_flops_per_iteration(cfg, train.global_batch_size, s)
  report = {
    'gpu': gpu,
    'framework': framework,
    'mesh': [dp, p, t],
    'zero_stage': zero.stage,
    'zero_group': g,
    # When the data ranks sum their gradients (None with one data rank).
    'grad_sync': cfg.grad_sync if dp > 1 else None,
    'attention_impl': impl,
    'micro_batch_size': b,
    'num_microbatches': micro,
    'estimated_step_s': step,
    'estimated_tflops_per_gpu': model_flops / step / n / 1e12,
    'estimated_memory_gib': memory_gib,
    'fits': memory_gib <= usable_gib,
    'near_limit': memory_gib <= usable_gib < memory_gib * (1 + MEMORY_ERROR),
    'hbm_gib': spec.hbm_gib,
    'usable_gib': usable_gib,
    **parts,
    'compute_efficiency': compute_efficiency,
    'bubble_fraction': bubble_ticks / (micro + bubble_ticks),
    'matmul_flops_per_gpu': micro * 3 * (matmul + head),
    'attention_flops_per_gpu': micro * 3 * attention,
    'recompute_flops_per_gpu': micro * recomputed,
    'attention_score_bytes_per_gpu': micro * score_bytes_tick,
    'memory_bound_bytes_per_gpu': memory_bytes_step,
    'tensor_parallel_bytes_per_gpu': micro * tp_bytes_tick,
    'pipeline_transfer_bytes_per_gpu': micro * pp_bytes_tick,
    'zero3_bytes_per_gpu': micro * zero3_bytes_tick,
    'data_parallel_bytes_per_gpu': dp_bytes,
    'replica_allreduce_bytes_per_gpu': replica_bytes,
    'embedding_sync_bytes_per_gpu': embedding_bytes,
    'memory_gib_by_category': {k: v / GIB for k, v in memory.items()},
  }
  if zero.stage == 3:
    # The bound if XLA hid every ZeRO-3 gather and reduce-scatter behind the compute: what an
    # overlap found in the GPU HLO would be worth at most.
    tick_compute = tick_matmul + tick_attention + tick_recompute + tick_scores + tick_memory
    hidden = (micro + bubble_ticks) * min(tick_zero3, tick_compute)
    report['estimated_step_s_if_zero3_overlapped'] = step - hidden
  if report['near_limit']:
    report['why_near'] = (
      f"{memory_gib:.1f} GiB per GPU is within {MEMORY_ERROR:.0%} (the memory model's error) "
      f'of the {usable_gib:.1f} GiB JAX may use of one {gpu}: `plan --gpu` compiles the step '
      "for XLA's own figure"
    )
  if not report['fits']:
    allocator = (
      'PyTorch may use all of it'
      if megatron
      else f'{fraction:g} of {spec.hbm_gib:g} GiB; XLA_PYTHON_CLIENT_MEM_FRACTION raises it'
    )
    report['why_not'] = (
      f'{memory_gib:.1f} GiB per GPU exceeds the {usable_gib:.1f} GiB '
      f'{"Megatron-DeepSpeed" if megatron else "JAX"} may use of one {gpu} ({allocator})'
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


def zero_choices(data: int, pipeline: int, tensor: int, node: int) -> list[tuple[int, int]]:
  """The (zero_stage, zero_group) pairs `search` ranks for a mesh: ZeRO-1 and ZeRO-3, each over
  all of data (zero_group 0) and, where it differs, over the data ranks of one node (hybrid
  sharding: node / (pipeline x tensor) ranks, when that divides data)."""
  if data == 1:
    return [(1, 0)]
  groups = [0]
  in_node = node // (pipeline * tensor)
  if 1 < in_node < data and data % in_node == 0:
    groups.append(in_node)
  return [(stage, group) for stage in (1, 3) for group in groups]


# The parts of estimated_step_s (estimate's report).
TIME_PARTS = (
  'matmul_s',
  'attention_s',
  'attention_scores_s',
  'memory_bound_s',
  'recompute_s',
  'tensor_parallel_s',
  'pipeline_transfer_s',
  'zero3_gather_s',
  'pipeline_bubble_s',
  'data_parallel_s',
  'replica_allreduce_s',
  'embedding_sync_s',
  'optimizer_s',
)


def why_behind(best: dict, other: dict, parts: int = 2) -> str:
  """Why `other` ranks below `best` (both estimate reports): its extra seconds per iteration, the
  parts that add most of them and the part it saves most on."""
  extra = other['estimated_step_s'] - best['estimated_step_s']
  deltas = sorted(((other[k] - best[k], k) for k in TIME_PARTS), reverse=True)
  lost = ', '.join(f'{k} +{d:.3g}' for d, k in deltas[:parts] if d > 0)
  text = f'+{extra:.3g} s ({extra / best["estimated_step_s"]:+.1%}) vs rank 1: {lost or "-"}'
  saved, part = deltas[-1]
  if saved < 0:
    text += f'; saves {part} {saved:.3g}'
  return text


def other_grad_sync(cfg: Config, fits: bool) -> str | None:
  """The pipeline.grad_sync --search also ranks `cfg` under, beside the one 'auto' resolved to
  (a config that names one is ranked as it is), given whether `cfg` fits: 'tick' for a ZeRO-1
  pipeline over several data ranks that does not fit under 'step' (each rank holds the stage's
  whole fp32 gradient; 'tick' trades it for an all-reduce at every tick), and 'step' for a
  ZeRO-1 step without a pipeline over several data ranks (one fp32 reduce-scatter a step
  instead of each micro-batch's in the compute dtype, for the whole fp32 gradient on every
  rank), ranked where it fits too. None otherwise."""
  mesh = cfg.mesh
  if cfg.pipeline.grad_sync != 'auto' or mesh.zero_stage != 1 or mesh.data == 1:
    return None
  if mesh.pipeline > 1:
    return None if fits else 'tick'
  return 'step'


def search(cfg: Config, gpus: int, gpu: str, nodes_of: int | None = None) -> list[dict]:
  """Every valid (data, pipeline, tensor, micro-batch, ZeRO stage, ZeRO group) for `gpus` GPUs
  of kind `gpu` at `cfg`'s model, sequence and global batch (and ramp-up), each with its
  estimate: those that fit first, then those that do not, each group by estimated seconds per
  iteration. Each carries `why_not` (memory) when it does not fit and `why_behind` (its extra
  seconds and the parts they come from against the first) when it is not the first.

  Valid: tensor divides the heads, hidden and FFN sizes and the node; the layers go over the
  stages with at most one padding slot each; the global batch and every ramp-up batch divide by
  micro-batch x data, into at least as many micro-batches as stages (Config.validate and
  schedule.check decide, as for a run). ZeRO: zero_choices. A ZeRO-1 pipeline that does not fit
  with grad_sync 'step' is ranked with 'tick' too, and a ZeRO-1 step without a pipeline with
  'step' too where that fits (other_grad_sync). More GPUs than `max_gpus` is a ConfigError."""
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
        for zero_stage, zero_group in zero_choices(data, pipeline, tensor, spec.gpus_per_node):
          try:
            candidate = cfg.replace(
              mesh={
                'data': data,
                'pipeline': pipeline,
                'tensor': tensor,
                'zero_stage': zero_stage,
                'zero_group': zero_group,
              },
              train={'micro_batch_size': micro},
              # ZeRO-3 gathers inside one schedule over all the data ranks.
              pipeline={'grad_sync': 'tick' if zero_stage == 3 else cfg.pipeline.grad_sync},
            ).validate()
            schedule.check(candidate)
          except ConfigError:
            continue  # a divisibility the loops above do not check (FFN, vocabulary, groups)
          found = estimate(candidate, gpu, nodes_of=nodes_of)
          results.append(found)
          other = other_grad_sync(candidate, found['fits'])
          if other:
            synced = estimate(
              candidate.replace(pipeline={'grad_sync': other}), gpu, nodes_of=nodes_of
            )
            if synced['fits'] or other == 'tick':
              results.append(synced)
  results.sort(key=lambda r: (not r['fits'], r['estimated_step_s']))
  for r in results[1:]:
    r['why_behind'] = why_behind(results[0], r)
  return results
