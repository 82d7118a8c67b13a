"""The links between a job's devices, for `python -m t5x_like.devices`: all-reduce bus bandwidth
within each node, between pairs of nodes, and across the whole job (`--all_reduce_mib`).

In tr11, after the 5% slowdown, the first suspect was one node's network: a quick network
benchmark of every node ruled it out before the slow GPU was found. These are that benchmark,
run as JAX collectives over the same devices, communicators and links the trainer uses (NCCL on
GPUs, gloo on CPU):

- within each node: every node's devices all-reduce among themselves, all nodes at once
  (NVLink or PCIe; none with one device a node);
- between nodes: every node all-reduces with the next in a ring of the nodes (host order), in
  rounds of disjoint pairs, so each node is measured in two pairs; a node whose best pair is
  slower than the other nodes' best has the bad link (with three or more nodes; two are the
  whole job);
- the whole job: all devices at once, the figure a data-parallel gradient reduction sees.

Bandwidth is NCCL-tests' bus bandwidth, `busbw = size / time * 2 (n - 1) / n` for an all-reduce
of `size` bytes a device over n devices, comparable across device counts; the time is the
median of the repeats, as seen by the slowest process of the group.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import numpy as np

MIB = 2**20


def bus_bandwidth_gbs(nbytes: int, seconds: float, num_devices: int) -> float:
  """NCCL-tests' all-reduce bus bandwidth in GB/s (10^9 bytes) of `nbytes` a device."""
  return nbytes / seconds * 2 * (num_devices - 1) / num_devices / 1e9


def ring_pairs(num_nodes: int) -> list[tuple[int, int]]:
  """Each node with the next one in a ring: (0, 1), (1, 2), ..., (n - 1, 0); none below 3
  nodes (two nodes' one pair is the whole job)."""
  if num_nodes < 3:
    return []
  return [(i, (i + 1) % num_nodes) for i in range(num_nodes)]


def disjoint_rounds(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
  """`pairs` in rounds in which no node is in two pairs (a ring's: 2 rounds, 3 if odd), each
  pair in the first round where both its nodes are free."""
  rounds: list[list[tuple[int, int]]] = []
  for pair in pairs:
    for members in rounds:
      if not {n for p in members for n in p} & set(pair):
        members.append(pair)
        break
    else:
      rounds.append([pair])
  return rounds


def nodes_of(rows: Sequence[dict]) -> dict[str, list[int]]:
  """{node name: its device ids} of `rows` (devices.gather's, with 'host' and 'device'), in the
  order of the names."""
  nodes: dict[str, list[int]] = {}
  for r in rows:
    nodes.setdefault(r['host'], []).append(r['device'])
  return {name: sorted(nodes[name]) for name in sorted(nodes)}


def plan_rounds(nodes: dict[str, list[int]]) -> list[tuple[str, list[tuple[list[str], list[int]]]]]:
  """The measurements, in order: (kind, [(its nodes, its device ids)]), the groups of a round
  measured at once. Kinds: 'node' (each node with two or more devices), 'pair' (ring pairs of
  nodes, in disjoint rounds), 'job' (every device; with two or more nodes)."""
  names = list(nodes)
  out: list[tuple[str, list[tuple[list[str], list[int]]]]] = []
  within = [([name], ids) for name, ids in nodes.items() if len(ids) > 1]
  if within:
    out.append(('node', within))
  for members in disjoint_rounds(ring_pairs(len(names))):
    groups = [([names[a], names[b]], nodes[names[a]] + nodes[names[b]]) for a, b in members]
    out.append(('pair', groups))
  if len(names) > 1:
    out.append(('job', [(names, sorted(i for ids in nodes.values() for i in ids))]))
  return out


def time_all_reduce(device_ids: Sequence[int], nbytes: int, repeats: int) -> float:
  """Median seconds of a float32 all-reduce (psum) of `nbytes` a device over `device_ids`, as
  this process sees it; every process holding one of them calls it at the same time."""
  import jax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  by_id = {d.id: d for d in jax.devices()}
  mesh = Mesh(np.array([by_id[i] for i in device_ids]), ('devices',))
  elements = nbytes // 4
  buffers = jax.make_array_from_callback(
    (len(device_ids) * elements,),
    NamedSharding(mesh, P('devices')),
    lambda index: np.ones(elements, np.float32),
  )
  all_reduce = jax.jit(
    jax.shard_map(
      lambda x: jax.lax.psum(x, 'devices'), mesh=mesh, in_specs=P('devices'), out_specs=P('devices')
    )
  )
  all_reduce(buffers).block_until_ready()  # compile, and the communicators' set-up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    all_reduce(buffers).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def measure(rows: Sequence[dict], nbytes: int, repeats: int) -> list[dict]:
  """Runs plan_rounds(nodes_of(rows)) on every process (each takes part in its groups, the
  processes wait for each other between rounds) and returns, on every process, one result per
  group: kind, nodes (names), devices (count), seconds (the slowest process's), busbw_gbs."""
  import jax
  from jax.experimental import multihost_utils

  rounds = plan_rounds(nodes_of(rows))
  mine = {d.id for d in jax.local_devices()}
  # [rounds, 2]: (the group of each round this process is in, -1: none; its seconds)
  taken = np.full((len(rounds), 2), -1.0)
  for r, (kind, groups) in enumerate(rounds):
    for g, (_, ids) in enumerate(groups):
      if mine & set(ids):
        taken[r] = (g, time_all_reduce(ids, nbytes, repeats))
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f't5x_like.devices: all-reduce round {r} ({kind})')
  if jax.process_count() > 1:
    everyone = np.asarray(multihost_utils.process_allgather(taken)).reshape(-1, len(rounds), 2)
  else:
    everyone = taken[None]
  results = []
  for r, (kind, groups) in enumerate(rounds):
    for g, (names, ids) in enumerate(groups):
      seconds = max(float(t[r, 1]) for t in everyone if int(t[r, 0]) == g)
      results.append(
        {
          'kind': kind,
          'nodes': names,
          'devices': len(ids),
          'seconds': seconds,
          'busbw_gbs': bus_bandwidth_gbs(nbytes, seconds, len(ids)),
        }
      )
  return results


