"""What a run shows about itself besides its metrics: runtime.profile_steps' JAX profiler trace of
exactly those iterations and runtime.profile_every_mins's periodic ones (t5x_like/training/
profiling.py, read back from the trace files for their step markers), and the start-up parameter
table (startup.parameter_table)."""

import glob
import gzip
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import config_with

from t5x_like.config import ConfigError
from t5x_like.training import profiling
from t5x_like.training.trainer import Trainer


@pytest.fixture(scope='module')
def profiled_run(tmp_path_factory):
  """A tiny run of 5 iterations with runtime.profile_steps='2-3' and a periodic trace of 3
  iterations each time a microsecond passed (after every iteration, but never inside a trace):
  (workdir, trainer, log)."""
  cfg = config_with(
    {
      'model': dict(num_layers=1, hidden_size=32, num_heads=2, vocab_size=8192),
      'train': dict(steps=5, global_batch_size=2, micro_batch_size=2, seq_len=16),
      'optimizer': dict(warmup_samples=2, decay_samples=100),
      'runtime': dict(profile_steps='2-3', profile_every_mins=1e-8, profile_length=3),
    },
    {},
  )
  workdir = str(tmp_path_factory.mktemp('profiled'))
  trainer = Trainer(cfg, workdir)
  trainer.run()
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    return workdir, trainer, f.read()


def captured_events(log_dir):
  """For each capture under log_dir/plugins/profile/, in the order they were written: {trace
  file name: its events}."""
  captures = sorted(glob.glob(os.path.join(log_dir, 'plugins', 'profile', '*')))
  out = []
  for capture in captures:
    files = {}
    for path in glob.glob(os.path.join(capture, '*.json.gz')):
      with gzip.open(path) as f:
        trace = json.load(f)
      files[os.path.basename(path).split('.')[-3]] = (
        trace['traceEvents'] if isinstance(trace, dict) else trace
      )
    assert glob.glob(os.path.join(capture, '*.xplane.pb'))  # TensorBoard's Profile tab
    out.append(files)
  return out


def captured_steps(log_dir):
  """For each capture (captured_events): {trace file name: sorted step numbers of its 'train'
  step markers}."""
  return [
    {
      name: sorted(int(e['args']['step_num']) for e in events if e.get('name') == 'train')
      for name, events in files.items()
    }
    for files in captured_events(log_dir)
  ]


def traced_steps(log_dir):
  """captured_steps of the one capture under log_dir."""
  (steps,) = captured_steps(log_dir)
  return steps


def run_iterations(profiler, first, last, hooks=False):
  """Iterations first..last bracketed by `profiler`; with `hooks`, its periodic hook after each."""
  step = jax.jit(lambda x: x @ x)
  x = jnp.ones((8, 8))
  for iteration in range(first, last + 1):
    profiler.before_iteration(iteration)
    step(x).block_until_ready()
    profiler.after_iteration(iteration)
    if hooks:
      profiler.periodic_hook(types.SimpleNamespace(iteration=iteration))


def test_a_run_traces_exactly_its_profile_steps_then_the_periodic_ones(profiled_run):
  workdir, _, log = profiled_run
  log_dir = os.path.join(workdir, 'tensorboard')
  # The periodic trace due after iteration 2 was not started inside the range's trace; the one
  # due after 3 traced 4-5, in a directory of its own, and ended with the loop: the final
  # save's work (Orbax's) is not in it.
  assert captured_steps(log_dir) == [
    {'trace': [2, 3], 'perfetto_trace': [2, 3]},
    {'trace': [4, 5], 'perfetto_trace': [4, 5]},
  ]
  last = captured_events(log_dir)[1]['perfetto_trace']
  names = {str(e.get('name', '')) for e in last}
  assert not [n for n in names if 'final_hook' in n or 'async_checkpointer' in n]
  assert [n for n in names if 'iteration_hook' in n]  # the hooks between its iterations are
  assert f'> profile: iterations 2-3 traced to {log_dir}/plugins/profile/' in log
  assert f'> profile: iterations 4-5 traced to {log_dir}/plugins/profile/' in log


class FakeClock:
  """Seconds that pass only when the test says so."""

  def __init__(self, step_s):
    self.now, self.step_s = 0.0, step_s

  def __call__(self):
    self.now += self.step_s
    return self.now


