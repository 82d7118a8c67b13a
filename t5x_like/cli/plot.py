"""`python -m t5x_like.plot`: the training curves of one run, or of several overlaid, as an image.

  python -m t5x_like.plot WORKDIR [WORKDIR ...] --out FILE.png [--x tokens|samples|iteration]

Reads each WORKDIR's metrics.jsonl (one record per trained iteration) and eval_metrics.jsonl (one
per evaluated set; a run that never evaluated has none) and draws four panels against consumed
tokens (the default: the fair axis across runs with different batch ramp-ups or curricula),
consumed samples or the iteration:

  lm loss         training (line) and each validation set (dashed, a marker per evaluation)
  learning rate
  grad norm
  throughput      tokens per second (solid, left axis) and MFU (dotted, right axis)

Each run has one colour, named in the legend by its workdir's name (its path where two names are
the same). Non-finite values (skipped iterations) leave gaps. FILE's extension picks the format
(.png; .pdf and .svg work too). Nothing is started but matplotlib's Agg renderer: run it anywhere,
during a run or after it. Exit codes: 0 written; 2 bad input (a WORKDIR without metrics, an --out
that cannot be written).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from typing import Any

from t5x_like.errors import ConfigError
from t5x_like.files import check_writable
from t5x_like.training.workdir import read_records

# --x: the record field of the x axis, and its label.
X_AXES = {
  'tokens': ('consumed_tokens', 'consumed tokens'),
  'samples': ('consumed_samples', 'consumed samples'),
  'iteration': ('iteration', 'iteration'),
}

PANEL_TITLES = ('lm loss', 'learning rate', 'grad norm', 'throughput')
EVAL_MARKERS = ('o', 's', '^', 'D', 'v', 'P')  # one per validation set of a run


@dataclasses.dataclass(frozen=True)
class Run:
  label: str  # the legend's name of the run
  records: list[dict[str, Any]]  # metrics.jsonl
  eval_records: list[dict[str, Any]]  # eval_metrics.jsonl; [] when the run never evaluated


def read_run(workdir: str, label: str, x_field: str) -> Run:
  """One run's records, checked: one clear error for a workdir that has nothing to plot."""
  if not os.path.isdir(workdir):
    raise ConfigError(f'{workdir} is not a directory; pass the --workdir of a training run')
  path = os.path.join(workdir, 'metrics.jsonl')
  if not os.path.isfile(path):
    raise ConfigError(
      f"{workdir} has no metrics.jsonl: not a training run's workdir, or its run "
      'has not finished an iteration yet'
    )
  records = read_records(path, torn_tail_ok=True)
  if not records:
    raise ConfigError(f'{path} holds no record: the run has not finished an iteration yet')
  for field in ('lm_loss', x_field):
    if not any(field in r for r in records):
      raise ConfigError(f'{path} has no {field!r} in its records: not metrics a run wrote')
  eval_path = os.path.join(workdir, 'eval_metrics.jsonl')
  eval_records = read_records(eval_path, torn_tail_ok=True) if os.path.isfile(eval_path) else []
  return Run(label, records, eval_records)


def run_labels(workdirs: list[str]) -> list[str]:
  """Each workdir's name; the paths as given where two names are the same (run1/out, run2/out)."""
  names = [os.path.basename(os.path.abspath(w)) for w in workdirs]
  return names if len(set(names)) == len(names) else [os.path.normpath(w) for w in workdirs]


def read_runs(workdirs: list[str], x: str) -> list[Run]:
  x_field = X_AXES[x][0]
  return [read_run(w, label, x_field) for w, label in zip(workdirs, run_labels(workdirs))]


def series(
  records: list[dict[str, Any]], x_field: str, y_field: str, scale: float = 1.0
) -> tuple[list[float], list[float]]:
  """(x, y) of the records that have both fields; a non-finite y becomes NaN, a gap in the line
  (an infinity would stretch the axis)."""
  xs, ys = [], []
  for r in records:
    x, y = r.get(x_field), r.get(y_field)
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
      xs.append(x)
      ys.append(y * scale if math.isfinite(y) else math.nan)
  return xs, ys


