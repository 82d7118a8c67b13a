"""GPUs described to XLA, so that its GPU compiler runs on a machine without one (a login node, a
CPU CI): `plan --gpu KIND` compiles a config's step for KIND's devices and reports XLA's own
memory figure per GPU, where a CPU compile gives an estimate (docs/planner.md).

It needs jax's CUDA plugin at jax's version (`pip install jax-cuda13-plugin==V
jax-cuda13-pjrt==V`, as `jax[cuda13]` installs on a GPU cluster; the test extras install it
too), not a GPU, a driver or CUDA's libraries: the compile makes the program and its buffer
assignment, and runs nothing. XLA takes the device from a GpuTargetConfig: the data sheet's SM
count, memory, bandwidth and clock, and CUDA's shared-memory and register limits for the
compute capability. What it cannot know is autotuning's choice of kernels, which moves no
buffer: the figure equals a GPU's own compile on the same jax (docs/benchmarks.md). The compiler
is jax's, so the figure moves with jax's version.
"""

from __future__ import annotations

from t5x_like.config import ConfigError
from t5x_like.model import attention
from t5x_like.planning import cost_model

_HOPPER_LIMITS = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""
_AMPERE_LIMITS = """
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 167936
  shared_memory_per_block_optin: 166912
  threads_per_core_limit: 2048
  fpus_per_core: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  cuda_compute_capability { major: 8 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
"""
# kind (cost_model.GPUS' names, whose memory and bandwidth it takes) -> (CUDA's device name, the
# architecture's limits, SMs).
DEVICES = {
  'a100-40gb': ('NVIDIA A100-SXM4-40GB', _AMPERE_LIMITS, 108),
  'a100-80gb': ('NVIDIA A100-SXM4-80GB', _AMPERE_LIMITS, 108),
  'h100-80gb': ('NVIDIA H100 80GB HBM3', _HOPPER_LIMITS, 132),
  'h200': ('NVIDIA H200', _HOPPER_LIMITS, 132),
}
GPUS_PER_NODE = 8


def compute_capability(kind: str) -> str:
  """CUDA's 'major.minor' of a GPU kind, as its limits give it to XLA."""
  limits = DEVICES[kind][1]
  major = limits.split('major: ', 1)[1].split()[0]
  minor = limits.split('minor: ', 1)[1].split()[0]
  return f'{major}.{minor}'


def attention_device(kind: str) -> attention.Device:
  """The device `model.attention_impl` is checked and resolved for ('auto' by its family) when
  the step is compiled for GPUs of `kind`: what the abstract devices' own description says."""
  return attention.Device('gpu', DEVICES[kind][0], compute_capability(kind))


def target_config(kind: str) -> str:
  """XLA's GpuTargetConfig (text format) of a GPU kind."""
  name, limits, sms = DEVICES[kind]
  spec = cost_model.GPUS[kind]
  bandwidth, memory = round(spec.hbm_gb_s * 1e9), round(spec.hbm_gib * 2**30)
  return (
    'gpu_device_info {'
    + limits
    + f'  core_count: {sms} memory_bandwidth: {bandwidth} device_memory_size: {memory} }}\n'
    'platform_name: "CUDA"\n'
    'dnn_version_info { major: 9 minor: 10 }\n'
    'runtime_version { major: 13 minor: 0 }\n'
    f'device_description_str: "{name}"\n'
  )


def topology_for(num_devices: int) -> str:
  """jax's name of a GPU topology of `num_devices` (slices x hosts x devices per host): one host
  up to a node's 8 GPUs, else whole nodes of 8."""
  if num_devices <= GPUS_PER_NODE:
    return f'1x1x{num_devices}'
  if num_devices % GPUS_PER_NODE:
    raise ConfigError(
      f'{num_devices} GPUs: a mesh of more than {GPUS_PER_NODE} is compiled for whole nodes of '
      f'{GPUS_PER_NODE}; make data x pipeline x tensor a multiple of {GPUS_PER_NODE}'
    )
  return f'{num_devices // GPUS_PER_NODE}x1x{GPUS_PER_NODE}'


def devices(kind: str, num_devices: int) -> list:
  """`num_devices` abstract GPUs of `kind` to compile for (a mesh of them runs nothing); one
  ConfigError for an unknown kind or a machine without jax's CUDA plugin."""
  if kind not in DEVICES:
    raise ConfigError(f'no GPU kind {kind!r} to compile for; one of: {", ".join(DEVICES)}')
  topology = topology_for(num_devices)
  import jax
  from jax.experimental import topologies

  try:
    description = topologies.get_topology_desc(
      kind, 'cuda', target_config=target_config(kind), topology=topology
    )
  except Exception as e:  # noqa: BLE001 (jax raises several kinds for a missing plugin)
    raise ConfigError(
      f'cannot compile for {kind} on this machine ({type(e).__name__}: {str(e)[:200]}); '
      "install jax's CUDA plugin at jax's version: pip install "
      f'jax-cuda13-plugin=={jax.__version__} jax-cuda13-pjrt=={jax.__version__}'
    ) from None
  return list(description.devices)


# XLA's GPU compiler picks the tiles of its Triton GEMM fusions by autotuning on the device; without
# one it takes a default, and for some shapes (head_dim 224's projections) no tiling of it fits:
# "Couldn't find output tile sizes". Those programs are compiled with cuBLAS GEMMs, a choice
# autotuning makes too, which moves no buffer of the step.
TRITON_GEMM_OFF = {'xla_gpu_enable_triton_gemm': False}
_NO_TRITON_TILING = "Couldn't find output tile sizes"


def compile_without_cache(lowered, kind: str, compiler_options: dict | None = None) -> tuple:
  """(compiled, the XLA options it needed) of `lowered.compile(compiler_options)` for abstract
  GPUs of `kind`: {} or TRITON_GEMM_OFF. Kept out of JAX's persistent compilation cache: no
  process can load such an executable (reading it back is a warning and a recompile). An option
  this XLA does not know is raised as XLA raises it (memory_report drops it and retries); any
  other failure of XLA's GPU compiler is one ConfigError naming it."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  # JAX decides once per process whether its cache is used: reset around the change.
  before = jax.config.jax_enable_compilation_cache  # type: ignore[attr-defined]
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  options: dict = {}
  try:
    while True:
      try:
        merged = {**(compiler_options or {}), **options}
        return lowered.compile(compiler_options=merged or None), options
      except jax.errors.JaxRuntimeError as e:
        if 'No such compile option' in str(e):
          raise
        if _NO_TRITON_TILING in str(e) and not options:
          options = dict(TRITON_GEMM_OFF)
          continue
        first = str(e).strip().splitlines()[0][:600]
        raise ConfigError(
          f"XLA's GPU compiler (jax {jax.__version__}) failed to compile the step for {kind}"
          f'{" with " + str(options) if options else ""}: {first}'
        ) from None
  finally:
    jax.config.update('jax_enable_compilation_cache', before)
    compilation_cache.reset_cache()
