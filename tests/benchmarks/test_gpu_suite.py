"""benchmarks/gpu_suite.py on CPU (--smoke): every stage runs and reports what it measured; no
timing is asserted. On a GPU the same script runs the kernel tests compiled (docs/tests.md)."""

import json
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import gpu_suite  # noqa: E402  (a script, not a package module)


def test_smoke_run_reports_every_stage(tmp_path, capsys):
  out = tmp_path / 'suite.json'
  assert gpu_suite.main(['--smoke', '--json', str(out)]) == 0
  report = json.loads(out.read_text())
  stages = report['stages']
  assert report['ok'] and report['platform'] == 'cpu'
  assert set(stages) == {'step', 'plan', 'matmul', 'attention'}  # no kernel tests in smoke
  steps = stages['step']['results']
  # Each implementation in its own process, the first loss checked against xla's.
  assert steps['pallas']['first_loss_vs_xla'] <= 2e-2
  assert steps['xla']['mfu'] > 0 and steps['xla']['xla_peak_bytes'] > 0
  assert steps['xla']['measured_peak_bytes'] is None  # CPU has no allocator statistics
  assert 'needs a GPU' in steps['cudnn']['skipped']
  assert stages['plan']['peak_gib'] > 0
  assert stages['plan']['estimate']['gpu'] == 'h100-80gb'  # the cost model's stand-in on CPU
  assert stages['plan']['estimate']['memory_gib'] > 0
  assert stages['matmul']['measured_tflops'] > 0
  rows = stages['attention']['results']
  assert {r['impl'] for r in rows if r.get('correct')} == {'pallas', 'xla'}
  assert 'step pallas:' in capsys.readouterr().out  # the summary


def test_without_a_gpu_the_full_suite_refuses(tmp_path, capsys):
  assert gpu_suite.main(['--json', str(tmp_path / 'suite.json')]) == 2
  assert 'no GPU here' in capsys.readouterr().err
  assert not (tmp_path / 'suite.json').exists()
