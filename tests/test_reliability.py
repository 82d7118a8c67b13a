"""Nothing lost, nothing hung: damaged checkpoints moved aside, a workdir that changes only once
the run starts, its lock, the divergence stop, failed saves, and signals outside the loop."""

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import ALERT_RECORD, REPO, read_alerts
from test_checkpoints import corpus_config, losses_of

from t5x_like.checkpointing import checkpoints
from t5x_like.cli import train, watch
from t5x_like.config import ConfigError
from t5x_like.parallel.train_state import TrainState
from t5x_like.training import runtime
from t5x_like.training import workdir as workdir_lib
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics


@pytest.fixture(scope='module')
def four_steps(tmp_path_factory):
  """4 iterations of the one-layer corpus config, checkpoints at 2 and 4."""
  workdir = str(tmp_path_factory.mktemp('four'))
  Trainer(corpus_config(), workdir).run()
  return workdir


def snapshot(directory) -> dict:
  """{relative path: content hash} of every file and directory under `directory`, the lock file
  included (a refused run does not even name itself in it)."""
  result = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs:
      result[os.path.relpath(os.path.join(root, name), directory)] = 'dir'
    for name in files:
      path = os.path.join(root, name)
      if os.path.islink(path):
        result[os.path.relpath(path, directory)] = f'link to {os.readlink(path)}'
        continue
      with open(path, 'rb') as f:
        result[os.path.relpath(os.path.join(root, name), directory)] = hashlib.sha256(
          f.read()
        ).hexdigest()
  return result


def corpus_args(workdir, *overrides):
  """train.main's command line for corpus_config(): a config file beside the workdir."""
  path = os.path.join(os.path.dirname(os.path.abspath(str(workdir))), 'corpus_config.py')
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    f.write(
      f'import json\n\ndef get_config():\n  return json.loads('
      f'{json.dumps(corpus_config().to_dict())!r})\n'
    )
  return ['--config', path, '--workdir', str(workdir), *overrides]


# ----------------------------------------------------------------------- damaged checkpoints


def test_a_damaged_latest_checkpoint_is_moved_aside_and_costs_no_good_step(four_steps, tmp_path):
  """The issue's reproduction: step 4 loses its params; the run resumes from 2, says so, keeps
  the damaged step under .damaged/, saves 4 and 6 afresh, and the keep policy (2 here) never
  counts the broken step: no good step is lost."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '4', 'params'))
  root = os.path.join(workdir, 'checkpoints')
  assert checkpoints.damaged_steps(root) == {4: 'missing params'}
  trainer = Trainer(corpus_config(train=dict(steps=6), checkpoint=dict(max_to_keep=2)), workdir)
  assert os.path.isdir(os.path.join(root, '4'))  # nothing moved before the run starts
  trainer.run()
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert '> checkpoint 4 is damaged (missing params): moved aside to' in log
  assert '> the run resumes from checkpoint 2 (complete checkpoints: [2])' in log
  assert checkpoints.available_steps(root) == [4, 6]
  assert checkpoints.damaged_steps(root) == {}
  [moved] = glob.glob(os.path.join(root, checkpoints.DAMAGED_SUBDIR, '4-*'))
  assert sorted(os.listdir(moved)) == [
    '_CHECKPOINT_METADATA',
    'commit_success.txt',
    'config',
    'meta',
    'opt_state',
    'progress',
  ]
  # Iterations 3 and 4 trained again from checkpoint 2, exactly as the first time.
  assert losses_of(workdir)[:4] == losses_of(four_steps)


@pytest.mark.parametrize('damage', ['every step', 'a single truncated step'])
def test_a_workdir_whose_every_step_is_damaged_is_refused_not_restarted(
  four_steps, tmp_path, capsys, damage
):
  """Every step damaged (a file-system fault, say): exit 2 naming each step and how to start over
  on purpose; nothing is moved aside, nothing trains from iteration 0, no byte changes."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  root = os.path.join(workdir, 'checkpoints')
  if damage == 'every step':
    with open(os.path.join(root, '2', checkpoints.STEP_METADATA), 'wb') as f:
      f.write(os.urandom(64))  # garbage
    shutil.rmtree(os.path.join(root, '4', 'params'))
    expected = [
      f'{root}/2: its {checkpoints.STEP_METADATA} cannot be read',
      f'{root}/4: missing params',
    ]
  else:
    shutil.rmtree(os.path.join(root, '2'))
    with open(os.path.join(root, '4', 'progress', 'metadata'), 'r+') as f:
      f.truncate(10)
    expected = [f'{root}/4: the metadata of its progress item cannot be read']
  before = snapshot(workdir)
  assert train.main(corpus_args(workdir, '--config.train.steps=6')) == 2
  out, err = capsys.readouterr()
  [error] = [line for line in err.splitlines() if line.startswith('error:')]
  assert error.startswith(
    f'error: no checkpoint in {root} can be restored: every step is damaged ('
  )
  assert all(fragment in error for fragment in expected), error
  assert f'to start this run over on purpose, move {root} aside' in error
  assert 'Traceback' not in err and 'iteration' not in out
  assert snapshot(workdir) == before


