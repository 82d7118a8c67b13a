"""`python -m t5x_like.data batch`: the samples an iteration trained on, rebuilt from the
workdir."""

import json
import os
import shlex

import numpy as np
import pytest
from conftest import run_cli, small_config
from test_sources import make_dataset

from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import DEFAULT_MODEL_PATH
from t5x_like.parallel.train_state import Progress
from t5x_like.training import replay
from t5x_like.training.trainer import Trainer

SEQ = 16


def blended_run(tmp_path, seed=7):
  a = make_dataset(tmp_path / 'a_text_document', 100)
  b = make_dataset(tmp_path / 'b_text_document', 500)
  # A ramp-up 4 -> 8 over 16 samples, so iterations have different batch sizes and offsets.
  return small_config(
    train=dict(
      steps=10,
      global_batch_size=8,
      micro_batch_size=1,
      seq_len=SEQ,
      seed=seed,
      rampup_batch_size=(4, 4, 16),
    ),
    data=dict(train_path=f'0.3 {a} 0.7 {b}', split='90,10,0'),
    eval=dict(interval=0),
  )


def started(trainer):
  """A Trainer whose run has started (config.json and the job record written), not trained."""
  trainer.start(trainer.resumption.progress)
  return trainer


def trained_rows(trainer, iteration):
  """What the trainer feeds its step at `iteration`: [global batch, seq_len + 1] in sample order."""
  first, size = replay.first_sample_of(trainer.cfg, iteration)
  return np.asarray(trainer.global_batch(first, size)).reshape(size, SEQ + 1)


def test_the_batch_of_any_iteration_is_the_one_the_trainer_reads(tmp_path):
  workdir = str(tmp_path / 'run')
  trainer = started(Trainer(blended_run(tmp_path), workdir))  # config.json; nothing trains
  cfg, seed = replay.run_config(workdir)
  assert seed == 7
  sizes = []
  for iteration in range(1, 8):
    batch = replay.iteration_batch(cfg, seed, iteration)
    np.testing.assert_array_equal(batch.rows, trained_rows(trainer, iteration))
    sizes.append(len(batch.rows))
    # Dataset a's documents hold ids 100.., b's 500..: each sample's named dataset is its own.
    for name, row in zip(batch.datasets, batch.rows):
      assert name.endswith('a_text_document' if row[0] < 500 else 'b_text_document')
  assert sizes == [4, 4, 4, 4, 8, 8, 8]
  assert {n for i in (5, 6, 7) for n in replay.iteration_batch(cfg, seed, i).datasets} == {
    n for n in trainer.data.train_names
  }

  # A resumed job keeps the checkpoint's data order whatever train.seed its config.json says.
  state, _ = trainer.initial_state()
  trainer.checkpoints.save(state, Progress(iteration=2, consumed_samples=8))
  trainer.checkpoints.checkpointer.wait()
  trainer.checkpoints.checkpointer.close()
  with open(os.path.join(workdir, 'config.json')) as f:
    raw = json.load(f)
  raw['train']['seed'] = 99
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(raw, f)
  cfg, seed = replay.run_config(workdir)
  assert (cfg.train.seed, seed) == (99, 7)
  np.testing.assert_array_equal(replay.iteration_batch(cfg, seed, 6).rows, trained_rows(trainer, 6))
  assert not np.array_equal(replay.iteration_batch(cfg, 99, 6).rows, trained_rows(trainer, 6))


