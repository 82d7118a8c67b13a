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


def test_a_running_run_says_how_far_it_is_and_how_long_it_has_left(tmp_path, capsys):
  """The last records of metrics.jsonl against the config's total samples: iteration 60 of 100,
  at the pace of the last 50 iterations (16 samples every 2 s; the 10 slow ones before them do
  not count), 640 samples to go: 80 s of training steps. A torn last line is skipped."""
  from t5x_like.config import Config

  make_run(tmp_path, TRAINING, idle_mins=1)
  cfg = Config.from_dict({'train': {'steps': 100, 'global_batch_size': 16, 'micro_batch_size': 4}})
  (tmp_path / 'config.json').write_text(cfg.to_json())
  records = [
    {
      'iteration': i,
      'consumed_samples': 16 * i,
      'global_batch_size': 16,
      'step_time_s': 30.0 if i <= 10 else 2.0,
    }
    for i in range(1, 61)
  ]
  lines = [json.dumps(r) for r in records] + ['{"iteration": 61, "consum']
  (tmp_path / 'metrics.jsonl').write_text('\n'.join(lines))
  code, state = run_watch(tmp_path, capsys)
  assert code == 0 and state['state'] == 'running'
  assert state['progress'] == {
    'iteration': 60,
    'iterations': 100,
    'done': 0.6,
    'samples_per_sec': 8.0,
    'hours_left': round(80 / 3600, 2),
    'pace_of': 50,
  }
  assert watch.main([str(tmp_path)]) == 0
  assert (
    'Iteration 60 of 100, 60.0% of its samples; about 1m of training steps left at the pace of '
    'its last 50 iterations (8 samples/s)'
  ) in capsys.readouterr().out


def test_durations_read_in_days_hours_and_minutes():
  assert [watch.describe_duration(h) for h in (0.2, 5.2, 76.1)] == ['12m', '5h 12m', '3d 4h']


def test_a_long_runs_records_are_read_from_their_end(tmp_path):
  """A metrics.jsonl larger than what is read (its last watch.TAIL_BYTES): the line cut at the
  start of that window is skipped, and the last 50 records are whole."""
  from t5x_like.config import Config

  cfg = Config.from_dict({'train': {'steps': 9000, 'global_batch_size': 16, 'micro_batch_size': 4}})
  (tmp_path / 'config.json').write_text(cfg.to_json())
  pad = 'x' * 80
  lines = [
    json.dumps(
      {'iteration': i, 'consumed_samples': 16 * i, 'global_batch_size': 16, 'step_time_s': 1.0}
    )[:-1]
    + f', "pad": "{pad}"}}'
    for i in range(1, 4001)
  ]
  (tmp_path / 'metrics.jsonl').write_text('\n'.join(lines) + '\n')
  assert os.path.getsize(tmp_path / 'metrics.jsonl') > 2 * watch.TAIL_BYTES
  p = watch.progress(str(tmp_path))
  assert (p['iteration'], p['pace_of'], p['samples_per_sec'], p['done']) == (4000, 50, 16.0, 0.4444)