def test_a_step_with_unreadable_metadata_is_damaged_too(four_steps, tmp_path):
  root = str(tmp_path / 'ckpt')
  shutil.copytree(os.path.join(four_steps, 'checkpoints'), root)
  with open(os.path.join(root, '4', 'progress', 'metadata'), 'w') as f:
    f.write('{"iteration": 4, "consu')  # torn
  with open(os.path.join(root, '2', checkpoints.STEP_METADATA), 'w') as f:
    f.write('')
  problems = checkpoints.damaged_steps(root)
  assert problems[4].startswith('the metadata of its progress item cannot be read')
  assert problems[2].startswith(f'its {checkpoints.STEP_METADATA} cannot be read')
  assert checkpoints.available_steps(root) == []


# ------------------------------------------------------------------------------- the workdir


def test_a_refused_resume_leaves_the_workdir_as_it_was(four_steps, tmp_path):
  """Exit 2 from a bad resume (another model shape; a step whose tensors cannot be read)
  changes nothing: not config.json, not the job history, not the records, not the lock file
  (which names the earlier run's process until a run really starts)."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  with open(os.path.join(workdir, workdir_lib.LOCK_FILE), 'w') as f:
    f.write('{"host": "earlier-node", "pid": 1, "since": "2026-01-01 00:00:00"}\n')
  before = snapshot(workdir)
  assert train.main(corpus_args(workdir, '--config.model.hidden_size=64')) == 2
  assert snapshot(workdir) == before
  data = os.path.join(workdir, 'checkpoints', '4', 'params', 'ocdbt.process_0', 'd')
  biggest = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
  os.truncate(biggest, 100)
  before = snapshot(workdir)
  assert train.main(corpus_args(workdir, '--config.train.steps=6')) == 2
  assert snapshot(workdir) == before


@pytest.mark.parametrize('name', [workdir_lib.LOCK_FILE, 'metrics.jsonl', 'logs/main_log.txt'])
def test_a_run_file_that_is_a_link_is_refused_and_nothing_outside_is_written(
  four_steps, tmp_path, capsys, name
):
  """trainer.lock or a file the run appends to, planted as a symbolic link to a file outside the
  workdir (or to where a file would be created): exit 2 naming the link, the outside file's
  bytes unchanged, nothing created, the workdir as it was."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  link = os.path.join(workdir, name)
  os.remove(link)
  outside = tmp_path / 'precious.txt'
  outside.write_text('weeks of notes\n')
  for target in (outside, tmp_path / 'not_yet_there'):
    os.symlink(target, link)
    before = snapshot(workdir)
    assert train.main(corpus_args(workdir, '--config.train.steps=6')) == 2
    err = capsys.readouterr().err
    assert (
      f'error: {link} is a symbolic link (to {target}); the trainer writes nothing '
      'outside its workdir: '
    ) in err, err
    assert snapshot(workdir) == before
    assert outside.read_text() == 'weeks of notes\n'
    assert not os.path.exists(tmp_path / 'not_yet_there')
    os.remove(link)