def test_periodic_traces_come_every_so_many_minutes_and_leave_the_range_alone(tmp_path):
  # 25 s an iteration, a trace of 2 iterations once a minute passed: the timer starts at the
  # first iteration (25 s) and fires after iterations 4 (100 s), 7 and 10.
  periodic = profiling.Profiler(
    None, str(tmp_path / 'periodic'), 0, every_mins=1, length=2, clock=FakeClock(25.0)
  )
  run_iterations(periodic, 1, 12, hooks=True)
  periodic.close()
  assert periodic.traces == [(5, 6), (8, 9), (11, 12)]
  # Each in a directory of its own, though they ended within a second of each other.
  assert [s['trace'] for s in captured_steps(str(tmp_path / 'periodic'))] == [
    [5, 6],
    [8, 9],
    [11, 12],
  ]
  # The range 3-5 is traced whole; the periodic trace due after 4 is dropped, not started after
  # it: the timer fires again after 7 (75 s after 4).
  both = profiling.Profiler(
    (3, 5), str(tmp_path / 'both'), 0, every_mins=1, length=2, clock=FakeClock(25.0)
  )
  run_iterations(both, 1, 9, hooks=True)
  both.close()
  assert both.traces == [(3, 5), (8, 9)]


def test_the_start_up_log_has_the_parameter_table_with_its_total(profiled_run):
  _, trainer, log = profiled_run
  assert log.count('> parameters as the train step holds them (clu.parameter_overview):') == 1
  cfg = trainer.cfg
  total = cfg.model.num_params(cfg.mesh.tensor)
  assert total == sum(x.size for x in jax.tree.leaves(trainer.layout.logical.params))
  assert f'\nTotal: {total:,} -- {4 * total:,} bytes\n' in log  # float32
  # One row per parameter: name, shape, dtype, size, sharding (one device: split nowhere).
  assert re.search(
    r'\| word_embeddings +\| \(8192, 32\) +\| float32 \| 262,144 +\| '
    r'\(None, None\) +\|',
    log,
  )
  assert len(re.findall(r'^\| layers/', log, re.M)) == 12
  # Before the run compiles anything.
  assert log.index('Total: ') < log.index('> compiled the train step')


def test_a_resumed_run_traces_the_rest_of_the_range_and_a_stop_ends_it(tmp_path):
  profiler = profiling.Profiler((3, 6), str(tmp_path), 0, log=lambda line: None)
  run_iterations(profiler, 4, 5)  # resumed at 3; stopped after 5
  profiler.close()
  assert profiler.traces == [(4, 5)]
  assert traced_steps(str(tmp_path))['trace'] == [4, 5]


def test_no_range_traces_nothing_and_a_process_not_in_the_job_is_refused(tmp_path):
  quiet = profiling.Profiler(None, str(tmp_path), 0)
  run_iterations(quiet, 1, 2)
  quiet.close()
  assert quiet.traces == [] and not os.path.exists(tmp_path / 'plugins')
  with pytest.raises(
    ConfigError,
    match=r'runtime.profile_process=1 names no process of this '
    r'job \(0-0\)',
  ):
    profiling.Profiler((1, 2), str(tmp_path), 1)


def test_a_periodic_trace_due_before_skipped_iterations_traces_the_next_trained_ones(tmp_path):
  # data.skip_train_iteration_range: iterations 5 and 6 do not train (the hooks still run). The
  # trace due after 4 (100 s) covers 7-8; the timer fires again after 7, inside that trace (not
  # taken), and after 10.
  profiler = profiling.Profiler(
    None, str(tmp_path), 0, log=lambda line: None, every_mins=1, length=2, clock=FakeClock(25.0)
  )
  step = jax.jit(lambda x: x @ x)
  for iteration in range(1, 14):
    if iteration not in (5, 6):
      profiler.before_iteration(iteration)
      step(jnp.ones((8, 8))).block_until_ready()
      profiler.after_iteration(iteration)
    profiler.periodic_hook(types.SimpleNamespace(iteration=iteration))
  profiler.close()
  assert profiler.traces == [(7, 8), (11, 12)]


def test_a_trace_that_cannot_start_or_stop_is_logged_and_training_goes_on(tmp_path, monkeypatch):
  lines = []
  profiler = profiling.Profiler((2, 2), str(tmp_path), 0, log=lines.append)

  def busy(*args, **kwargs):
    raise RuntimeError('Profile has already been started')

  monkeypatch.setattr(jax.profiler, 'start_trace', busy)
  run_iterations(profiler, 1, 3)
  assert profiler.traces == [] and lines == [
    '> profile: iterations 2-2 not traced: the profiler did not start (RuntimeError: Profile '
    'has already been started); training goes on'
  ]
  monkeypatch.undo()
  # A trace that cannot be written: reported, and no later trace is tried in this job.
  lines.clear()
  periodic = profiling.Profiler(
    None, str(tmp_path), 0, log=lines.append, every_mins=1, length=1, clock=FakeClock(40.0)
  )
  monkeypatch.setattr(jax.profiler, 'stop_trace', busy)
  run_iterations(periodic, 1, 6, hooks=True)  # due after 3 (120 s) and 5
  monkeypatch.undo()
  jax.profiler.stop_trace()  # the session the failed stop left running
  assert periodic.traces == [] and len(lines) == 1, lines
  assert lines[0].startswith('> profile: the trace from iteration 4 could not be written')
  assert lines[0].endswith('no more traces in this job, training goes on')
