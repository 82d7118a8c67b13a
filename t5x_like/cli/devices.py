"""`python -m t5x_like.devices`: find the slow device of a job, on every node at once.

  python -m t5x_like.devices [--dtype bfloat16] [--size 8192] [--repeats 10] [--tolerance 0.03]
      [--all_reduce_mib 256] [--json] [--cpu_devices N]
      [--coordinator_address HOST:PORT --num_processes N --process_id I]
  srun --nodes=48 --ntasks-per-node=8 --gpus-per-node=8 python -m t5x_like.devices

In tr11 one GPU of 384 slowed down and the whole run lost 5% of its throughput (149 to 140
TFLOPs). Every step waits for the slowest device. There was no tool to say which GPU, and it took
a weekend of excluding nodes three at a time to find it. Here every process of the job times the
same square matmul on each of its own devices, one device at a time and with no collective (a
collective would make every device as slow as the slowest). Then the processes all-gather their
timings, and process 0 prints one row per device, slowest first: process, host, device, TFLOP/s
(median of --repeats) and its ratio to the median device. It names every device slower than the
median by more than --tolerance, with the host to `sbatch --exclude`.

Then the links (interconnect.py): all-reduces of --all_reduce_mib MiB a device within each node,
between ring pairs of nodes and across the whole job, in NCCL-tests' bus bandwidth. A node whose
devices, or whose best pair, all-reduce slower than the median by more than --tolerance is named
too. --all_reduce_mib 0 skips them.

The processes find each other as `python -m t5x_like.train`'s do (`distributed.py`: flags, or
SLURM with one task per GPU). On CPU, `--cpu_devices N` gives the job N virtual devices, split
evenly over its processes. They share the same cores, so only the mechanics are checked there.

Exit codes: 0 every device and node within the tolerance, 1 some device or node slower (named on
stderr), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np

from t5x_like.cli import interconnect
from t5x_like.config import ConfigError
from t5x_like.mesh import distributed

_HOST_BYTES = 64  # host names travel as fixed-width byte rows in the all-gather


def slow_devices(rows: list[dict], tolerance: float) -> list[dict]:
  """The rows whose `tflops` is below (1 - tolerance) x the median of all rows."""
  median = statistics.median(r['tflops'] for r in rows)
  return [r for r in rows if r['tflops'] < (1.0 - tolerance) * median]


def measure_device(device, size: int, dtype: str, repeats: int) -> float:
  """TFLOP/s of an n x n matmul on `device` alone: the median of `repeats` timed calls."""
  import jax
  import jax.numpy as jnp

  a = jax.device_put(jnp.full((size, size), 0.5, dtype), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * size**3 / statistics.median(times) / 1e12


def check_sizes_fit(size: int, dtype: str, all_reduce_mib: int, local_devices: int) -> None:
  """One ConfigError when the n x n matmul and its product, or an all-reduce's buffer and its
  result, would not fit in a local device's memory (for CPU devices: the host's, which holds one
  matrix at a time, and every local device's all-reduce buffers at once)."""
  from t5x_like.training.device_memory import accelerator_memory

  matmul = 2 * size * size * (2 if dtype == 'bfloat16' else 4)
  accelerator = accelerator_memory()
  limit = (
    accelerator[0] if accelerator else os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  )
  if matmul > limit:
    raise ConfigError(
      f'--size {size}: the {size} x {size} {dtype} matrix and its product need '
      f'{matmul / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB of a '
      'device; use a smaller --size (the default, 8192, needs 0.25 GiB)'
    )
  all_reduce = 2 * all_reduce_mib * interconnect.MIB * (1 if accelerator else local_devices)
  if all_reduce > limit:
    raise ConfigError(
      f'--all_reduce_mib {all_reduce_mib}: the all-reduce buffers and results need '
      f'{all_reduce / 2**30:.1f} GiB, more than the {limit / 2**30:.1f} GiB '
      f'{"of a device" if accelerator else "of this host"}; use a smaller --all_reduce_mib'
    )


def measure_local(size: int, dtype: str, repeats: int) -> np.ndarray:
  """[local devices, 2] float32: (device id, TFLOP/s) of each of this process's devices."""
  import jax

  return np.asarray(
    [(d.id, measure_device(d, size, dtype, repeats)) for d in jax.local_devices()], np.float32
  )


def node_name() -> str:
  """The name `sbatch --exclude` takes: SLURM's for this node (SLURMD_NODENAME) in a job step,
  else the host name."""
  return os.environ.get('SLURMD_NODENAME') or socket.gethostname()


def gather(local: np.ndarray) -> list[dict]:
  """Every process's rows, with its index and node name (process_allgather; one process: as is)."""
  import jax

  host = node_name()
  if jax.process_count() == 1:
    return [{'process': 0, 'host': host, 'device': int(i), 'tflops': float(t)} for i, t in local]
  from jax.experimental import multihost_utils

  counts = np.asarray(multihost_utils.process_allgather(np.int32(len(local)))).reshape(-1)
  padded = np.full((int(counts.max()), 2), np.nan, np.float32)
  padded[: len(local)] = local
  everyone = np.asarray(multihost_utils.process_allgather(padded))
  name = np.zeros(_HOST_BYTES, np.uint8)
  encoded = host.encode()[:_HOST_BYTES]
  name[: len(encoded)] = np.frombuffer(encoded, np.uint8)
  hosts = np.asarray(multihost_utils.process_allgather(name))
  rows = []
  for process, (table, count) in enumerate(zip(everyone, counts)):
    host_name = bytes(hosts[process]).rstrip(b'\0').decode(errors='replace')
    rows += [
      {'process': process, 'host': host_name, 'device': int(i), 'tflops': float(t)}
      for i, t in table[:count]
    ]
  return rows


