"""Shared test setup: 8 virtual CPU devices (before JAX starts) and small shared configs."""

import os
import sys

import jax

# Must happen before any backend starts, so that (2,2,2)-style meshes run on one CPU.
jax.config.update('jax_num_cpu_devices', 8)

import pytest  # noqa: E402

from t5x_like.config import Config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**sections) -> Config:
  """A BLOOM small enough to compile in seconds; heads and vocab divisible by 8-way tensor."""
  base = {
      'model': dict(architecture='bloom', num_layers=2, hidden_size=64, num_heads=8,
                    vocab_size=1000, init_std=0.02, dtype='float32'),
      'train': dict(steps=3, global_batch_size=8, micro_batch_size=1, seq_len=16, seed=7),
      'optimizer': dict(lr=1e-3, min_lr=1e-4, warmup_samples=8, decay_samples=800),
      'mesh': dict(data=1, pipeline=1, tensor=1),
  }
  for name, values in sections.items():
    base.setdefault(name, {}).update(values)
  return Config.from_dict(base)


def run_cli(args, cwd=REPO, timeout=600, env=None):
  """Runs a `python -m ...` command of this package in a fresh process."""
  import subprocess
  full_env = dict(os.environ)
  full_env.update(env or {})
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=timeout, env=full_env)


@pytest.fixture(scope='session')
def repo_root():
  return REPO


@pytest.fixture(scope='module')
def persistent_compilation_cache(tmp_path_factory):
  """Within a module, programs compiled again (a new Trainer, a new layout's init) load the first
  compilation from a disk cache instead of recompiling: the same executable, seconds saved each."""
  from jax._src import compilation_cache
  keys = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs',
          'jax_persistent_cache_min_entry_size_bytes')
  before = {k: getattr(jax.config, k) for k in keys}
  jax.config.update(keys[0], str(tmp_path_factory.mktemp('jax_cache')))
  jax.config.update(keys[1], 0)
  jax.config.update(keys[2], 0)
  yield
  for k, v in before.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()
