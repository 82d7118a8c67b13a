"""benchmarks/rampup_padding.py: a ramp-up step padded to more micro-batches trains as the exact
one. Its timings are measurements, never asserted here."""

import json
import os
import sys

import pytest
from conftest import REPO

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import rampup_padding  # noqa: E402  (a script, not a package module)


def test_padded_step_trains_as_the_exact_one_and_the_full_one_is_real(tmp_path):
  out = tmp_path / 'result.json'
  code = rampup_padding.main(
    [
      '--config',
      os.path.join(REPO, 'configs', 'tiny.py'),
      '--stages',
      '1',
      '--real',
      '1',
      '--full',
      '2',
      '--steps',
      '1',
      '--json',
      str(out),
    ]
  )
  assert code == 0  # the script compares the padded losses with the exact ones
  runs = json.loads(out.read_text())['results']['pipeline=1']
  assert [runs[k]['micro_batches_compiled'] for k in ('exact', 'padded', 'full')] == [1, 2, 2]
  assert [runs[k]['micro_batches_real'] for k in ('exact', 'padded', 'full')] == [1, 1, 2]
  assert runs['padded']['losses'] == pytest.approx(runs['exact']['losses'], rel=1e-6)
  assert runs['full']['losses'][0] != pytest.approx(runs['exact']['losses'][0], rel=1e-5)
  assert all(len(r['times']) == 1 for r in runs.values())
