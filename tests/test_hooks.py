"""The training loop's hooks (t5x_like/training/hooks.py): each runs at its cadence, every N
iterations, at the start, at the end and on a stop; a hook can stop the run."""

import os

from conftest import small_config

from t5x_like.checkpointing import checkpoints
from t5x_like.parallel.train_state import Progress
from t5x_like.training import runtime
from t5x_like.training.hooks import Hook, Hooks, StepInfo
from t5x_like.training.trainer import Trainer


def test_hooks_run_every_n_iterations_and_at_start_end_and_stop():
  hooks, calls = Hooks(), []
  hooks.add_hook(lambda info: calls.append(('every 1', info.iteration)))
  hooks.add_hook(lambda info: calls.append(('every 3', info.iteration)), every=3)
  hooks.at_start(lambda info: calls.append(('start', info.iteration)))
  hooks.at_end(lambda info: calls.append(('end', info.iteration)))
  hooks.on_stop(lambda info: calls.append(('stop', info.stop_reason)))
  hooks.run_start(StepInfo(Progress(iteration=0)))
  for n in range(1, 7):
    hooks.run_iteration(StepInfo(Progress(iteration=n)))
  hooks.run_end(StepInfo(Progress(iteration=6)))
  assert calls == [
    ('start', 0),
    ('every 1', 1),
    ('every 1', 2),
    ('every 1', 3),
    ('every 3', 3),
    ('every 1', 4),
    ('every 1', 5),
    ('every 1', 6),
    ('every 3', 6),
    ('end', 6),
  ]
  # A hook that stops the run: the hooks after it do not see that iteration.
  calls.clear()
  hooks.iteration_hooks.insert(
    0, Hook(lambda info: info.request_stop(runtime.StopReason.SIGNAL, 'enough'), every=2)
  )
  info = StepInfo(Progress(iteration=2))
  hooks.run_iteration(info)
  assert calls == [] and info.stop_reason is runtime.StopReason.SIGNAL
  hooks.run_stop(info)
  assert calls == [('stop', runtime.StopReason.SIGNAL)]


def test_a_users_hooks_run_in_a_training_run_and_one_can_stop_it(tmp_path):
  """trainer.hooks.add_hook(fn, every=2) on a real run of 5 iterations that a hook stops after
  iteration 3: the every-2 hook sees iteration 2 only, the start and stop hooks run once, the
  end hooks not at all, and the stop saves the checkpoint of iteration 3 as any early stop."""
  cfg = small_config(
    model=dict(vocab_size=8192), train=dict(steps=5, global_batch_size=2, micro_batch_size=2)
  )
  trainer = Trainer(cfg, str(tmp_path))
  seen = []
  trainer.hooks.add_hook(
    lambda info: seen.append(('every 2', info.iteration, info.trained)), every=2
  )
  trainer.hooks.add_hook(lambda info: info.request_stop(runtime.StopReason.TIME_LIMIT), every=3)
  trainer.hooks.at_start(lambda info: seen.append(('start', info.iteration)))
  trainer.hooks.at_end(lambda info: seen.append(('end', info.iteration)))
  trainer.hooks.on_stop(lambda info: seen.append(('stop', info.iteration, info.stop_reason)))
  progress = trainer.run()
  assert progress.iteration == 3
  assert seen == [('start', 0), ('every 2', 2, True), ('stop', 3, runtime.StopReason.TIME_LIMIT)]
  assert trainer.stop_reason is runtime.StopReason.TIME_LIMIT
  assert checkpoints.available_steps(os.path.join(str(tmp_path), 'checkpoints')) == [3]
  with open(os.path.join(str(tmp_path), 'logs', 'main_log.txt')) as f:
    assert '> stopped: 3 iterations, 6 samples; exit code 3 (REQUEUE)' in f.read()