def test_a_refused_run_does_not_create_its_workdir(tmp_path, capsys):
  """Nor the parents it would have made: the lock made them, and removes them again."""
  workdir = tmp_path / 'new' / 'runs' / 'run'
  corpus_args(tmp_path / 'config', '--config.data.train_path=/nonexistent/prefix')  # the config
  assert (
    train.main(
      ['--config', str(tmp_path / 'corpus_config.py'), '--workdir', str(workdir)]
      + ['--config.data.train_path=/nonexistent/prefix']
    )
    == 2
  )
  assert not os.path.exists(tmp_path / 'new')
  assert 'nonexistent' in capsys.readouterr().err


@pytest.mark.parametrize('workdir', ['', '   '])
def test_an_empty_workdir_is_refused(workdir, capsys):
  assert train.main(['--config', 'configs/tiny.py', '--workdir', workdir]) == 2
  assert '--workdir is empty' in capsys.readouterr().err


def test_an_unwritable_tensorboard_dir_is_refused_before_anything(tmp_path, capsys):
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  workdir = tmp_path / 'run'
  assert train.main(corpus_args(workdir, f'--config.runtime.tensorboard_dir={blocker}/tb')) == 2
  assert f'runtime.tensorboard_dir {blocker}/tb cannot be created: {blocker} is a file' in (
    capsys.readouterr().err
  )
  assert not os.path.exists(workdir)


