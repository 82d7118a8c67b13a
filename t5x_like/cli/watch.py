"""Is the run in WORKDIR alive? For cron, the way the chronicles' SLURM status script ran hourly.

    python -m t5x_like.watch WORKDIR [--stale-mins 30] [--slurm-job-name NAME] [--json]

A run that is killed outright (a node lost, an out-of-memory kill, `scancel` without a grace
period) cannot report anything itself. This looks at it from outside: the last time the run wrote
to WORKDIR/logs/main_log.txt or WORKDIR/metrics.jsonl, and the last `> done:` / `> stopped:` line
of the log. With `--slurm-job-name`, SLURM's queue is asked too (`squeue`), so a job array's next
job waiting for nodes is not taken for a dead run. States, and the exit code:

  running   the run wrote within --stale-mins (a job array's next job gets that long to start)  0
  finished  the log's last word is `> done: ...` or a stop with exit code 0 (the kill switch)  0
  queued    nothing written lately, but a job of that name is pending or running             0
  stopped   nothing written lately, the log's last word is a `> stopped: ...` line asking for
            a requeue, and no job of that name is queued                                    1
  stale     nothing written lately, and the run did not say it ended: it died or hangs       1
  diverged  the log's last word is a stop with exit code 5 (non-finite iterations): fix the
            run (roll back, skip data, lower the learning rate) before resubmitting          1

A run that has trained says how far it is, and how long its remaining samples take at the pace
of its last iterations (`progress`: the training steps alone; evaluations, saves, restarts and
the queue come on top, and a batch-size ramp-up still under way makes it an overestimate).

On `stopped`, `stale` and `diverged` the run's `runtime.alert_command` (from WORKDIR/config.json, or
`--alert-command`) is sent the event of that name (t5x_like/training/alerts.py), once per episode:
the next cron tick alerts again only after the run wrote something in between.

Exit code 2, with one message: a WORKDIR that holds no run, squeue missing, or a bad flag
(--stale-mins must be a finite number of minutes > 0).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

from t5x_like.config import Config
from t5x_like.errors import ConfigError
from t5x_like.files import atomic_write
from t5x_like.training import alerts, schedule

STATE_FILE = os.path.join('logs', 'watch_state.json')
# squeue states of a job that is about to run or is running.
SLURM_ALIVE = (
  'PENDING',
  'CONFIGURING',
  'RUNNING',
  'COMPLETING',
  'REQUEUED',
  'RESIZING',
  'SUSPENDED',
)


# The pace of the run is its last this many iterations' (read from the end of metrics.jsonl).
PACE_ITERATIONS = 50
# Bytes read from the end of metrics.jsonl: more than PACE_ITERATIONS records.
TAIL_BYTES = 256 * 1024

# The states an operator must act on: exit code 1, and the alert command.
ALERTED = ('stale', 'stopped', 'diverged')


class WatchError(Exception):
  """A workdir that holds no run, or a query that cannot be made."""


def last_activity(workdir: str) -> float:
  """Seconds since the epoch of the run's last write to its log or metrics."""
  paths = [os.path.join(workdir, 'logs', 'main_log.txt'), os.path.join(workdir, 'metrics.jsonl')]
  times = [os.path.getmtime(p) for p in paths if os.path.exists(p)]
  if not times:
    raise WatchError(
      f'{workdir} has no logs/main_log.txt or metrics.jsonl: not the workdir of a '
      'run that started; pass the --workdir the training was given'
    )
  return max(times)


def last_end_line(workdir: str) -> str:
  """The log's last line if it is the `> done:` or `> stopped:` line of a job's end, else ''."""
  path = os.path.join(workdir, 'logs', 'main_log.txt')
  if not os.path.exists(path):
    return ''
  with open(path, 'rb') as f:
    f.seek(max(0, os.path.getsize(path) - 4096))
    lines = f.read().decode(errors='replace').splitlines()
  last = lines[-1] if lines else ''
  return last if last.startswith(('> done:', '> stopped:')) else ''


def slurm_job_states(job_name: str) -> list[str]:
  """The states of the current user's jobs named `job_name` (job-array members included)."""
  if shutil.which('squeue') is None:
    raise WatchError(
      '--slurm-job-name needs squeue on PATH; run the watch on a node of the '
      'cluster, or leave --slurm-job-name out'
    )
  r = subprocess.run(
    ['squeue', '--noheader', '--me', '--name', job_name, '--format', '%T'],
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  if r.returncode != 0:
    raise WatchError(f'squeue failed ({r.stderr.strip() or r.returncode}); is SLURM reachable?')
  return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def last_records(path: str, count: int) -> list[dict]:
  """The last `count` whole records of a JSON-lines file (its tail only: a long run's file is
  large); a line torn by a kill, or cut by the tail's start, is skipped."""
  with open(path, 'rb') as f:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES))
    # The first line read may be a record's end: like a torn line, it is no JSON object.
    lines = f.read().decode(errors='replace').splitlines()
  records = []
  for line in lines:
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if isinstance(record, dict):
      records.append(record)
  return records[-count:]