def report(rows: list[dict], tolerance: float) -> tuple[dict, list[str]]:
  """(JSON summary, table lines) of the gathered rows, slowest first."""
  median = statistics.median(r['tflops'] for r in rows)
  rows = sorted(({**r, 'vs_median': r['tflops'] / median} for r in rows), key=lambda r: r['tflops'])
  slow = slow_devices(rows, tolerance)
  lines = [
    f'{len(rows)} devices in {len({r["process"] for r in rows})} process(es); median '
    f'{median:.4g} TFLOP/s; tolerance {tolerance:.1%}',
    f'{"process":>8} {"host":<24} {"device":>7} {"TFLOP/s":>9} {"vs median":>10}',
  ]
  for r in rows:
    mark = '  <- slow' if r in slow else ''
    lines.append(
      f'{r["process"]:>8} {r["host"]:<24} {r["device"]:>7} {r["tflops"]:>9.4g} '
      f'{r["vs_median"]:>10.3f}{mark}'
    )
  summary = {'median_tflops': median, 'tolerance': tolerance, 'devices': rows, 'slow': slow}
  return summary, lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.devices',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--dtype', default='bfloat16', choices=['bfloat16', 'float32'])
  parser.add_argument('--size', type=int, default=8192, help='n of the n x n matmul')
  parser.add_argument('--repeats', type=int, default=10, help='timed calls per device')
  parser.add_argument(
    '--tolerance',
    type=float,
    default=0.03,
    help='a device slower than the median by more than this fraction is named',
  )
  parser.add_argument(
    '--all_reduce_mib',
    type=int,
    default=256,
    help='MiB a device of the all-reduces that check the links (0: none)',
  )
  parser.add_argument('--json', action='store_true', help='print one JSON object (process 0)')
  parser.add_argument(
    '--cpu_devices',
    type=int,
    default=0,
    help='on CPU: virtual devices of the whole job (default: one per process)',
  )
  parser.add_argument('--coordinator_address', help='HOST:PORT of process 0 (outside SLURM)')
  parser.add_argument('--num_processes', type=int)
  parser.add_argument('--process_id', type=int)
  args = parser.parse_args(argv)
  try:
    if (
      args.size < 1
      or args.repeats < 1
      or not 0 < args.tolerance < 1
      or args.cpu_devices < 0
      or args.all_reduce_mib < 0
    ):
      raise ConfigError(
        f'--size and --repeats must be >= 1, --tolerance in (0, 1), --cpu_devices and '
        f'--all_reduce_mib >= 0; got {args.size}, {args.repeats}, {args.tolerance}, '
        f'{args.cpu_devices} and {args.all_reduce_mib}'
      )
    group = distributed.from_flags_or_environment(
      args.coordinator_address, args.num_processes, args.process_id
    )
    devices = args.cpu_devices or group.num_processes
    distributed.initialize(group, devices)
    if not group.is_multi_process and args.cpu_devices:
      from t5x_like.mesh import partitioning

      partitioning.ensure_devices(args.cpu_devices)
    import jax

    check_sizes_fit(args.size, args.dtype, args.all_reduce_mib, jax.local_device_count())
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2

  rows = gather(measure_local(args.size, args.dtype, args.repeats))
  summary, lines = report(rows, args.tolerance)
  if args.all_reduce_mib:
    nbytes = args.all_reduce_mib * interconnect.MIB
    results = interconnect.measure(rows, nbytes, args.repeats)
    slow_links = interconnect.slow_links(results, args.tolerance)
    summary['all_reduce'] = {'mib': args.all_reduce_mib, 'groups': results, 'slow': slow_links}
    lines += interconnect.report_lines(results, nbytes, slow_links)
  if jax.process_index() == 0:
    print(json.dumps(summary) if args.json else '\n'.join(lines), flush=True)
    for r in summary['slow']:
      print(
        f'slow: process {r["process"]} on {r["host"]}, device {r["device"]}: '
        f'{r["tflops"]:.2f} TFLOP/s, {r["vs_median"]:.3f} of the median; exclude the host '
        f'(sbatch --exclude={r["host"]}) or report the device',
        file=sys.stderr,
      )
    for r in summary.get('all_reduce', {}).get('slow', []):
      what = "its devices'" if r['kind'] == 'node' else 'its best ring pair'
      which = "the median node's" if r['kind'] == 'node' else "the median node's best"
      link = 'NVLink or PCIe' if r['kind'] == 'node' else 'network link'
      print(
        f'slow: node {r["node"]}: all-reduce bandwidth of {what} {r["busbw_gbs"]:.3g} GB/s, '
        f'{r["vs_median"]:.3f} of {which}; exclude the host (sbatch --exclude={r["node"]}) '
        f'or report its {link}',
        file=sys.stderr,
      )
  return 1 if summary['slow'] or summary.get('all_reduce', {}).get('slow') else 0


if __name__ == '__main__':
  sys.exit(main())
