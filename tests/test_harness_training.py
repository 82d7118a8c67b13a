"""eval.harness_tasks: lm-evaluation-harness tasks on the live params during training, written
beside the validation sets, resumed with the run, a bad task refused before the run starts, and
a task that fails mid-run reported without ending it."""

import json
import os
import shutil

import pytest
from conftest import REPO, config_with

from t5x_like.cli import train as train_cli
from t5x_like.config import ConfigError
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics

TASKS = os.path.join(REPO, 'tests', 'harness_tasks')


def harness_config(**eval_section):
  """A small BLOOM on the embedded corpus (the shipped tokenizer's 8192 tokens), 4 iterations,
  checkpoints every 2, the local multiple-choice and perplexity tasks every 2 iterations on 4
  documents each."""
  return config_with(
    {
      'model': dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=8192, init_std=0.02),
      'train': dict(steps=4, global_batch_size=4, micro_batch_size=2, seq_len=32, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=4, decay_samples=400),
      'mesh': dict(data=1, pipeline=1, tensor=2),
      'checkpoint': dict(save_interval=2),
      'eval': dict(
        harness_tasks='t5x_tiny_mc,t5x_tiny_ppl',
        harness_interval=2,
        harness_limit=4,
        harness_include_path=TASKS,
        harness_batch_size=4,
      ),
    },
    {'eval': eval_section},
  )


def run(cfg, workdir):
  trainer = Trainer(cfg, workdir)
  train_cli.register_harness(trainer)
  trainer.run()
  return trainer


def harness_records(workdir):
  path = os.path.join(workdir, 'eval_metrics.jsonl')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [r for r in map(json.loads, f) if 'task' in r]


@pytest.fixture(scope='module')
def resumed_run(tmp_path_factory):
  """2 iterations, then the same run resumed to 4 from its checkpoint."""
  workdir = str(tmp_path_factory.mktemp('harness'))
  run(harness_config().replace(train={'steps': 2}), workdir)
  first = harness_records(workdir)
  run(harness_config(), workdir)
  return workdir, first


def test_the_tasks_run_at_their_interval_and_are_written_beside_the_validation_sets(resumed_run):
  workdir, first = resumed_run
  assert [r['iteration'] for r in first] == [2, 2]
  records = harness_records(workdir)
  assert [(r['iteration'], r['task']) for r in records] == [
    (2, 't5x_tiny_mc'),
    (2, 't5x_tiny_ppl'),
    (4, 't5x_tiny_mc'),
    (4, 't5x_tiny_ppl'),
  ]
  for record in records:
    assert record['limit'] == 4
    if record['task'] == 't5x_tiny_mc':
      assert set(record['metrics']) == {'acc', 'acc_norm'}
      assert all(0.0 <= v <= 1.0 for v in record['metrics'].values())
    else:
      assert set(record['metrics']) == {'word_perplexity', 'byte_perplexity', 'bits_per_byte'}
  # Iteration 4's params are not iteration 2's.
  assert records[3]['metrics'] != records[1]['metrics']
  metrics = read_metrics(workdir)
  assert records[-1]['consumed_samples'] == metrics[-1]['consumed_samples']
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert ' harness t5x_tiny_mc at iteration 2 | acc: ' in log
  assert ' harness t5x_tiny_mc at iteration 4 | acc: ' in log


def test_the_live_params_score_as_their_checkpoint_does(resumed_run):
  """The params the hook evaluates at the last iteration are the run's: the harness backend over
  the saved checkpoint scores the same documents the same (perplexities to fp32 precision)."""
  from t5x_like.inference.harness_lm import T5xLikeLM

  workdir, _ = resumed_run
  import lm_eval
  from lm_eval.tasks import TaskManager

  model = T5xLikeLM(os.path.join(workdir, 'checkpoints'), tensor=2, batch_size=4)
  results = lm_eval.simple_evaluate(
    model=model,
    tasks=['t5x_tiny_mc', 't5x_tiny_ppl'],
    limit=4,
    task_manager=TaskManager(include_path=TASKS),
    log_samples=False,
    bootstrap_iters=0,
  )
  mc, ppl = (results['results'][task] for task in ('t5x_tiny_mc', 't5x_tiny_ppl'))
  live = {r['task']: r['metrics'] for r in harness_records(workdir)[-2:]}
  assert live['t5x_tiny_mc'] == pytest.approx(
    {'acc': mc['acc,none'], 'acc_norm': mc['acc_norm,none']}
  )
  assert live['t5x_tiny_ppl'] == pytest.approx(
    {name: ppl[f'{name},none'] for name in live['t5x_tiny_ppl']}, rel=1e-5
  )


def test_an_unknown_task_is_refused_before_the_run_starts(tmp_path):
  workdir = str(tmp_path / 'run')
  trainer = Trainer(harness_config(harness_tasks='t5x_tiny_mc,no_such_task'), workdir)
  with pytest.raises(ConfigError, match=r"no task named 'no_such_task' in the harness or in "):
    train_cli.register_harness(trainer)
  assert not os.path.exists(workdir)  # the lock released, nothing written


def test_a_task_that_fails_is_reported_and_the_run_goes_on(tmp_path):
  """A task whose data file is gone fails when it is loaded, at the evaluation: one log line
  (and a 'harness_failed' alert), the other task still runs, and the run trains to its end."""
  tasks = tmp_path / 'tasks'
  shutil.copytree(TASKS, tasks)
  os.remove(tasks / 'mc_test.jsonl')
  workdir = str(tmp_path / 'run')
  cfg = harness_config(harness_include_path=str(tasks)).replace(
    train={'steps': 2}, checkpoint={'save_interval': 0}
  )
  trainer = run(cfg, workdir)
  assert trainer.stop_reason is None
  assert [r['iteration'] for r in read_metrics(workdir)] == [1, 2]
  assert [(r['iteration'], r['task']) for r in harness_records(workdir)] == [(2, 't5x_tiny_ppl')]
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    failures = [line for line in f if line.startswith('> harness: the task t5x_tiny_mc failed')]
  assert len(failures) == 1, failures
  assert 'at iteration 2: ' in failures[0] and 'mc_test.jsonl' in failures[0]
