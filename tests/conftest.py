"""Shared test setup: 8 virtual CPU devices (before JAX starts) and small shared configs."""

import json
import os
import sys

# The suite's programs are small and compiled once or twice each: compiling is most of its time
# (2 cores). The tests, and the processes they start, which inherit the variable, compile them
# with the cheapest code generation XLA's CPU backend has; it changes how fast XLA's kernels run,
# not what they compute (HLO, fusion and floating-point semantics are XLA's, before code
# generation): no LLVM optimisation (38% less time for the pipeline parity tests), none of its
# expensive passes, and the older loop emitters instead of the MLIR fusion emitters (14% less
# for the whole suite, 2026-11-28). The older emitters expand a scatter into a while loop of one
# trip per index (`program_loops` leaves those out) and name their kernels without the op's
# source, which the GPU suite's profile reads, so its smoke test runs with the fusion emitters.
# The benchmark script's test runs without these flags: it measures XLA as users run it.
FUSION_EMITTERS_OFF = '--xla_cpu_use_fusion_emitters=false'
TEST_XLA_FLAGS = ' '.join(
  (
    '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true',
    FUSION_EMITTERS_OFF,
  )
)
# The GPU suite (JAX_PLATFORMS=cuda,cpu; docs/tests.md) compiles kernels as users run them.
if not os.environ.get('JAX_PLATFORMS', '').startswith(('cuda', 'gpu')):
  os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {TEST_XLA_FLAGS}'.strip()
  # Elsewhere the CPU: the test extras' CUDA plugin (for compiling for GPUs without one) would
  # otherwise try to start a GPU in every process and print why it cannot.
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# One persistent compilation cache for the session: the controller makes it before its workers
# start, and they and every process they start inherit it, so that a program compiled again (the
# same tiny run in another test file, a restarted run, another test's reference) is loaded.
SESSION_CACHE_CREATED = ''
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  import tempfile

  SESSION_CACHE_CREATED = tempfile.mkdtemp(prefix='t5x_like_tests_jax_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = SESSION_CACHE_CREATED
  os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
  os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

import jax  # noqa: E402

# Must happen before any backend starts, so that (2,2,2)-style meshes run on one CPU.
jax.config.update('jax_num_cpu_devices', 8)

from t5x_like.config import Config  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_with(base: dict, sections: dict) -> Config:
  """A Config from `base` sections, each updated by the same-named dict in `sections`."""
  merged = {name: dict(values) for name, values in base.items()}
  for name, values in sections.items():
    merged.setdefault(name, {}).update(values)
  return Config.from_dict(merged)


def small_config(**sections) -> Config:
  """A BLOOM small enough to compile in seconds; heads and vocab divisible by 8-way tensor."""
  return config_with(
    {
      'model': dict(
        architecture='bloom',
        num_layers=2,
        hidden_size=64,
        num_heads=8,
        vocab_size=1000,
        init_std=0.02,
        dtype='float32',
      ),
      'train': dict(steps=3, global_batch_size=8, micro_batch_size=1, seq_len=16, seed=7),
      'optimizer': dict(lr=1e-3, min_lr=1e-4, warmup_samples=8, decay_samples=800),
      'mesh': dict(data=1, pipeline=1, tensor=1),
    },
    sections,
  )


def run_steps(cfg, num_steps=4, padding_microbatches=0, tokens=None):
  """Losses, grad norms and final params of the real jitted train step, `num_steps` times on one
  repeated random batch (or `tokens`, [global batch, seq + 1]); what every parallel or kernel
  path is compared on. `padding_microbatches`: that many micro-batches of padding only after
  the batch's (what train.rampup_microbatch_multiple adds)."""
  import jax.numpy as jnp
  import numpy as np

  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout
  from t5x_like.training import schedule
  from t5x_like.training import step as step_lib

  m = cfg.mesh
  mesh = partitioning.mesh_of(m)
  layout = make_layout(cfg, mesh)
  step = step_lib.jit_train_step(cfg, layout)
  state = layout.init(cfg.train.seed)
  rows = cfg.train.micro_batch_size * m.data
  if tokens is None:
    tokens = np.random.default_rng(0).integers(
      0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1)
    )
  tokens = np.asarray(tokens).astype(np.int32)
  batch = tokens.reshape(cfg.num_microbatches, rows, -1)
  padding = np.full((padding_microbatches,) + batch.shape[1:], -1, np.int32)  # losses.PAD_ID
  batch = jax.device_put(np.concatenate([batch, padding]), step_lib.batch_sharding(layout))
  losses, norms = [], []
  for i in range(num_steps):
    lr = schedule.learning_rate(cfg.optimizer, i * cfg.train.global_batch_size)
    state, stats = step(state, batch, jnp.float32(lr), jnp.int32(i))
    losses.append(float(stats['lm_loss']))
    norms.append(float(stats['grad_norm']))
  return np.array(losses), np.array(norms), jax.device_get(state.params)


def assert_same_training(run, reference, cfg, loose=False):
  """`run` (run_steps of `cfg`, on any mesh) trained as `reference` (run_steps on one device):
  the same losses, gradient norms and final params within fp32 tolerance (`loose`: a fused
  kernel's own summation order)."""
  import numpy as np

  from t5x_like.parallel import pipeline

  losses, norms, params = run
  ref_losses, ref_norms, ref_params = reference
  if cfg.mesh.pipeline > 1:
    params = pipeline.to_canonical(pipeline.placement_for(cfg), params)
  assert losses[-1] < losses[0]  # it trains
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
  # The fused kernel's own summation order: test_model_integration's tolerances.
  np.testing.assert_allclose(norms, ref_norms, rtol=1e-4 if loose else 2e-5)
  atol = 1e-4 if loose else 2e-5
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol), params, ref_params
  )


