"""`python -m t5x_like.plot`: the image it draws from synthetic metrics files (no training)."""

import json
import math
import os

import numpy as np
import pytest
from conftest import run_cli

from t5x_like.cli import plot
from t5x_like.errors import ConfigError
from t5x_like.training.workdir import read_records

# matplotlib's second default colour (C1): only a second run draws with it.
SECOND_RUN_RGB = np.array([0xFF, 0x7F, 0x0E]) / 255


def write_run(directory, iterations: int = 12, loss_scale: float = 1.0) -> str:
  """A workdir with `iterations` training records (batch size 2 then 4: tokens, samples and
  iterations are three different axes) and a 'valid' evaluation every 4 iterations."""
  os.makedirs(directory)
  samples = 0
  with open(os.path.join(directory, 'metrics.jsonl'), 'w') as f:
    for i in range(1, iterations + 1):
      samples += 2 if i <= 4 else 4
      f.write(
        json.dumps(
          {
            'iteration': i,
            'consumed_samples': samples,
            'consumed_tokens': samples * 16,
            'learning_rate': 1e-3 * min(1.0, i / 4),
            'lm_loss': loss_scale * (3 + 5 * math.exp(-i / 3)),
            'grad_norm': 1 + 2 * math.exp(-i / 2),
            'tokens_per_sec': 500.0 + 50 * (i % 3),
            'mfu': 0.2 * loss_scale,
          }
        )
        + '\n'
      )
  with open(os.path.join(directory, 'eval_metrics.jsonl'), 'w') as f:
    for i in range(4, iterations + 1, 4):
      f.write(
        json.dumps(
          {
            'iteration': i,
            'consumed_samples': 4 * i - 8,
            'consumed_tokens': (4 * i - 8) * 16,
            'set': 'valid',
            'lm_loss': loss_scale * (3.2 + 5 * math.exp(-i / 3)),
          }
        )
        + '\n'
      )
  return str(directory)


def rgb_pixels(path) -> np.ndarray:
  from matplotlib import image

  return image.imread(path)[..., :3]


def count_color(pixels: np.ndarray, rgb: np.ndarray) -> int:
  return int(np.all(np.abs(pixels - rgb) < 0.02, axis=-1).sum())


def test_two_runs_draw_a_different_image_than_one(tmp_path, capsys):
  a = write_run(tmp_path / 'run_a')
  b = write_run(tmp_path / 'run_b', loss_scale=1.3)
  one, again, two = (str(tmp_path / f'{name}.png') for name in ('one', 'again', 'two'))
  assert plot.main([a, '--out', one]) == 0
  assert plot.main([a, '--out', again]) == 0
  assert plot.main([a, b, '--out', two]) == 0
  assert 'run_a, run_b against consumed tokens' in capsys.readouterr().out
  one_px, again_px, two_px = rgb_pixels(one), rgb_pixels(again), rgb_pixels(two)
  # The same input draws the same pixels, so any difference below is the second run.
  assert np.array_equal(one_px, again_px)
  assert one_px.shape == two_px.shape and not np.array_equal(one_px, two_px)
  assert count_color(one_px, SECOND_RUN_RGB) == 0
  assert count_color(two_px, SECOND_RUN_RGB) > 500  # its curves in every panel
  legend = plot.build_figure(plot.read_runs([a, b], 'tokens'), 'tokens').axes[0].get_legend()
  assert [t.get_text() for t in legend.get_texts()] == [
    'run_a',
    'run_a: valid',
    'run_b',
    'run_b: valid',
  ]


@pytest.mark.parametrize('x', ['tokens', 'samples', 'iteration'])
def test_axis_labels_and_x_values_follow_x(tmp_path, x):
  a = write_run(tmp_path / 'run_a')
  runs = plot.read_runs([a], x)
  fig = plot.build_figure(runs, x)
  field, label = {
    'tokens': ('consumed_tokens', 'consumed tokens'),
    'samples': ('consumed_samples', 'consumed samples'),
    'iteration': ('iteration', 'iteration'),
  }[x]
  panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
  assert sorted(panels) == sorted(plot.PANEL_TITLES)
  assert {title: ax.get_xlabel() for title, ax in panels.items()} == dict.fromkeys(panels, label)
  train_line, valid_line = panels['lm loss'].get_lines()
  assert list(train_line.get_xdata()) == [r[field] for r in runs[0].records]
  assert list(valid_line.get_xdata()) == [r[field] for r in runs[0].eval_records]
  assert list(panels['learning rate'].get_lines()[0].get_ydata()) == [
    r['learning_rate'] for r in runs[0].records
  ]
  out = str(tmp_path / 'x.png')
  assert plot.main([a, '--out', out, '--x', x]) == 0 and os.path.getsize(out) > 0


def test_a_bad_or_empty_workdir_is_one_clear_error(tmp_path, capsys):
  good = write_run(tmp_path / 'good')
  empty = tmp_path / 'empty'
  empty.mkdir()
  no_records = tmp_path / 'no_records'
  no_records.mkdir()
  (no_records / 'metrics.jsonl').write_text('\n')
  damaged = write_run(tmp_path / 'damaged')
  with open(os.path.join(damaged, 'metrics.jsonl'), 'a') as f:
    f.write('{"iteration": 13, "lm_lo\n{"iteration": 14}\n')
  out = tmp_path / 'out.png'
  cases = [
    ([str(tmp_path / 'missing')], ['missing is not a directory', 'training run']),
    ([good, str(empty)], ['empty has no metrics.jsonl', "training run's workdir"]),
    ([str(no_records)], ['no_records/metrics.jsonl holds no record', 'not finished']),
    ([damaged], ['damaged/metrics.jsonl, line 13: not a metrics record']),
  ]
  for workdirs, expected in cases:
    assert plot.main([*workdirs, '--out', str(out)]) == 2, workdirs
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1, err
    assert all(text in err for text in expected), err
    assert not out.exists()
  assert plot.main([good, '--out', str(tmp_path / 'curves.txt2')]) == 2
  assert 'use .png' in capsys.readouterr().err
  assert plot.main([good, '--out', str(tmp_path / 'no_dir' / 'c.png')]) == 2
  assert 'no_dir does not exist' in capsys.readouterr().err
  assert plot.main([good, '--out', '/sys/kernel/curves.png']) == 2  # a directory one cannot write
  assert '--out /sys/kernel/curves.png: its directory /sys/kernel is not writable (' in (
    capsys.readouterr().err
  )
  r = run_cli(['-m', 't5x_like.plot', str(empty), '--out', str(out)])
  assert r.returncode == 2 and 'has no metrics.jsonl' in r.stderr and 'Traceback' not in r.stderr


def test_a_last_line_torn_by_a_kill_is_left_out(tmp_path):
  a = write_run(tmp_path / 'run_a', iterations=5)
  with open(os.path.join(a, 'metrics.jsonl'), 'a') as f:
    f.write('{"iteration": 6, "consumed_sa')  # no newline: the write was cut short
  path = os.path.join(a, 'metrics.jsonl')
  assert [r['iteration'] for r in read_records(path, torn_tail_ok=True)] == [1, 2, 3, 4, 5]
  runs = plot.read_runs([a], 'iteration')
  assert [r['iteration'] for r in runs[0].records] == [1, 2, 3, 4, 5]
  with pytest.raises(ConfigError, match='line 6'):  # the trainer's own reader takes no torn line
    read_records(path)