def test_a_second_trainer_on_a_workdir_is_refused_and_a_stale_lock_does_not_block(
  four_steps, tmp_path
):
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  holder = Trainer(corpus_config(train=dict(steps=6)), workdir)  # holds the lock until run ends
  before = snapshot(workdir)
  r = subprocess.run(
    [sys.executable, '-m', 't5x_like.train', *corpus_args(workdir)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert r.returncode == 2, r.stderr[-2000:]
  assert (
    f'workdir {workdir} is in use by another trainer (host {socket.gethostname()}, pid '
    f'{os.getpid()}, since '
  ) in r.stderr
  assert snapshot(workdir) == before
  with pytest.raises(ConfigError, match='is in use by another trainer'):
    Trainer(corpus_config(train=dict(steps=6)), workdir)  # in the same process too
  holder.run()
  assert read_metrics(workdir)[-1]['iteration'] == 6
  # A lock file left by a killed trainer (its content says who, but no process holds the lock).
  with open(os.path.join(workdir, workdir_lib.LOCK_FILE), 'w') as f:
    f.write('{"host": "dead-node", "pid": 1, "since": "2026-01-01 00:00:00"}\n')
  Trainer(corpus_config(train=dict(steps=7)), workdir).run()
  assert read_metrics(workdir)[-1]['iteration'] == 7


def test_a_restart_with_no_checkpoint_starts_its_records_afresh(four_steps, tmp_path):
  """A job killed before its first checkpoint left records; the next job starts from scratch
  and so drops them: iteration 1 appears once."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints'))
  Trainer(corpus_config(train=dict(steps=2)), workdir).run()
  assert [r['iteration'] for r in read_metrics(workdir)] == [1, 2]
  assert losses_of(workdir) == losses_of(four_steps)[:2]


# -------------------------------------------------------------------------------- divergence


def test_a_run_whose_every_step_is_nan_stops_as_diverged(tmp_path):
  """lr 1e30 (the issue's reproduction): iteration 1's update makes the params huge, every
  later loss is NaN. The run stops after runtime.max_consecutive_nan of them with exit code 5
  instead of going on to its last iteration, keeps (saves) iteration 1's state, the last finite
  one, says what to do, and alerts."""
  workdir = str(tmp_path / 'run')
  code = train.main(
    corpus_args(
      workdir,
      '--config.optimizer.lr=1e30',
      '--config.optimizer.min_lr=0',
      '--config.optimizer.warmup_samples=0',
      '--config.train.steps=20',
      '--config.runtime.max_consecutive_nan=3',
      f'--config.runtime.alert_command={ALERT_RECORD}',
    )
  )
  assert code == runtime.ExitCode.DIVERGED == 5
  records = read_metrics(workdir)
  assert [r['iteration'] for r in records] == [1, 2, 3, 4]
  assert [r['nan_iterations'] for r in records] == [0, 1, 2, 3]
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert (
    '> diverged: iterations 2-4 (3 in a row, runtime.max_consecutive_nan=3) had a '
    'non-finite loss or gradient norm'
  ) in log
  assert 'the next run resumes from checkpoint 1, the last finite state' in log
  assert f'python -m t5x_like.ckpt rollback {workdir}/checkpoints --to STEP' in log
  assert 'data.skip_train_iteration_range' in log and 'override_lr_scheduler' in log
  assert log.rstrip().endswith('exit code 5 (DIVERGED)')
  root = os.path.join(workdir, 'checkpoints')
  assert checkpoints.available_steps(root) == [1]  # not 2 (periodic) nor 4: non-finite ones
  assert checkpoints.read_progress(root).nan_iterations == 0
  assert [a[0] for a in read_alerts(workdir)] == ['diverged']
  assert watch.status(workdir, stale_mins=30, now=time.time() + 3600)['state'] == 'diverged'


def test_a_divergence_keeps_the_last_finite_state(four_steps, tmp_path, monkeypatch):
  """Iterations 4.. report non-finite (the step skipped them, so the state is iteration 3's):
  the run saves iteration 3's state, not one labelled with a non-finite iteration."""
  workdir = str(tmp_path / 'run')
  real = Trainer.train_iteration

  def non_finite_from_4(self, state, progress):
    if progress.iteration + 1 < 4:
      return real(self, state, progress)
    progress.iteration += 1  # what a skipped step does to the counters
    progress.skipped_iterations += 1
    return state, None, False  # no record: the metrics are not this test's

  monkeypatch.setattr(Trainer, 'train_iteration', non_finite_from_4)
  trainer = Trainer(
    corpus_config(
      train=dict(steps=20), checkpoint=dict(save_interval=5), runtime=dict(max_consecutive_nan=2)
    ),
    workdir,
  )
  trainer.run()
  assert trainer.stop_reason is runtime.StopReason.DIVERGED
  root = os.path.join(workdir, 'checkpoints')
  assert checkpoints.available_steps(root) == [3]
  assert checkpoints.read_progress(root).iteration == 3


def test_a_save_never_writes_non_finite_params(tmp_path):
  from test_checkpoints import save_step, tiny_state

  cfg, layout, state = tiny_state()
  root = str(tmp_path / 'ckpt')
  checkpointer = checkpoints.Checkpointer(root, 1, max_to_keep=3, layout=layout)
  assert save_step(checkpointer, cfg, state, 1)
  params = dict(state.params)
  params['final_ln'] = {**params['final_ln'], 'scale': params['final_ln']['scale'] * float('inf')}
  with pytest.raises(
    checkpoints.NonFiniteStateError,
    match='checkpoint 2 not saved: the params hold non-finite values .* The '
    'latest checkpoint, 1, is unchanged',
  ):
    save_step(checkpointer, cfg, TrainState(params, state.opt_state), 2)
  checkpointer.close()
  assert checkpoints.available_steps(root) == [1]
  assert not [d for d in os.listdir(root) if d.startswith('2')]


def test_divergence_watch_counts_consecutive_non_finite_iterations():
  from t5x_like.parallel.train_state import Progress
  from t5x_like.training.watches import DivergenceWatch

  watch_ = DivergenceWatch(3, Progress())
  verdicts = []
  for iteration, finite in enumerate([True, False, False, True, False, False, False], start=1):
    verdicts.append(watch_.add(Progress(iteration=iteration), finite))
  assert verdicts[:6] == [None] * 6
  assert verdicts[6].startswith('> diverged: iterations 5-7 (3 in a row')
  assert watch_.last_finite.iteration == 4
  assert all(
    DivergenceWatch(0, Progress()).add(Progress(iteration=i), False) is None for i in range(1, 50)
  )


# ----------------------------------------------------------------------------- failed saves


# The start-up lines TensorFlow and XLA print on stderr whatever happens (absl's log format).
START_UP_NOISE = re.compile(r'^([IWE]\d{4} |WARNING: All log messages before absl)')

FULL_DISK = """
set -u
mount -t tmpfs -o size=4m t5x_like_test "{fs}"
"{python}" -m t5x_like.train {args} > "{out}/stdout" 2> "{out}/stderr"
echo $? > "{out}/rc"
ls "{fs}/run/checkpoints" > "{out}/checkpoints"
"""


def test_a_full_disk_during_a_save_is_one_message(tmp_path):
  """A file system with room for the run's logs but not for its first checkpoint (a 4 MiB tmpfs,
  mounted in a mount namespace of the test's own): exit 1 and one line on stderr besides the
  start-up lines, not hundreds of 'Event loop is closed' tracebacks of Orbax's pending writes
  (the tiny config's shapes on 8 devices: many shards in flight when the disk fills), and no
  step directory. (test_a_save_that_cannot_be_written... shows the earlier steps kept.)"""
  fs, out = tmp_path / 'fs', tmp_path / 'out'
  fs.mkdir()
  out.mkdir()
  args = [
    '--config',
    os.path.join(REPO, 'configs', 'tiny.py'),
    '--workdir',
    str(fs / 'run'),
    '--config.train.steps=2',
    '--config.checkpoint.save_interval=2',
    '--config.eval.interval=0',
    '--config.mesh.data=2',
    '--config.mesh.tensor=4',
  ]
  script = FULL_DISK.format(
    fs=fs, python=sys.executable, out=out, args=' '.join(f"'{a}'" for a in args)
  )
  # --map-root-user: a mount namespace without being root, where user namespaces are allowed.
  r = subprocess.run(
    ['unshare', '--mount', '--map-root-user', 'sh', '-c', script],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  stderr = (out / 'stderr').read_text()
  assert (out / 'rc').read_text().strip() == '1', stderr[-3000:]
  lines = [line for line in stderr.splitlines() if not START_UP_NOISE.match(line)]
  assert len(lines) == 1, f'{len(lines)} lines on stderr: ' + '\n'.join(lines[:40])
  assert lines[0].startswith('error: checkpoint 2 could not be written to ')
  assert 'No space left on device' in lines[0]
  assert 'resumes from the latest complete checkpoint (none yet; complete: [])' in lines[0]
  assert not [d for d in (out / 'checkpoints').read_text().split() if d.isdigit()]


ECHOES = r"""
import asyncio, gc, sys
from orbax.checkpoint._src.serialization import serialization
from t5x_like.checkpointing import checkpoints

ORBAX_READ = '''
import asyncio

async def read_shard(started):
  try:
    started.set_result(True)
    await asyncio.sleep(3600)
  except BaseException as e:  # as Orbax's _read_array_index_and_device_put does
    raise Exception('Encountered error while reading array index') from e

async def write_fragment():
  raise ValueError('RESOURCE_EXHAUSTED: Error writing in OCDBT database')
'''

async def unrelated_task():
  raise ValueError('an unrelated task error')

if sys.argv[1] == 'silenced':
  aftermath = checkpoints.silence_orbax_aftermath()
closed = asyncio.new_event_loop()
closed.close()

class PendingWrite:
  def __del__(self):
    closed.call_soon_threadsafe(print)  # RuntimeError: Event loop is closed

orbax_code = {}  # compiled as a file of Orbax's, as its coroutines are
exec(compile(ORBAX_READ, serialization.__file__, 'exec'), orbax_code)
loop = asyncio.new_event_loop()
started = loop.create_future()
task = loop.create_task(orbax_code['read_shard'](started))
loop.run_until_complete(started)
PendingWrite()
del task
failed = [loop.create_task(orbax_code['write_fragment']()), loop.create_task(unrelated_task())]
loop.run_until_complete(asyncio.wait(failed))
del failed  # asyncio logs 'Task exception was never retrieved' for each
# Futures TensorStore failed from its own threads: 'Future exception was never retrieved'.
futures = [loop.create_future(), loop.create_future()]
futures[0].set_exception(ValueError(
  'OUT_OF_RANGE: Error reading "x" in OCDBT database at local file "/ckpt/4/params/"'))
futures[1].set_exception(ValueError('an unrelated future error'))
# Orbax's wrapping of a failed read, raised from TensorStore's (asyncio.gather's future).
wrapped = Exception('Encountered error while reading array index: (slice(0, 1, 1),)')
wrapped.__cause__ = ValueError(
  'OUT_OF_RANGE: Error reading "y" in OCDBT database at local file "/ckpt/4/params/"')
futures.append(loop.create_future())
futures[2].set_exception(wrapped)
del futures
loop.close()
gc.collect()  # the pending read is finalised: GeneratorExit -> Exception

class Other:
  def __del__(self):
    raise KeyError('an unrelated error')

Other()
if sys.argv[1] == 'silenced':
  print(aftermath.count)
"""


@pytest.mark.parametrize('silenced', [True, False])
def test_the_echoes_of_a_failed_save_or_restore_are_not_printed(silenced):
  """What Orbax's threads print after a failed write or read reaches Python's unraisable hook:
  a callback that finds Orbax's event loop closed (TensorStore calls it with no Python frame to
  raise into), an Orbax read coroutine finalised mid-read, which turns the GeneratorExit into
  its own error (and asyncio's report of its task destroyed while pending); and asyncio's report
  of an Orbax write task, or of a future TensorStore failed (or Orbax's error raised from
  TensorStore's), whose error nobody retrieved. Once
  a save or restore has begun (checkpoints.silence_orbax_aftermath) those are counted, not
  printed; any other unraisable error or unretrieved task error still is. In a process of its
  own: pytest swaps the unraisable hook around each test."""
  r = subprocess.run(
    [sys.executable, '-c', ECHOES, 'silenced' if silenced else 'plain'],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
    check=True,
  )
  assert 'an unrelated error' in r.stderr
  assert 'an unrelated task error' in r.stderr
  assert 'an unrelated future error' in r.stderr
  assert ('OCDBT' in r.stderr) != silenced, r.stderr
  assert ('Event loop is closed' in r.stderr) != silenced, r.stderr
  assert ('reading array index' in r.stderr) != silenced, r.stderr
  assert ('RESOURCE_EXHAUSTED' in r.stderr) != silenced, r.stderr
  assert ('Task was destroyed but it is pending' in r.stderr) != silenced, r.stderr
  if silenced:
    assert r.stdout.split() == ['6']


def test_a_truncated_tensor_file_is_one_message(four_steps, tmp_path):
  """The latest step's params file truncated: exit 2 and one line (not Orbax's un-awaited read
  coroutines and closed-loop callbacks printed after it), the workdir unchanged."""
  workdir = str(tmp_path / 'run')
  shutil.copytree(four_steps, workdir)
  data = os.path.join(workdir, 'checkpoints', '4', 'params', 'ocdbt.process_0', 'd')
  for name in os.listdir(data):  # every tensor file: each read fails
    os.truncate(os.path.join(data, name), 100)
  before = snapshot(workdir)
  r = subprocess.run(
    [
      sys.executable,
      '-m',
      't5x_like.train',
      *corpus_args(
        workdir, '--config.train.steps=6', '--config.mesh.data=2', '--config.mesh.tensor=4'
      ),
    ],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert r.returncode == 2, r.stderr[-3000:]
  lines = [line for line in r.stderr.splitlines() if not START_UP_NOISE.match(line)]
  assert len(lines) == 1, f'{len(lines)} lines on stderr: ' + '\n'.join(lines[:40])
  assert lines[0].startswith(
    f'error: {workdir}/checkpoints/4 is damaged or incomplete and cannot be restored: '
  )
  assert snapshot(workdir) == before


# ------------------------------------------------------------------ signals outside the loop

STUCK_IN_START_UP = """
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from t5x_like.cli import train
from t5x_like.data import sources
real_build = sources.build

def slow_build(*args, **kwargs):
  open({marker!r}, 'w').close()
  if {native!r}:
    # As a thread inside a native call (an XLA compilation) is: no Python signal handler runs
    # in it until the call returns.
    signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM, signal.SIGINT}})
  time.sleep(600)
  return real_build(*args, **kwargs)

sources.build = slow_build
sys.exit(train.main({args!r}))
"""


@pytest.mark.parametrize(
  'sig,native', [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGTERM, True)]
)
def test_a_signal_during_start_up_ends_the_process_at_once(tmp_path, sig, native):
  """SIGTERM or SIGINT while the trainer prepares its data (here: a data preparation that would
  take 10 minutes) ends it with exit code 3 and one message, and the workdir stays untouched;
  also when the main thread is inside a native call that runs no Python handler."""
  workdir = tmp_path / 'run'
  marker = str(tmp_path / 'preparing')
  script = STUCK_IN_START_UP.format(
    tests=os.path.join(REPO, 'tests'), marker=marker, native=native, args=corpus_args(workdir)
  )
  process = subprocess.Popen(
    [sys.executable, '-c', script],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    for _ in range(1200):
      if os.path.exists(marker) or process.poll() is not None:
        break
      time.sleep(0.1)
    assert os.path.exists(marker), process.communicate()[1][-3000:]
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)  # the data preparation alone would take 600 s
  finally:
    process.kill()
  assert process.returncode == runtime.ExitCode.REQUEUE, err[-3000:]
  assert f'received {signal.Signals(sig).name} before the first iteration' in err
  # Left through the Python handler, or (native) through the watcher thread.
  assert ('left during a native call' in err) == native, err[-2000:]
  assert 'Traceback' not in err
  # Locked (and so created), then removed again; a process that left from a native call can
  # only leave its lock file, which blocks nobody.
  assert not os.path.exists(workdir) or os.listdir(workdir) == [workdir_lib.LOCK_FILE]


SIGNAL_WHILE_IMPORTING = """
import importlib.abc, os, runpy, signal, sys

class SignalOnImport(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name == 't5x_like.cli.train':  # the command's slow import (jax and the rest) begins
      os.kill(os.getpid(), signal.SIGTERM)
    return None  # the real import goes on

sys.meta_path.insert(0, SignalOnImport())
sys.argv = ['t5x_like.train', '--config', 'configs/tiny.py', '--workdir', {workdir!r}]
runpy.run_module('t5x_like.train', run_name='__main__')
"""


def test_a_signal_while_the_command_imports_is_exit_3_and_one_line(tmp_path):
  """`python -m t5x_like.train` spends about a second importing before the trainer watches the
  signals; a SIGTERM then was the default action's silent exit 143."""
  workdir = tmp_path / 'run'
  r = subprocess.run(
    [sys.executable, '-c', SIGNAL_WHILE_IMPORTING.format(workdir=str(workdir))],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == runtime.ExitCode.REQUEUE, (r.returncode, r.stderr[-3000:])
  assert r.stderr.strip().endswith(
    'received SIGTERM before the first iteration of this job: nothing was trained, the last '
    'checkpoint is intact; exit code 3 (REQUEUE)'
  )
  assert not workdir.exists()


@pytest.mark.parametrize('delay_s', [0.5, 1.5])
def test_the_trainer_command_exits_3_when_a_signal_interrupts_its_start_up(tmp_path, delay_s):
  """`python -m t5x_like.train` sent SIGTERM as the run starts (its log file just made), while
  it imports TensorFlow for its TensorBoard writer and XLA runs what it dispatched: exit code 3
  and the one message. Before, the handler's exception was dropped in some of these runs, which
  then trained on and exited 0 (the cause: tests/test_runtime.py); from a shell the
  interpreter's teardown under the half-made import crashed (exit 139) in most runs."""
  workdir = tmp_path / 'run'
  process = subprocess.Popen(
    [
      sys.executable,
      '-m',
      't5x_like.train',
      *('--config', 'configs/tiny.py', '--config.eval.interval=0', '--config.train.steps=4'),
      *('--workdir', str(workdir)),
    ],
    cwd=REPO,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    for _ in range(1200):
      if (workdir / 'logs' / 'main_log.txt').exists() or process.poll() is not None:
        break
      time.sleep(0.05)
    time.sleep(delay_s)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
  finally:
    process.kill()
  assert process.returncode == runtime.ExitCode.REQUEUE, err[-3000:]
  assert 'received SIGTERM before the first iteration' in err


def test_a_closed_terminal_saves_and_asks_for_a_requeue(tmp_path):
  """The trainer on a terminal (a pseudo-terminal it controls) whose other side closes, as when an
  ssh session drops: the kernel sends SIGHUP and every later write to the terminal fails. The run
  saves at the next iteration boundary and exits 3 (not 129, unsaved), its log saying why; a
  trainer started with SIGHUP ignored (`nohup`) trains on."""
  import pty

  workdir = tmp_path / 'run'
  args = corpus_args(
    workdir,
    '--config.train.steps=100000',
    '--config.checkpoint.save_interval=0',
    '--config.eval.interval=0',
  )
  log = workdir / 'logs' / 'main_log.txt'
  for nohup in (False, True):
    shutil.rmtree(workdir, ignore_errors=True)
    terminal, tty = pty.openpty()
    # A session of its own whose controlling terminal is the pty (util-linux's setsid --ctty).
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)
    try:
      process = subprocess.Popen(
        ['setsid', '--ctty', sys.executable, '-m', 't5x_like.train', *args],
        cwd=REPO,
        stdin=tty,
        stdout=tty,
        stderr=tty,
      )
    finally:
      signal.signal(signal.SIGHUP, previous)
      os.close(tty)
    output = []
    threading.Thread(target=drain, args=(terminal, output), daemon=True).start()
    try:
      for _ in range(1200):  # up to 120 s for start-up and the first iterations
        if log.exists() and ' iteration        3/' in log.read_text():
          break
        time.sleep(0.1)
      assert log.exists() and ' iteration        3/' in log.read_text(), b''.join(output)[-3000:]
      os.close(terminal)  # the terminal goes away: SIGHUP to the session leader
      if nohup:
        time.sleep(3)
        assert process.poll() is None  # still training
        process.send_signal(signal.SIGTERM)
      code = process.wait(timeout=120)
    finally:
      process.kill()
    assert code == runtime.ExitCode.REQUEUE, log.read_text()[-2000:]
    text = log.read_text()
    reason = 'received SIGTERM' if nohup else 'received SIGHUP'
    assert '> stopping at iteration' in text and reason in text, text[-2000:]
    steps = checkpoints.available_steps(str(workdir / 'checkpoints'))
    assert steps == [read_metrics(str(workdir))[-1]['iteration']], steps


def drain(fd, output):
  """Reads a pseudo-terminal until it closes (a child writing to a full one would block)."""
  with contextlib.suppress(OSError):
    while data := os.read(fd, 4096):
      output.append(data)


def test_the_watch_reports_a_diverged_run(tmp_path):
  logs = tmp_path / 'logs'
  logs.mkdir()
  (logs / 'main_log.txt').write_text(
    '> stopped: 4 iterations, 16 samples; exit code 5 (DIVERGED)\n'
  )
  s = watch.status(str(tmp_path), stale_mins=30, now=time.time() + 3600)
  assert s['state'] == 'diverged'
  assert watch.main([str(tmp_path), '--json']) == 1
  assert json.loads(json.dumps(s))['state'] == 'diverged'