def program_loops(hlo_text: str) -> list[tuple[str, int]]:
  """(op name, trip count) of each while loop with a known trip count in a compiled CPU
  program's text: the program's own (scans, unrolled or not), not those XLA's CPU backend makes
  of a scatter under the tests' flags (one trip per index; `TEST_XLA_FLAGS`)."""
  import re

  found = re.findall(r' while\(.*op_name="([^"]*)".*"known_trip_count":\{"n":"(\d+)"', hlo_text)
  return [(name, int(trips)) for name, trips in found if not name.endswith('/scatter-add')]


def assert_draws_its_own_dropout_masks(losses, reference, dropout: float):
  """`losses`, of ranks or copies given the same rows as one rank (or copy) given them once
  (`reference`): with dropout each draws its own masks, so the first loss differs from the
  reference's, by a dropout's share at most; without dropout the runs are the same."""
  import numpy as np

  if dropout:
    assert abs(losses[0] / reference[0] - 1) > 1e-4, (losses, reference)
    assert abs(losses[0] / reference[0] - 1) < 0.05
  else:
    np.testing.assert_allclose(losses, reference, rtol=2e-6)


def users_xla_flags() -> str:
  """XLA_FLAGS without the tests' cheap code generation (TEST_XLA_FLAGS): for a process that
  measures XLA as users run it, or runs its programs long enough that the optimisation pays for
  its longer compile (docs/tests.md)."""
  return os.environ['XLA_FLAGS'].replace(TEST_XLA_FLAGS, '').strip()


def free_port() -> int:
  """A TCP port nobody listens on now: the coordinator of a multi-process test."""
  import socket

  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def run_cli(args, cwd=REPO, timeout=600, env=None):
  """Runs a `python -m ...` command of this package in a fresh process."""
  import subprocess

  full_env = dict(os.environ)
  full_env.update(env or {})
  return subprocess.run(
    [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
  )


def random_bloom(tmp_path, n_head, vocab, hidden=48, layers=2, seed=0):
  """A random BloomForCausalLM saved with save_pretrained (safetensors): (model, its directory)."""
  import torch
  import transformers

  torch.manual_seed(seed)
  cfg = transformers.BloomConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    n_layer=layers,
    n_head=n_head,
    hidden_dropout=0.0,
    attention_dropout=0.0,
  )
  model = transformers.BloomForCausalLM(cfg).eval()
  with torch.no_grad():  # Non-trivial LayerNorms and biases, so a dropped one shows.
    for name, p in model.named_parameters():
      if 'bias' in name or 'layernorm' in name or 'ln_f' in name:
        p.add_(0.1 * torch.randn_like(p))
  hf_dir = str(tmp_path / f'hf_{n_head}_{vocab}')
  model.save_pretrained(hf_dir, safe_serialization=True)
  return model, hf_dir


_READ_EVENTS = r"""
import json, os, sys
os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'
import tensorflow as tf
tf.config.set_visible_devices([], 'GPU')
out = []
for directory in sys.argv[1:]:
  kinds = {'scalars': {}, 'texts': {}}
  for name in sorted(os.listdir(directory)):
    if os.path.isdir(os.path.join(directory, name)):  # another TensorBoard run
      continue
    for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
      if event.HasField('session_log') and event.session_log.status == 1:  # START: purge
        kinds = {kind: {tag: [p for p in points if p[0] < event.step]
                        for tag, points in tags.items()} for kind, tags in kinds.items()}
      for value in event.summary.value:
        if not value.HasField('tensor'):  # a TF1-style simple_value
          kinds['scalars'].setdefault(value.tag, []).append((event.step, value.simple_value))
          continue
        array = tf.make_ndarray(value.tensor)  # tf.summary's scalars and texts (TF2)
        kind, point = (('texts', array.item().decode()) if array.dtype == object else
                       ('scalars', float(array)))
        kinds[kind].setdefault(value.tag, []).append((event.step, point))
  out.append(kinds)
print(json.dumps(out))
"""


def read_tensorboard(*directories, kind='scalars'):
  """{tag: [(step, value)]} per directory (its own event files: one TensorBoard run), read by
  TensorFlow's own event reader (which checks every frame's CRC) with TensorBoard's rule for a
  SessionLog START: earlier events from its step on are dropped. `kind`: 'scalars' (floats),
  'texts' (strings) or 'all' ({'scalars': ..., 'texts': ...}). In a subprocess of its own: a
  fresh reader, not the writer's TensorFlow."""
  r = run_cli(['-c', _READ_EVENTS, *directories], timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  read = [
    {
      name: {tag: [tuple(p) for p in points] for tag, points in tags.items()}
      for name, tags in kinds.items()
    }
    for kinds in json.loads(r.stdout.strip().splitlines()[-1])
  ]
  return read if kind == 'all' else [kinds[kind] for kinds in read]


# runtime.alert_command for tests: one line per alert in WORKDIR/alerts.txt
# (t5x_like/training/alerts.py).
ALERT_RECORD = (
  'echo "$T5X_LIKE_EVENT|$T5X_LIKE_ITERATION|$T5X_LIKE_PROCESS|$T5X_LIKE_MESSAGE" '
  '>> "$T5X_LIKE_WORKDIR/alerts.txt"'
)


def read_alerts(workdir):
  """[event, iteration, process, message] per alert the command recorded, in order."""
  path = os.path.join(workdir, 'alerts.txt')
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [line.rstrip('\n').split('|', 3) for line in f]


def pytest_unconfigure(config):
  if SESSION_CACHE_CREATED and not os.environ.get('PYTEST_XDIST_WORKER'):
    import shutil

    shutil.rmtree(SESSION_CACHE_CREATED, ignore_errors=True)
