"""What a run shows about itself besides its metrics: runtime.profile_steps' JAX profiler trace of
exactly those iterations (t5x_like/training/profiling.py, read back from the trace files for its
step markers) and the start-up parameter table (startup.parameter_table)."""

import glob
import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from conftest import config_with

from t5x_like.config import ConfigError
from t5x_like.training import profiling
from t5x_like.training.trainer import Trainer


@pytest.fixture(scope='module')
def profiled_run(tmp_path_factory):
  """A tiny run with runtime.profile_steps='2-3': (workdir, trainer, its log)."""
  cfg = config_with(
    {
      'model': dict(num_layers=1, hidden_size=32, num_heads=2, vocab_size=8192),
      'train': dict(steps=4, global_batch_size=2, micro_batch_size=2, seq_len=16),
      'optimizer': dict(warmup_samples=2, decay_samples=100),
      'runtime': dict(profile_steps='2-3'),
    },
    {},
  )
  workdir = str(tmp_path_factory.mktemp('profiled'))
  trainer = Trainer(cfg, workdir)
  trainer.run()
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    return workdir, trainer, f.read()


def traced_steps(log_dir):
  """{trace file name: sorted step numbers of its 'train' step markers} of the one capture
  under log_dir/plugins/profile/."""
  captures = glob.glob(os.path.join(log_dir, 'plugins', 'profile', '*'))
  assert len(captures) == 1, captures
  out = {}
  for path in glob.glob(os.path.join(captures[0], '*.json.gz')):
    with gzip.open(path) as f:
      trace = json.load(f)
    events = trace['traceEvents'] if isinstance(trace, dict) else trace
    out[os.path.basename(path).split('.')[-3]] = sorted(
      int(e['args']['step_num']) for e in events if e.get('name') == 'train'
    )
  assert glob.glob(os.path.join(captures[0], '*.xplane.pb'))  # TensorBoard's Profile tab
  return out


def run_iterations(profiler, first, last):
  step = jax.jit(lambda x: x @ x)
  x = jnp.ones((8, 8))
  for iteration in range(first, last + 1):
    profiler.before_iteration(iteration)
    step(x).block_until_ready()
    profiler.after_iteration(iteration)


def test_a_run_traces_exactly_its_profile_steps(profiled_run):
  workdir, _, log = profiled_run
  log_dir = os.path.join(workdir, 'tensorboard')
  steps = traced_steps(log_dir)
  assert steps == {'trace': [2, 3], 'perfetto_trace': [2, 3]}, steps
  assert f'> profile: iterations 2-3 traced to {log_dir}/plugins/profile/' in log


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
  assert profiler.traced == (4, 5)
  assert traced_steps(str(tmp_path))['trace'] == [4, 5]


def test_no_range_traces_nothing_and_a_process_not_in_the_job_is_refused(tmp_path):
  quiet = profiling.Profiler(None, str(tmp_path), 0)
  run_iterations(quiet, 1, 2)
  quiet.close()
  assert quiet.traced is None and not os.path.exists(tmp_path / 'plugins')
  with pytest.raises(
    ConfigError,
    match=r'runtime.profile_process=1 names no process of this '
    r'job \(0-0\)',
  ):
    profiling.Profiler((1, 2), str(tmp_path), 1)
