"""The processes of a multi-host run, and how they find each other before JAX starts.

JAX runs the same program in every process of a job; `jax.distributed.initialize` connects them,
and must run before any backend starts. Where the process group comes from, first match wins:

* explicit flags of `python -m t5x_like.train`: `--coordinator_address HOST:PORT
  --num_processes N --process_id I` (all three; any launcher, and the tests);
* SLURM, when the job step has more than one task (`srun` with `--ntasks` > 1): JAX's SLURM
  detection. The coordinator is the step's first node, its port is derived from the job id
  (`JAX_COORDINATOR_PORT` overrides it), the process id is SLURM_PROCID, and on GPUs each task
  takes the GPU of its SLURM_LOCALID: launch one task per GPU (launch/slurm/train.sbatch);
* otherwise a single process, which needs no coordinator.

On CPU the mesh runs on virtual devices split evenly over the processes (mesh size / N each) and
cross-process collectives use gloo, so a multi-process run can be tested on one machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import numpy as np

from t5x_like.errors import ConfigError

# jax is imported where it is used: `python -m t5x_like.train` parses and validates its command
# line (this module included) before JAX is loaded, so bad input fails at once.

_SLURM_VARS = (
  'SLURM_JOB_ID',
  'SLURM_STEP_NODELIST',
  'SLURM_NTASKS',
  'SLURM_PROCID',
  'SLURM_LOCALID',
)


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
  """This process's place in the job. `coordinator_address` None: JAX's SLURM detection finds it."""

  num_processes: int = 1
  process_id: int = 0
  coordinator_address: str | None = None
  source: str = 'single process'

  @property
  def is_multi_process(self) -> bool:
    return self.num_processes > 1


# The group this process joined; 1 process until `initialize` says otherwise.
_joined = ProcessGroup()


def from_flags_or_environment(
  coordinator_address: str | None, num_processes: int | None, process_id: int | None, environ=None
) -> ProcessGroup:
  """The process group from the command line's flags, else from SLURM, else a single process."""
  environ = os.environ if environ is None else environ
  flags = {
    '--coordinator_address': coordinator_address,
    '--num_processes': num_processes,
    '--process_id': process_id,
  }
  given = [name for name, value in flags.items() if value is not None]
  if given:
    missing = [name for name in flags if name not in given]
    if missing:
      raise ConfigError(
        f'{", ".join(given)} given without {", ".join(missing)}: a multi-process '
        'run needs all three (or none, under SLURM or for one process)'
      )
    assert coordinator_address is not None and num_processes is not None
    assert process_id is not None
    if num_processes < 1 or not 0 <= process_id < num_processes:
      raise ConfigError(
        f'--process_id {process_id} is not in [0, --num_processes '
        f'{num_processes}); number the processes 0 to N - 1'
      )
    host, _, port = coordinator_address.rpartition(':')
    if not host or not port.isdigit():
      raise ConfigError(
        f'--coordinator_address {coordinator_address!r} is not HOST:PORT; pass '
        'the address of process 0, e.g. node001:12345'
      )
    return ProcessGroup(num_processes, process_id, coordinator_address, 'command-line flags')
  if all(var in environ for var in _SLURM_VARS) and int(environ['SLURM_NTASKS']) > 1:
    return ProcessGroup(
      int(environ['SLURM_NTASKS']),
      int(environ['SLURM_PROCID']),
      None,
      f'SLURM job {environ["SLURM_JOB_ID"]}',
    )
  return ProcessGroup()


def initialize(group: ProcessGroup, mesh_devices: int) -> None:
  """Joins `group` (before any JAX backend starts); on CPU, gives this process its share of the
  mesh's virtual devices. One process: nothing to join."""
  global _joined
  if not group.is_multi_process:
    return
  import jax

  from t5x_like.mesh import partitioning

  if partitioning.cpu_only():
    if mesh_devices % group.num_processes:
      raise ConfigError(
        f'the mesh has {mesh_devices} devices, which {group.num_processes} CPU '
        'processes cannot share evenly; use a process count that divides '
        'mesh.data x mesh.pipeline x mesh.tensor'
      )
    jax.config.update('jax_num_cpu_devices', mesh_devices // group.num_processes)
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  if group.coordinator_address is None:
    jax.distributed.initialize()  # SLURM: JAX reads the job's environment itself
  else:
    jax.distributed.initialize(group.coordinator_address, group.num_processes, group.process_id)
  _joined = group


def check_same_run(config_json: str, workdir: str) -> None:
  """One clear error on every process when the processes were not given the same run.

  A process with another config or workdir would compile another program, or write elsewhere,
  and the collectives of the first step would hang or mix unrelated arrays. Each process's
  fingerprint of (config, workdir) is all-gathered; any difference stops all of them.
  """
  if not _joined.is_multi_process:
    return
  from jax.experimental import multihost_utils

  digest = hashlib.sha256(f'{config_json}\n{os.path.abspath(workdir)}'.encode()).digest()
  mine = np.frombuffer(digest[:4], np.int32)  # 32 bits: JAX's default integer width
  everyone = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
  differ = [i for i, fingerprint in enumerate(everyone) if fingerprint != everyone[0]]
  if differ:
    raise ConfigError(
      f'process(es) {differ} were started with another config or workdir than '
      f'process 0 ({_joined.num_processes} processes, {_joined.source}); start '
      'every process with the same command line'
    )


def joined() -> ProcessGroup:
  """The group this process joined (a single process until `initialize` joined one)."""
  return _joined