def test_each_iteration_is_rebuilt_with_the_job_that_trained_it(tmp_path):
  """A restart with another global batch size (and no ramp-up): iterations of the first job are
  rebuilt with its config (config_history.jsonl), those of the second from their metrics
  records; config.json alone (the latest job's) would give the first job's iterations 16
  samples each."""
  workdir = str(tmp_path / 'run')
  first_cfg = blended_run(tmp_path).replace(train={'steps': 3}, checkpoint={'save_interval': 3})
  Trainer(first_cfg, workdir).run()  # iterations 1-3: 4 samples each (the ramp's start)
  second_cfg = first_cfg.replace(
    train={'steps': 5, 'global_batch_size': 16, 'rampup_batch_size': ()}
  )
  second = Trainer(second_cfg, workdir)
  second.run()  # iterations 4-5: 16 samples each, from sample 12 on
  with open(os.path.join(workdir, replay.CONFIG_HISTORY)) as f:
    jobs = [json.loads(line) for line in f]
  assert [(j['first_iteration'], j['config']['train']['global_batch_size']) for j in jobs] == [
    (1, 8),
    (4, 16),
  ]
  expected = {2: (4, 4), 3: (8, 4), 4: (12, 16), 5: (28, 16)}  # iteration: (first sample, size)
  for iteration, (first, size) in expected.items():
    cfg, seed = replay.run_config(workdir, iteration)
    assert (cfg.train.global_batch_size, seed) == ((8 if iteration < 4 else 16), 7)
    batch = replay.iteration_batch(
      cfg, seed, iteration, replay.recorded_position(workdir, iteration)
    )
    assert (batch.first_sample, len(batch.rows)) == (first, size)
    np.testing.assert_array_equal(
      batch.rows, np.asarray(second.global_batch(first, size)).reshape(size, SEQ + 1)
    )
  latest, seed = replay.run_config(workdir)
  assert len(replay.iteration_batch(latest, seed, 2).rows) == 16  # what the history corrects
  r = run_cli(['-m', 't5x_like.data', 'batch', workdir, '--iteration', '3', '--json'])
  assert r.returncode == 0, r.stderr
  result = json.loads(r.stdout)
  assert (result['first_sample'], result['global_batch_size']) == (8, 4)


def test_command_line_prints_ids_text_and_the_skip_override(tmp_path):
  workdir = str(tmp_path / 'run')
  trainer = started(Trainer(blended_run(tmp_path), workdir))
  r = run_cli(['-m', 't5x_like.data', 'batch', workdir, '--iteration', '6', '--json'])
  assert r.returncode == 0, r.stderr
  result = json.loads(r.stdout)
  assert (result['iteration'], result['first_sample'], result['global_batch_size']) == (6, 24, 8)
  assert [s['sample'] for s in result['samples']] == list(range(24, 32))
  np.testing.assert_array_equal([s['ids'] for s in result['samples']], trained_rows(trainer, 6))
  assert 'text' not in result['samples'][0]  # Megatron data: its tokenizer is not known
  assert result['skip_with'] == "data.skip_train_iteration_range=('6-6',)"
  r = run_cli(
    [
      '-m',
      't5x_like.data',
      'batch',
      workdir,
      '--iteration',
      '2',
      '--max_tokens',
      '5',
      '--tokenizer_model',
      DEFAULT_MODEL_PATH,
    ]
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(
    f'iteration 2: samples 4..7 (4 samples of {SEQ} + 1 tokens, data seed 7)'
  )
  assert r.stdout.count('--- sample') == 4 and ': 5 ids: ' in r.stdout
  [advice] = [line for line in r.stdout.splitlines() if line.startswith('to train past')]
  # A shell passes the flag on whole, as the trainer reads it.
  assert shlex.split(advice.partition(': ')[2]) == [
    "--config.data.skip_train_iteration_range=('2-2',)"
  ]


def test_bad_workdir_or_iteration_is_exit_2_with_the_fix(tmp_path):
  r = run_cli(['-m', 't5x_like.data', 'batch', str(tmp_path), '--iteration', '1'])
  assert r.returncode == 2 and 'config.json not found: pass the workdir of a run' in r.stderr
  workdir = str(tmp_path / 'run')
  started(Trainer(blended_run(tmp_path), workdir)).release()
  r = run_cli(['-m', 't5x_like.data', 'batch', workdir, '--iteration', '11'])
  assert r.returncode == 2 and 'outside the run, which has iterations 1..10' in r.stderr


def test_a_torn_last_history_line_is_dropped_not_refused(tmp_path):
  """A kill or a full disk during record_job's append leaves a line without its newline: the
  next job reads the history without it and writes its own record in its place (a refusal would
  stop a job array on every requeue). Damage before the last line is still refused."""
  cfg = small_config()
  replay.record_job(str(tmp_path), 1, cfg, 7)
  path = tmp_path / replay.CONFIG_HISTORY
  with open(path, 'a') as f:
    f.write('{"first_iteration": 9, "torn')  # no newline
  assert [job['first_iteration'] for job in replay.read_history(str(tmp_path))] == [1]
  replay.record_job(str(tmp_path), 5, cfg, 7)
  assert [job['first_iteration'] for job in replay.read_history(str(tmp_path))] == [1, 5]
  assert path.read_text().count('\n') == 2 and '"torn' not in path.read_text()
  path.write_text('{torn in the middle\n' + path.read_text())
  with pytest.raises(DataError, match='line 1 is not a job record'):
    replay.read_history(str(tmp_path))
