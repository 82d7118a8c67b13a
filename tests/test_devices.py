"""`python -m t5x_like.devices`: every device of every process is measured alone and reported,
and the devices slower than the median by more than the tolerance are named; then the links:
all-reduces within each node, between ring pairs of nodes and across the job
(t5x_like/cli/interconnect.py), the nodes with a slow one named."""

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO, free_port, run_cli

from t5x_like.cli import devices, interconnect


def rows(*tflops):
  return [
    {'process': i // 2, 'host': f'node{i // 2}', 'device': i, 'tflops': t}
    for i, t in enumerate(tflops)
  ]


def test_devices_below_the_median_by_more_than_the_tolerance_are_named():
  # tr11's case: one device 5% slow among equals is named; 2% is within a 3% tolerance.
  measured = rows(300.0, 301.0, 299.5, 285.0, 300.5, 294.5, 300.2)
  assert [r['device'] for r in devices.slow_devices(measured, 0.03)] == [3]
  assert [r['device'] for r in devices.slow_devices(measured, 0.01)] == [3, 5]
  assert devices.slow_devices(rows(300.0, 299.0, 301.0), 0.03) == []
  summary, lines = devices.report(measured, 0.03)
  assert [r['device'] for r in summary['devices']] == [3, 5, 2, 0, 6, 4, 1]  # slowest first
  assert summary['median_tflops'] == 300.0 and summary['devices'][0]['vs_median'] == 0.95
  assert lines[2].split()[:3] == ['1', 'node1', '3'] and lines[2].endswith('<- slow')
  assert sum(line.endswith('<- slow') for line in lines) == 1


def run_job(num_processes, nodes=None):
  """`python -m t5x_like.devices` as `num_processes` processes sharing 4 CPU devices, process i
  on node nodes[i] (SLURMD_NODENAME; default: this host), with 1 MiB all-reduces: (process 0's
  JSON summary, its stderr, its exit code), after checking the others reported nothing."""
  port = free_port()
  common = [
    '-m',
    't5x_like.devices',
    '--cpu_devices',
    '4',
    '--size',
    '64',
    '--repeats',
    '2',
    '--dtype',
    'float32',
    '--all_reduce_mib',
    '1',
    '--json',
    '--coordinator_address',
    f'localhost:{port}',
    '--num_processes',
    str(num_processes),
  ]
  env = {k: v for k, v in os.environ.items() if k != 'SLURMD_NODENAME'}
  procs = [
    subprocess.Popen(
      [sys.executable, *common, '--process_id', str(i)],
      cwd=REPO,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env={**env, 'SLURMD_NODENAME': nodes[i]} if nodes else env,
    )
    for i in range(num_processes)
  ]
  try:
    outputs = [p.communicate(timeout=180) for p in procs]
  finally:
    for p in procs:
      p.kill()
  # Timings on shared CPU cores decide 0 (all within tolerance) or 1 (some named on stderr).
  assert all(p.returncode in (0, 1) for p in procs), [err[-2000:] for _, err in outputs]
  assert all('"devices"' not in out for out, _ in outputs[1:])  # process 0 alone reports
  return json.loads(outputs[0][0].strip().splitlines()[-1]), outputs[0][1], procs[0].returncode


def test_every_device_of_every_process_is_measured_and_reported():
  summary, stderr, code = run_job(2)
  # Two virtual devices in each process, each reported once under its global device id.
  assert sorted(r['process'] for r in summary['devices']) == [0, 0, 1, 1]
  assert len({r['device'] for r in summary['devices']}) == 4
  assert all(r['host'] == socket.gethostname() and r['tflops'] > 0 for r in summary['devices'])
  # One node: its 4 devices, across both processes, all-reduce together; no pair, no job round.
  (within,) = summary['all_reduce']['groups']
  assert within['kind'] == 'node' and within['nodes'] == [socket.gethostname()]
  assert within['devices'] == 4 and within['busbw_gbs'] > 0
  assert summary['all_reduce']['slow'] == []  # one node is its own median
  assert (code == 1) == bool(summary['slow'])
  for r in summary['slow']:
    assert f'slow: process {r["process"]} on {r["host"]}, device {r["device"]}' in stderr


def test_four_nodes_all_reduce_in_ring_pairs_two_at_a_time_then_all_together():
  # One device a node: nothing within a node; the ring's four pairs in two rounds of two
  # disjoint pairs, each pair's two processes on their own; then the job's four devices.
  summary, stderr, code = run_job(4, ['n0', 'n1', 'n2', 'n3'])
  assert sorted(r['host'] for r in summary['devices']) == ['n0', 'n1', 'n2', 'n3']
  groups = summary['all_reduce']['groups']
  assert [(g['kind'], g['nodes'], g['devices']) for g in groups] == [
    ('pair', ['n0', 'n1'], 2),
    ('pair', ['n2', 'n3'], 2),
    ('pair', ['n1', 'n2'], 2),
    ('pair', ['n3', 'n0'], 2),
    ('job', ['n0', 'n1', 'n2', 'n3'], 4),
  ]
  assert all(g['busbw_gbs'] > 0 for g in groups)
  slow = summary['all_reduce']['slow']
  assert (code == 1) == bool(slow or summary['slow'])
  for r in slow:
    assert f'slow: node {r["node"]}: all-reduce bandwidth of its best ring pair' in stderr


def test_ring_pairs_go_in_rounds_of_disjoint_pairs():
  assert interconnect.ring_pairs(2) == []  # two nodes' pair is the whole job
  assert interconnect.disjoint_rounds(interconnect.ring_pairs(4)) == [
    [(0, 1), (2, 3)],
    [(1, 2), (3, 0)],
  ]
  assert interconnect.disjoint_rounds(interconnect.ring_pairs(5)) == [
    [(0, 1), (2, 3)],
    [(1, 2), (3, 4)],
    [(4, 0)],
  ]
  for n in range(3, 12):
    rounds = interconnect.disjoint_rounds(interconnect.ring_pairs(n))
    assert len(rounds) == (2 if n % 2 == 0 else 3)
    for members in rounds:
      nodes = [node for pair in members for node in pair]
      assert len(nodes) == len(set(nodes))
  nodes = {'a': [0, 1], 'b': [2, 3], 'c': [4, 5]}
  assert interconnect.plan_rounds(nodes) == [
    ('node', [(['a'], [0, 1]), (['b'], [2, 3]), (['c'], [4, 5])]),
    ('pair', [(['a', 'b'], [0, 1, 2, 3])]),
    ('pair', [(['b', 'c'], [2, 3, 4, 5])]),
    ('pair', [(['c', 'a'], [4, 5, 0, 1])]),
    ('job', [(['a', 'b', 'c'], [0, 1, 2, 3, 4, 5])]),
  ]
  assert interconnect.plan_rounds({'a': [0]}) == []


def result(kind, nodes, busbw):
  return {'kind': kind, 'nodes': nodes, 'devices': 8, 'seconds': 0.01, 'busbw_gbs': busbw}


def test_the_node_with_a_slow_link_or_slow_devices_is_named():
  assert interconnect.bus_bandwidth_gbs(10**9, 1.0, 8) == pytest.approx(1.75)  # 2 x 7/8
  # Node c's network link is slow: both its pairs are; b and d each have one fast pair.
  results = [
    result('node', ['a'], 400.0),
    result('node', ['b'], 401.0),
    result('node', ['c'], 399.0),
    result('node', ['d'], 300.0),  # its NVLink
    result('pair', ['a', 'b'], 90.0),
    result('pair', ['c', 'd'], 60.0),
    result('pair', ['b', 'c'], 61.0),
    result('pair', ['d', 'a'], 91.0),
    result('job', ['a', 'b', 'c', 'd'], 55.0),
  ]
  slow = interconnect.slow_links(results, 0.03)
  assert [(s['kind'], s['node']) for s in slow] == [('node', 'd'), ('link', 'c')]
  # Best pairs: a 91, b 90, c 61, d 91; their median 90.5.
  assert slow[1]['busbw_gbs'] == 61.0 and slow[1]['vs_median'] == pytest.approx(61.0 / 90.5)
  lines = interconnect.report_lines(results, 256 * interconnect.MIB, slow)
  marked = [line.split()[0] for line in lines if line.endswith('<- slow')]
  assert marked == ['d', 'c+d', 'b+c']  # slowest first within each part
  assert lines[0].startswith('all-reduce of 256 MiB a device')
  assert interconnect.report_lines([], 256 * interconnect.MIB, []) == [
    'all-reduce: no link to measure (one node with one device)'
  ]


def test_bad_input_is_one_message_and_exit_2():
  for flags in (
    ['--tolerance', '1.5'],
    ['--size', '0'],
    ['--num_processes', '2'],
    ['--all_reduce_mib', '-1'],
    ['--all_reduce_mib', str(2**40)],
  ):
    r = run_cli(['-m', 't5x_like.devices', *flags])
    assert r.returncode == 2 and r.stderr.startswith('error: '), r.stderr


@pytest.mark.parametrize('num_nodes', [3, 4, 5, 8])
def test_a_node_whose_link_is_five_percent_slow_is_named_from_three_nodes_on(num_nodes):
  # Its two pairs are 5% slow; half the ring's pairs are its own at 3 nodes, a third at 4.
  names = [f'n{i}' for i in range(num_nodes)]
  bad = names[-1]
  results = [
    result('pair', [a, b], 95.0 if bad in (a, b) else 100.0)
    for a, b in ((names[i], names[(i + 1) % num_nodes]) for i in range(num_nodes))
  ]
  slow = interconnect.slow_links(results, 0.03)
  assert [(s['kind'], s['node']) for s in slow] == [('link', bad)]
  assert interconnect.slow_links(results, 0.06) == []  # within a 6% tolerance