def slow_links(results: Sequence[dict], tolerance: float) -> list[dict]:
  """What is slower than its peers by more than `tolerance`: a node whose devices all-reduce
  below (1 - tolerance) x the median node's bandwidth ('node'), and a node whose best ring pair
  is below that fraction of the median node's best pair ('link': its own link is the slow one,
  as a healthy node's other pair is fast)."""
  slow = []
  within = [r for r in results if r['kind'] == 'node']
  if within:
    median = statistics.median(r['busbw_gbs'] for r in within)
    slow += [
      {'kind': 'node', 'node': r['nodes'][0], 'busbw_gbs': bw, 'vs_median': bw / median}
      for r in within
      if (bw := r['busbw_gbs']) < (1.0 - tolerance) * median
    ]
  best: dict[str, float] = {}
  for r in results:
    if r['kind'] == 'pair':
      for node in r['nodes']:
        best[node] = max(best.get(node, 0.0), r['busbw_gbs'])
  if best:
    # The median node's best, not the median pair: a slow node is in two pairs of the ring, so
    # with three nodes two of the three pairs are slow.
    median = statistics.median(best.values())
    slow += [
      {'kind': 'link', 'node': node, 'busbw_gbs': bw, 'vs_median': bw / median}
      for node, bw in best.items()
      if bw < (1.0 - tolerance) * median
    ]
  return slow


_TITLES = {'node': 'within each node', 'pair': 'between nodes (ring pairs)', 'job': 'the whole job'}


def report_lines(results: Sequence[dict], nbytes: int, slow: Sequence[dict]) -> list[str]:
  """The table of `results` (measure's), slowest first in each part, the slow ones marked."""
  if not results:
    return ['all-reduce: no link to measure (one node with one device)']
  marked = {(s['kind'] == 'node', s['node']) for s in slow}
  lines = [
    f'all-reduce of {nbytes / MIB:g} MiB a device (float32), bus bandwidth (NCCL-tests busbw):',
    f'    {"nodes":<38} {"devices":>7} {"ms":>9} {"GB/s":>9}',
  ]
  for kind, title in _TITLES.items():
    rows = sorted((r for r in results if r['kind'] == kind), key=lambda r: r['busbw_gbs'])
    if rows:
      lines.append(f'  {title}:')
    for r in rows:
      name = 'all' if kind == 'job' else '+'.join(r['nodes'])
      within = kind == 'node'
      slow_here = kind != 'job' and any((within, n) in marked for n in r['nodes'])
      lines.append(
        f'    {name:<38} {r["devices"]:>7} {1e3 * r["seconds"]:>9.3f} '
        f'{r["busbw_gbs"]:>9.4g}{"  <- slow" if slow_here else ""}'
      )
  return lines