def progress(workdir: str) -> dict | None:
  """How far the run is (its last record against the config's total samples), and the hours its
  remaining samples take at its last PACE_ITERATIONS iterations' pace; None before a record."""
  try:
    with open(os.path.join(workdir, 'config.json')) as f:
      cfg = Config.from_dict(json.load(f))
    records = last_records(os.path.join(workdir, 'metrics.jsonl'), PACE_ITERATIONS)
    last = records[-1]
    samples = sum(int(r['global_batch_size']) for r in records)
    seconds = sum(float(r['step_time_s']) for r in records)
    consumed = int(last['consumed_samples'])
  except (OSError, ValueError, KeyError, TypeError, IndexError, ConfigError):
    return None
  total = schedule.total_samples(cfg.train)
  pace = samples / seconds if seconds > 0 else 0.0
  return {
    'iteration': int(last['iteration']),
    'iterations': schedule.total_iterations(cfg.train),
    'done': round(min(consumed / total, 1.0), 4) if total else 1.0,
    'samples_per_sec': round(pace, 3),
    'hours_left': round(max(total - consumed, 0) / pace / 3600, 2) if pace else None,
    'pace_of': len(records),
  }


def describe_duration(hours: float) -> str:
  """'3d 4h', '5h 12m' or '12m'."""
  days, minutes = divmod(round(hours * 60), 24 * 60)
  whole_hours, minutes = divmod(minutes, 60)
  if days:
    return f'{days}d {whole_hours}h'
  return f'{whole_hours}h {minutes}m' if whole_hours else f'{minutes}m'


def status(workdir: str, stale_mins: float, job_name: str = '', now: float | None = None) -> dict:
  now = time.time() if now is None else now
  last_write = last_activity(workdir)
  idle_mins = (now - last_write) / 60
  end = last_end_line(workdir)
  queue = slurm_job_states(job_name) if job_name else []
  queued = any(s in SLURM_ALIVE for s in queue)
  if end.startswith('> done:') or end.endswith('exit code 0 (FINISHED)'):
    state = 'finished'
  elif end.endswith('(DIVERGED)'):
    state = 'diverged'
  elif idle_mins < stale_mins:
    state = 'running'
  elif queued:
    state = 'queued'
  elif end:
    state = 'stopped'
  else:
    state = 'stale'
  return {
    'workdir': workdir,
    'state': state,
    'last_write': last_write,
    'idle_mins': round(idle_mins, 2),
    'last_end_line': end,
    'slurm_states': queue,
    'progress': progress(workdir),
  }


def describe(s: dict) -> str:
  what = {
    'running': 'alive: it wrote to its log',
    'finished': 'finished',
    'queued': f'not writing, but a job of it is queued ({", ".join(s["slurm_states"])})',
    'stopped': 'stopped and no job of it is queued: resubmit it to continue',
    'stale': 'wrote nothing lately and did not say it ended: it died or hangs',
    'diverged': (
      'stopped after non-finite iterations: roll back, skip the data or lower the '
      'learning rate before resubmitting (see its log)'
    ),
  }[s['state']]
  line = f'{s["workdir"]}: {s["state"]}, last write {s["idle_mins"]:.1f} minutes ago; {what}'
  if s['last_end_line']:
    line += f'; its log ends with: {s["last_end_line"]}'
  p = s.get('progress')
  if p and s['state'] != 'finished':
    line += (
      f'. Iteration {p["iteration"]} of {p["iterations"]}, {100 * p["done"]:.1f}% of its samples'
    )
    if p['hours_left'] is not None:
      line += (
        f'; about {describe_duration(p["hours_left"])} of training steps left at the pace of '
        f'its last {p["pace_of"]} iterations ({p["samples_per_sec"]:g} samples/s)'
      )
  return line


def alert_once(workdir: str, s: dict, command: str) -> bool:
  """Sends the state's alert unless this episode (same last write) was alerted already."""
  path = os.path.join(workdir, STATE_FILE)
  episode = {'state': s['state'], 'last_activity': s['last_write']}
  try:
    with open(path) as f:
      if json.load(f) == episode:
        return False
  except (OSError, ValueError):
    pass
  sender = alerts.Alerts(command, workdir)
  sender.send(s['state'], describe(s))
  sender.wait()
  atomic_write(path, lambda f: f.write(json.dumps(episode).encode()))
  return True


def check_arguments(args: argparse.Namespace) -> None:
  """One ConfigError for a flag value the watch cannot judge a run by."""
  # nan would make every run stale (no idle time is < nan) and inf every run alive.
  if not (math.isfinite(args.stale_mins) and args.stale_mins > 0):
    raise ConfigError(
      f'--stale-mins must be a finite number of minutes > 0, got '
      f'{args.stale_mins}; give how long the run may go without writing (the '
      'default is 30)'
    )


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m t5x_like.watch',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('workdir')
  parser.add_argument(
    '--stale-mins',
    type=float,
    default=30.0,
    help='no write for this long means the run is not training (default 30; '
    'make it longer than an evaluation or a save of the run)',
  )
  parser.add_argument(
    '--slurm-job-name',
    default='',
    help="the job's --job-name, to tell a queued job from a dead run",
  )
  parser.add_argument(
    '--alert-command',
    default=None,
    help='overrides the runtime.alert_command of WORKDIR/config.json',
  )
  parser.add_argument('--json', action='store_true', help='print the state as one JSON object')
  args = parser.parse_args(argv)
  try:
    check_arguments(args)
    s = status(args.workdir, args.stale_mins, args.slurm_job_name)
  except (ConfigError, WatchError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  command = args.alert_command
  if command is None:
    try:
      with open(os.path.join(args.workdir, 'config.json')) as f:
        command = json.load(f).get('runtime', {}).get('alert_command', '')
    except (OSError, ValueError):
      command = ''
  if s['state'] in ALERTED and command:
    s['alerted'] = alert_once(args.workdir, s, command)
  print(json.dumps(s) if args.json else describe(s), flush=True)
  return 1 if s['state'] in ALERTED else 0


if __name__ == '__main__':
  sys.exit(main())
