"""t5x_like.watch: a run's state from outside (cron), and one alert per episode."""

import json
import os
import stat
import time

from conftest import ALERT_RECORD, read_alerts

from t5x_like.cli import watch


def make_run(workdir, log_lines, idle_mins, alert_command=ALERT_RECORD):
  """A workdir as the trainer leaves it, last written `idle_mins` ago."""
  os.makedirs(workdir / 'logs', exist_ok=True)
  (workdir / 'config.json').write_text(json.dumps({'runtime': {'alert_command': alert_command}}))
  (workdir / 'logs' / 'main_log.txt').write_text(''.join(line + '\n' for line in log_lines))
  (workdir / 'metrics.jsonl').write_text('{"iteration": 1}\n')
  then = time.time() - idle_mins * 60
  for path in (workdir / 'logs' / 'main_log.txt', workdir / 'metrics.jsonl'):
    os.utime(path, (then, then))


TRAINING = [' iteration        7/     100 | consumed samples: 112 |']
DONE = ['> done: 100 iterations, 1600 samples; exit code 0 (FINISHED)']
REQUEUE = [
  '> stopping at iteration 40: received SIGUSR1',
  '> stopped: 40 iterations, 640 samples; exit code 3 (REQUEUE)',
]
KILL_SWITCH = ['> stopped: 40 iterations, 640 samples; exit code 0 (FINISHED)']


def run_watch(workdir, capsys, *flags):
  code = watch.main([str(workdir), '--json', *flags])
  return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_run_that_writes_is_running_and_one_that_said_done_is_finished(tmp_path, capsys):
  make_run(tmp_path, TRAINING, idle_mins=2)
  assert run_watch(tmp_path, capsys)[1]['state'] == 'running'
  # A requeue in progress: stopped a minute ago, the next job has --stale-mins to start.
  make_run(tmp_path, TRAINING + REQUEUE, idle_mins=1)
  assert run_watch(tmp_path, capsys)[1]['state'] == 'running'
  for ended in (DONE, KILL_SWITCH):
    make_run(tmp_path, TRAINING + ended, idle_mins=600)
    code, state = run_watch(tmp_path, capsys)
    assert (code, state['state'], state['last_end_line']) == (0, 'finished', ended[-1])
  assert read_alerts(tmp_path) == []


def test_a_silent_run_is_stale_and_alerts_once_per_episode(tmp_path, capsys):
  make_run(tmp_path, TRAINING, idle_mins=45)
  code, state = run_watch(tmp_path, capsys, '--stale-mins', '30')
  assert (code, state['state'], state['alerted']) == (1, 'stale', True)
  assert state['idle_mins'] >= 45
  ((event, iteration, process, message),) = read_alerts(tmp_path)
  assert (event, iteration, process) == ('stale', '', '0')
  assert message.startswith(f'{tmp_path}: stale, last write 45.')
  # The next cron tick: the same episode, no second alert.
  assert run_watch(tmp_path, capsys)[1]['alerted'] is False
  assert len(read_alerts(tmp_path)) == 1
  # The run wrote again, then went silent again: a new episode.
  make_run(tmp_path, TRAINING * 2, idle_mins=40)
  assert run_watch(tmp_path, capsys)[1]['alerted'] is True
  assert [a[0] for a in read_alerts(tmp_path)] == ['stale', 'stale']
  # Under the threshold it is running.
  assert run_watch(tmp_path, capsys, '--stale-mins', '60')[1]['state'] == 'running'


def fake_squeue(tmp_path, monkeypatch, states):
  """An `squeue` on PATH that lists jobs in `states` for the name it is asked about."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  script = bin_dir / 'squeue'
  script.write_text(
    '#!/bin/sh\n'
    'case "$*" in *"--name train-tr11"*) printf "%s\\n" ' + ' '.join(states) + ' ;; esac\n'
  )
  script.chmod(script.stat().st_mode | stat.S_IEXEC)
  monkeypatch.setenv('PATH', f'{bin_dir}{os.pathsep}{os.environ["PATH"]}')


def test_a_requeued_run_waiting_in_slurms_queue_is_not_dead(tmp_path, capsys, monkeypatch):
  workdir = tmp_path / 'run'
  make_run(workdir, TRAINING + REQUEUE, idle_mins=120)
  code, state = run_watch(workdir, capsys)  # without the queue: it stopped, nobody restarted it
  assert (code, state['state']) == (1, 'stopped')
  assert read_alerts(workdir)[0][0] == 'stopped'
  fake_squeue(tmp_path, monkeypatch, ['PENDING'])
  code, state = run_watch(workdir, capsys, '--slurm-job-name', 'train-tr11')
  assert (code, state['state'], state['slurm_states']) == (0, 'queued', ['PENDING'])
  # A job of another name does not count.
  code, state = run_watch(workdir, capsys, '--slurm-job-name', 'other')
  assert (code, state['state']) == (1, 'stopped')


def test_bad_workdir_or_missing_squeue_is_one_clear_error(tmp_path, capsys, monkeypatch):
  assert watch.main([str(tmp_path / 'nowhere')]) == 2
  assert 'has no logs/main_log.txt or metrics.jsonl: not the workdir of a run' in (
    capsys.readouterr().err
  )
  make_run(tmp_path, TRAINING, idle_mins=1)
  monkeypatch.setenv('PATH', str(tmp_path / 'empty'))
  assert watch.main([str(tmp_path), '--slurm-job-name', 'x']) == 2
  assert '--slurm-job-name needs squeue on PATH' in capsys.readouterr().err


def test_stale_mins_must_be_a_finite_number_above_0(tmp_path, capsys):
  """nan made every run stale (no idle time is < nan) and inf every run alive: both refused,
  like 0 and -5, with one message and exit code 2, before the workdir is looked at."""
  make_run(tmp_path, TRAINING, idle_mins=45)
  for value in ('nan', 'inf', '-inf', '0', '-5'):
    assert watch.main([str(tmp_path), f'--stale-mins={value}']) == 2, value
    captured = capsys.readouterr()
    assert captured.out == '' and captured.err == (
      f'error: --stale-mins must be a finite number of minutes > 0, got {float(value)}; give '
      'how long the run may go without writing (the default is 30)\n'
    ), captured.err
  assert read_alerts(tmp_path) == []