def build_figure(runs: list[Run], x: str):
  """The matplotlib Figure (on an Agg canvas; pyplot's global state is never touched)."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  from matplotlib.lines import Line2D

  x_field, x_label = X_AXES[x]
  fig = Figure(figsize=(12, 8), dpi=100, layout='constrained')
  FigureCanvasAgg(fig)
  loss_ax, lr_ax, grad_ax, speed_ax = fig.subplots(2, 2).flat
  mfu_ax = speed_ax.twinx()
  for ax, title in zip((loss_ax, lr_ax, grad_ax, speed_ax), PANEL_TITLES):
    ax.set_title(title)
    ax.set_xlabel(x_label)
    ax.grid(alpha=0.3)
  loss_ax.set_ylabel('lm loss')
  lr_ax.set_ylabel('learning rate')
  grad_ax.set_ylabel('grad norm')
  speed_ax.set_ylabel('tokens per second')
  mfu_ax.set_ylabel('MFU (%)')
  for i, run in enumerate(runs):
    color = f'C{i % 10}'
    loss_ax.plot(*series(run.records, x_field, 'lm_loss'), color=color, label=run.label)
    sets = list(dict.fromkeys(r.get('set') for r in run.eval_records if 'set' in r))
    for j, name in enumerate(sets):
      evaluated = [r for r in run.eval_records if r.get('set') == name]
      loss_ax.plot(
        *series(evaluated, x_field, 'lm_loss'),
        color=color,
        linestyle='--',
        marker=EVAL_MARKERS[j % len(EVAL_MARKERS)],
        markersize=4,
        label=f'{run.label}: {name}',
      )
    lr_ax.plot(*series(run.records, x_field, 'learning_rate'), color=color, label=run.label)
    grad_ax.plot(*series(run.records, x_field, 'grad_norm'), color=color, label=run.label)
    speed_ax.plot(*series(run.records, x_field, 'tokens_per_sec'), color=color, label=run.label)
    mfu_ax.plot(*series(run.records, x_field, 'mfu', 100.0), color=color, linestyle=':')
  loss_ax.legend(fontsize='small')
  # Colours name the runs (the loss panel's legend); here the line style names the quantity.
  speed_ax.legend(
    handles=[
      Line2D([], [], color='gray', label='tokens per second (left)'),
      Line2D([], [], color='gray', linestyle=':', label='MFU (right)'),
    ],
    fontsize='small',
    loc='lower right',
  )
  return fig


def check_out(out: str) -> None:
  """--out can be written, in a format matplotlib knows, before any file is read."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg

  formats = FigureCanvasAgg.get_supported_filetypes()
  extension = os.path.splitext(out)[1].lstrip('.').lower()
  if extension not in formats:
    raise ConfigError(
      f'--out {out}: the extension names the image format; use .png (or one of '
      f'{", ".join("." + f for f in sorted(formats))})'
    )
  parent = os.path.dirname(os.path.abspath(out))
  if os.path.isdir(out) or not os.path.isdir(parent):
    raise ConfigError(
      f'--out {out}: '
      + ('is a directory' if os.path.isdir(out) else f'its directory {parent} does not exist')
      + '; pass the path of the image file to write'
    )
  check_writable(parent, f'--out {out}: its directory', 'pass a directory you can write to')


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.plot',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    'workdirs',
    nargs='+',
    metavar='WORKDIR',
    help="a training run's --workdir (several: their curves overlaid)",
  )
  parser.add_argument('--out', required=True, help='the image to write, e.g. curves.png')
  parser.add_argument(
    '--x',
    default='tokens',
    choices=list(X_AXES),
    help='the x axis: consumed tokens (default), consumed samples or iteration',
  )
  args = parser.parse_args(argv)
  try:
    check_out(args.out)
    runs = read_runs(args.workdirs, args.x)
  except ConfigError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  build_figure(runs, args.x).savefig(args.out)
  print(f'wrote {args.out}: {", ".join(run.label for run in runs)} against {X_AXES[args.x][1]}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
