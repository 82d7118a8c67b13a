"""The training loop on the embedded corpus: outputs, resume, init_from, skipped steps, bad input."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5x_like import checkpoints, optim, partitioning
from t5x_like.config import Config, ConfigError
from t5x_like.train_state import TrainState, make_layout
from t5x_like.trainer import Trainer, make_train_step, read_metrics

from conftest import config_with

REQUIRED = {'iteration', 'consumed_samples', 'consumed_tokens', 'learning_rate',
            'global_batch_size', 'lm_loss', 'grad_norm', 'step_time_s', 'samples_per_sec',
            'tokens_per_sec', 'tflops', 'mfu', 'skipped_iterations', 'nan_iterations'}
LOG_LINE = re.compile(
    r' iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| consumed tokens: +(\d+) \| '
    r'elapsed time per iteration \(s\): [\d.]+ \| learning rate: [\d.E+-]+ \| '
    r'global batch size: +(\d+) \| lm loss: [\d.E+-]+ \| grad norm: [\d.]+ \| num zeros: [\d.]+ \| '
    r'number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \| '
    r'samples per second: [\d.]+ \| TFLOPs: [\d.]+ \|')


def corpus_config(**sections) -> Config:
  """A small BLOOM on the embedded corpus (its tokenizer has 8192 tokens) on a 2x2 mesh."""
  return config_with({
      'model': dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=8192, init_std=0.02),
      'train': dict(steps=6, global_batch_size=8, micro_batch_size=2, seq_len=32, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=16, decay_samples=400),
      'mesh': dict(data=2, pipeline=1, tensor=2),
      'checkpoint': dict(save_interval=3),
  }, sections)


@pytest.fixture(scope='module')
def six_steps(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('six'))
  trainer = Trainer(corpus_config(), workdir)
  trainer.run()
  return workdir, trainer


def test_run_writes_log_lines_metrics_config_and_checkpoints(six_steps):
  workdir, trainer = six_steps
  records = read_metrics(workdir)
  assert [r['iteration'] for r in records] == [1, 2, 3, 4, 5, 6]
  for r in records:
    assert REQUIRED <= set(r)
    assert r['consumed_samples'] == 8 * r['iteration']
    assert r['consumed_tokens'] == 8 * 32 * r['iteration']
    assert r['tflops'] > 0 and 0 < r['mfu'] < 5 and r['step_time_s'] > 0
  # lr is a function of the samples consumed before the step (Megatron): 0, then warm-up.
  assert records[0]['learning_rate'] == 0.0
  assert records[1]['learning_rate'] == pytest.approx(1e-3)
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  lines = [m.groups() for m in LOG_LINE.finditer(log)]
  assert [int(g[0]) for g in lines] == [1, 2, 3, 4, 5, 6] and lines[0][1] == '6'
  assert 'matmul probe' in log  # the log says where the CPU MFU reference comes from
  with open(os.path.join(workdir, 'config.json')) as f:
    assert Config.from_dict(json.load(f)) == corpus_config()
  assert checkpoints.available_steps(os.path.join(workdir, 'checkpoints')) == [3, 6]


def test_resume_reproduces_the_uninterrupted_run(six_steps, tmp_path):
  workdir, _ = six_steps
  resumed = str(tmp_path / 'resumed')
  Trainer(corpus_config(train=dict(steps=3)), resumed).run()
  Trainer(corpus_config(), resumed).run()  # same workdir: resumes from iteration 3
  want = read_metrics(workdir)
  got = read_metrics(resumed)
  assert [r['iteration'] for r in got] == [1, 2, 3, 4, 5, 6]
  for a, b in zip(want, got):
    assert (a['lm_loss'], a['grad_norm'], a['learning_rate']) == (
        b['lm_loss'], b['grad_norm'], b['learning_rate'])
  with open(os.path.join(resumed, 'logs', 'main_log.txt')) as f:
    assert 'resumed from' in f.read()


def test_adam_step_count_and_progress_are_checkpointed(six_steps):
  workdir, trainer = six_steps
  root = os.path.join(workdir, 'checkpoints')
  state, progress = checkpoints.restore(root, trainer.layout, trainer.cfg, step=3)
  assert int(optim.adam_count(state.opt_state)) == 3
  assert (progress.iteration, progress.consumed_samples, progress.consumed_tokens) == (3, 24, 768)


def test_init_from_takes_weights_only(six_steps, tmp_path):
  workdir, trainer = six_steps
  root = os.path.join(workdir, 'checkpoints')
  cfg = corpus_config(checkpoint=dict(init_from=root), mesh=dict(data=4, tensor=1))
  fresh = Trainer(cfg, str(tmp_path / 'finetune'))
  state, progress = fresh.initial_state()
  assert progress.iteration == 0 and int(optim.adam_count(state.opt_state)) == 0
  final = jax.device_get(trainer.final_state.params)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), final)


def test_non_finite_step_is_skipped_and_counted():
  cfg = corpus_config(mesh=dict(data=1, tensor=1))
  mesh = partitioning.make_mesh(1, 1, 1)
  layout = make_layout(cfg, mesh)
  state = layout.init(0)
  bad = state.params.copy()
  bad['final_ln'] = {'scale': state.params['final_ln']['scale'].at[0].set(jnp.nan),
                     'bias': state.params['final_ln']['bias']}
  bad_state = TrainState(bad, state.opt_state)
  step = jax.jit(make_train_step(cfg, layout))
  tokens = jnp.ones((cfg.num_microbatches, 2, 33), jnp.int32)
  new_state, stats = step(bad_state, tokens, jnp.int32(100), jnp.int32(1))
  assert not bool(stats['finite']) and not bool(stats['loss_finite'])
  assert int(optim.adam_count(new_state.opt_state)) == 0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new_state.params, bad)
  # The Adam moments too (the update is skipped whole, not only the params).
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new_state.opt_state,
               state.opt_state)


def test_bad_inputs_fail_before_compiling_and_touch_nothing(six_steps, tmp_path):
  workdir, _ = six_steps
  config_before = open(os.path.join(workdir, 'config.json')).read()
  other_shape = corpus_config(model=dict(hidden_size=32))
  with pytest.raises(ConfigError, match='model.hidden_size: checkpoint 64 vs config 32'):
    Trainer(other_shape, workdir)  # resuming a workdir of another model
  assert open(os.path.join(workdir, 'config.json')).read() == config_before
  assert len(read_metrics(workdir)) == 6
  with pytest.raises(ConfigError, match='init_from.*different model shape'):
    Trainer(corpus_config(model=dict(num_layers=3),
                          checkpoint=dict(init_from=os.path.join(workdir, 'checkpoints'))),
            str(tmp_path / 'new'))
  assert not os.listdir(tmp_path / 'new')
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  with pytest.raises(ConfigError, match='not writable'):
    Trainer(corpus_config(), str(blocker / 'workdir'))
  with pytest.raises(ConfigError, match='needs 16 devices but only 8'):
    Trainer(corpus_config(mesh=dict(data=8, tensor=2), train=dict(micro_batch_size=1)),
            str(tmp_path / 'big'))


def test_restore_onto_a_mesh_with_another_vocab_padding(tmp_path):
  """Padding to 128 x tensor differs between tensor=2 (8448 rows) and tensor=1 (8320 rows)."""
  saved_cfg = corpus_config(model=dict(vocab_size=8300), mesh=dict(data=1, tensor=2),
                            train=dict(steps=1))
  trainer = Trainer(saved_cfg, str(tmp_path / 'run'))
  trainer.run()
  target_cfg = saved_cfg.replace(mesh={'data': 2, 'tensor': 1})
  assert (saved_cfg.padded_vocab_size, target_cfg.padded_vocab_size) == (8448, 8320)
  layout = make_layout(target_cfg, partitioning.make_mesh(2, 1, 1))
  state, progress = checkpoints.restore(str(tmp_path / 'run' / 'checkpoints'), layout, target_cfg)
  saved = jax.device_get(trainer.final_state)
  assert state.params['word_embeddings'].shape == (8320, 64)
  assert state.params['word_embeddings'].sharding == layout.shardings.params['word_embeddings']
  np.testing.assert_array_equal(state.params['word_embeddings'],
                                saved.params['word_embeddings'][:8320])
  np.testing.assert_array_equal(state.opt_state[0].mu['word_embeddings'],
                                saved.opt_state[0].mu['word_embeddings'][:8320])
  np.testing.assert_array_equal(state.params['layers']['mlp']['wi_kernel'],
                                saved.params['layers']['mlp']['wi_kernel'])
  assert progress.iteration == 1
