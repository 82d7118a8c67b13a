"""The training loop on the embedded corpus: outputs, resume, init_from, skipped steps, bad
input."""

import functools
import json
import os
import re
import shutil
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ALERT_RECORD, config_with, read_alerts, read_tensorboard

from t5x_like.checkpointing import checkpoints, provenance
from t5x_like.cli import watch
from t5x_like.config import Config, ConfigError
from t5x_like.mesh import partitioning
from t5x_like.optim import adamw as optim
from t5x_like.parallel.train_state import TrainState, make_layout
from t5x_like.training import iteration as iteration_lib
from t5x_like.training import metrics, schedule, startup, watches
from t5x_like.training.step import make_train_step
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics

REQUIRED = {
  'iteration',
  'consumed_samples',
  'consumed_tokens',
  'learning_rate',
  'global_batch_size',
  'lm_loss',
  'grad_norm',
  'step_time_s',
  'samples_per_sec',
  'tokens_per_sec',
  'tflops',
  'mfu',
  'skipped_iterations',
  'nan_iterations',
}
LOG_LINE = re.compile(
  r' iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \| consumed tokens: +(\d+) \| '
  r'elapsed time per iteration \(s\): [\d.]+ \| learning rate: [\d.E+-]+ \| '
  r'global batch size: +(\d+) \| lm loss: [\d.E+-]+ \| grad norm: [\d.]+ \| num zeros: [\d.]+ \| '
  r'number of skipped iterations: +\d+ \| number of nan iterations: +\d+ \| '
  r'samples per second: [\d.]+ \| TFLOPs: [\d.]+ \|'
)


def corpus_config(**sections) -> Config:
  """A small BLOOM on the embedded corpus (its tokenizer has 8192 tokens) on a 2x2 mesh."""
  return config_with(
    {
      'model': dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=8192, init_std=0.02),
      'train': dict(steps=6, global_batch_size=8, micro_batch_size=2, seq_len=32, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=16, decay_samples=400),
      'mesh': dict(data=2, pipeline=1, tensor=2),
      'checkpoint': dict(save_interval=3),
      'runtime': dict(replica_check_interval=3),
    },
    sections,
  )


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
  # LayerNorms, biases and (ZeRO-1) params are replicated over `tensor` on this data=2 x tensor=2
  # mesh: their copies are compared at iterations 3 and 6.
  checks = re.findall(
    r'> replica check at iteration (\d+): every replicated array of the params '
    r"and optimizer state is identical on this process's 4 devices",
    log,
  )
  assert checks == ['3', '6']
  with open(os.path.join(workdir, 'config.json')) as f:
    assert Config.from_dict(json.load(f)) == corpus_config()
  assert checkpoints.available_steps(os.path.join(workdir, 'checkpoints')) == [3, 6]


def test_tensorboard_has_megatron_tags_and_a_resume_replaces_the_steps_after_its_checkpoint(
  six_steps, tmp_path
):
  workdir, _ = six_steps
  # A run that got to iteration 5 but whose checkpoint 5 is lost resumes from 3: TensorBoard
  # shows iterations 4 and 5 of the resumed run only, not both runs' points.
  resumed = str(tmp_path / 'resumed')
  Trainer(corpus_config(train=dict(steps=5)), resumed).run()
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '5'))
  Trainer(corpus_config(), resumed).run()
  runs = [
    os.path.join(d, 'tensorboard', run)
    for d in (workdir, resumed)
    for run, _ in metrics.TENSORBOARD_RUNS
  ]
  read = read_tensorboard(*runs, kind='all')
  scalars, vs_samples, vs_tokens, after_resume, resumed_vs_samples, resumed_vs_tokens = (
    kinds['scalars'] for kinds in read
  )
  # The resolved config as text in the iteration run, once per job at its first iteration.
  resumed_configs = read[3]['texts']['config']
  assert [step for step, _ in resumed_configs] == [1, 4]
  with open(os.path.join(resumed, 'config.json')) as f:
    assert json.loads(''.join(line[4:] for line in resumed_configs[1][1].splitlines(True))) == (
      json.load(f)
    )
  want = read_metrics(workdir)
  # Stored under exactly the tags written, one TensorBoard run per x axis.
  written = metrics.tensorboard_scalars(want[0])
  assert set(written) == {'', 'vs_samples', 'vs_tokens'}
  for run, stored in (('', scalars), ('vs_samples', vs_samples), ('vs_tokens', vs_tokens)):
    assert set(stored) == {tag for tag, _, _ in written[run]}
  assert scalars['lm-loss-training/lm_loss'] == [
    (r['iteration'], pytest.approx(r['lm_loss'])) for r in want
  ]
  assert scalars['consumed/samples'] == [(r['iteration'], r['consumed_samples']) for r in want]
  assert [v for _, v in scalars['learning-rate/learning-rate']] == [
    pytest.approx(r['learning_rate']) for r in want
  ]
  assert scalars['grad-norm/grad-norm'][-1] == (6, pytest.approx(want[-1]['grad_norm']))
  # Megatron's "lm loss vs samples" / "vs tokens": the same values against the data consumed.
  assert vs_samples['lm-loss-training/lm_loss_vs_samples'] == [
    (r['consumed_samples'], pytest.approx(r['lm_loss'])) for r in want
  ]
  assert vs_tokens['lm-loss-training/lm_loss_vs_tokens'] == [
    (r['consumed_tokens'], pytest.approx(r['lm_loss'])) for r in want
  ]
  assert vs_tokens['learning-rate/learning-rate_vs_tokens'] == [
    (r['consumed_tokens'], pytest.approx(r['learning_rate'])) for r in want
  ]
  # The resumed run's iterations 4 and 5 replace the first job's in every run, whatever its axis.
  got = read_metrics(resumed)
  assert after_resume['lm-loss-training/lm_loss'] == [
    (r['iteration'], pytest.approx(r['lm_loss'])) for r in got
  ]
  assert [step for step, _ in after_resume['lm-loss-training/lm_loss']] == [1, 2, 3, 4, 5, 6]
  assert resumed_vs_samples['lm-loss-training/lm_loss_vs_samples'] == [
    (r['consumed_samples'], pytest.approx(r['lm_loss'])) for r in got
  ]
  assert resumed_vs_tokens['lm-loss-training/lm_loss_vs_tokens'] == [
    (r['consumed_tokens'], pytest.approx(r['lm_loss'])) for r in got
  ]
  assert [s for s, _ in resumed_vs_tokens['grad-norm/grad-norm_vs_tokens']] == [
    r['consumed_tokens'] for r in got
  ]


def test_resume_reproduces_the_uninterrupted_run(six_steps, tmp_path, monkeypatch):
  workdir, _ = six_steps
  resumed = str(tmp_path / 'resumed')
  Trainer(corpus_config(train=dict(steps=3)), resumed).run()
  saved_software = checkpoints.read_meta(os.path.join(resumed, 'checkpoints'))['software']
  assert saved_software == provenance.software() and saved_software['jax'] == jax.__version__
  # The next job runs with another train.steps, and (pretend) an upgraded jax.
  upgraded = dict(saved_software, jax='9.9.9')
  monkeypatch.setattr(provenance, 'software', lambda: upgraded)
  Trainer(corpus_config(), resumed).run()  # same workdir: resumes from iteration 3
  want = read_metrics(workdir)
  got = read_metrics(resumed)
  assert [r['iteration'] for r in got] == [1, 2, 3, 4, 5, 6]
  for a, b in zip(want, got):
    assert (a['lm_loss'], a['grad_norm'], a['learning_rate']) == (
      b['lm_loss'],
      b['grad_norm'],
      b['learning_rate'],
    )
  with open(os.path.join(resumed, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert 'resumed from' in log
  # Everything that differs from the checkpoint's run is in the log, and only that.
  changes = re.findall(r'> (?:config|software) changed since the checkpoint: (.*)', log)
  assert changes == [
    'train.steps: checkpoint 3 -> now 6',
    f'jax: checkpoint {jax.__version__} -> now 9.9.9',
  ]
  assert '> software: python' in log and 'jax 9.9.9' in log
  assert checkpoints.read_meta(os.path.join(resumed, 'checkpoints'))['software'] == upgraded


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
  bad['final_ln'] = {
    'scale': state.params['final_ln']['scale'].at[0].set(jnp.nan),
    'bias': state.params['final_ln']['bias'],
  }
  bad_state = TrainState(bad, state.opt_state)
  step = jax.jit(make_train_step(cfg, layout))
  tokens = jnp.ones((cfg.num_microbatches, 2, 33), jnp.int32)
  new_state, stats = step(bad_state, tokens, jnp.float32(1e-3), jnp.int32(1))
  assert not bool(stats['finite']) and not bool(stats['loss_finite'])
  assert int(optim.adam_count(new_state.opt_state)) == 0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), new_state.params, bad)
  # The Adam moments too (the update is skipped whole, not only the params).
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(a, b), new_state.opt_state, state.opt_state
  )


class RecordedStep:
  """The compiled step, keeping a host copy of the state before and after each call (the step
  donates its input state, so the copy is taken first)."""

  def __init__(self, compiled):
    self.compiled, self.calls = compiled, []

  def __call__(self, state, *args):
    before = jax.device_get(state)
    new_state, stats = self.compiled(state, *args)
    self.calls.append((before, jax.device_get(new_state)))
    return new_state, stats


def poisoned_head_loss(head_loss, nan_loss_rows, inf_grad_rows):
  """losses.head_loss (the loss of one micro-batch from the last layer's output), except on
  micro-batches holding a row of `nan_loss_rows` (the loss is NaN) or of `inf_grad_rows` (the
  loss is the real, finite one; its gradient is the real one times inf), told by their labels
  (the rows' tokens after the first): what an overflow in the forward or only in the backward
  pass gives. A custom_vjp so that the backward pass alone is non-finite."""
  nan_rows, inf_rows = (jnp.asarray(rows)[:, 1:] for rows in (nan_loss_rows, inf_grad_rows))

  def holds(labels, rows):
    return jnp.any(jnp.all(labels[:, None, :] == rows[None, :, :], axis=-1))

  def patched(head_params, x, labels, weights, count, cfg, ctx):
    real = lambda head_params, x: head_loss(head_params, x, labels, weights, count, cfg, ctx)

    @jax.custom_vjp
    def loss(head_params, x):
      return jnp.where(holds(labels, nan_rows), jnp.nan, real(head_params, x))

    def forward(head_params, x):
      value, vjp = jax.vjp(real, head_params, x)
      return jnp.where(holds(labels, nan_rows), jnp.nan, value), (vjp, holds(labels, inf_rows))

    def backward(residuals, cotangent):
      vjp, inf_grad = residuals
      scale = jnp.where(inf_grad, jnp.inf, 1.0)
      return jax.tree.map(lambda g: g * scale.astype(g.dtype), vjp(cotangent))

    loss.defvjp(forward, backward)
    return loss(head_params, x)

  return patched


def test_a_run_skips_and_counts_non_finite_iterations(tmp_path, monkeypatch):
  """Through a real run: iteration 2's loss is NaN (skipped and a nan iteration), iteration 4's
  loss is finite but its gradient is not (skipped, not a nan iteration); neither changes the
  params or the Adam state (its step count included), and metrics.jsonl and the log carry the
  counters. The non-finite values come from `poisoned_head_loss` in place of the loss the step
  traces, chosen by the rows of those iterations' batches (as the data replay rebuilds them)."""
  from t5x_like.model import losses
  from t5x_like.training import replay

  cfg = corpus_config(
    train=dict(steps=5), mesh=dict(data=1, tensor=1), runtime=dict(replica_check_interval=0)
  )
  rows = {i: replay.iteration_batch(cfg, cfg.train.seed, i).rows for i in (2, 4)}
  monkeypatch.setattr(losses, 'head_loss', poisoned_head_loss(losses.head_loss, rows[2], rows[4]))
  workdir = str(tmp_path / 'run')
  trainer = Trainer(cfg, workdir)
  steps = []
  compile_step = trainer.steps.compile
  monkeypatch.setattr(
    trainer.steps,
    'compile',
    lambda shape: steps.append(RecordedStep(compile_step(shape))) or steps[-1],
  )
  trainer.run()
  records = read_metrics(workdir)
  assert [r['skipped_iterations'] for r in records] == [0, 1, 1, 2, 2]
  assert [r['nan_iterations'] for r in records] == [0, 1, 1, 1, 1]
  assert np.isnan(records[1]['lm_loss'])
  assert np.isfinite(records[3]['lm_loss']) and not np.isfinite(records[3]['grad_norm'])
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert 'number of skipped iterations:   2 | number of nan iterations:   1 |' in log
  (step,) = steps
  counts = [
    (int(optim.adam_count(before.opt_state)), int(optim.adam_count(after.opt_state)))
    for before, after in step.calls
  ]
  assert counts == [(0, 1), (1, 1), (1, 2), (2, 2), (2, 3)]
  for iteration, (before, after) in enumerate(step.calls, 1):
    same = jax.tree.leaves(jax.tree.map(np.array_equal, before, after))
    if iteration in (2, 4):  # skipped: params, moments and count exactly as they were
      assert all(same), iteration
    else:
      assert not all(same), iteration


@pytest.mark.parametrize(
  'how, code', [('kill switch', 'exit code 0 (FINISHED)'), ('SIGTERM', 'exit code 3 (REQUEUE)')]
)
def test_an_early_stop_sends_the_stopped_alert_with_its_iteration(how, code, tmp_path, monkeypatch):
  """The kill switch appears, or SIGTERM arrives, during iteration 2: the run stops after it
  and runtime.alert_command hears `stopped` with iteration 2 (not `finished`)."""
  workdir, kill_switch = str(tmp_path / 'run'), str(tmp_path / 'STOP')
  cfg = corpus_config(
    runtime=dict(kill_switch_path=kill_switch, alert_command=ALERT_RECORD, replica_check_interval=0)
  )
  trainer = Trainer(cfg, workdir)
  calls = []

  def stop_in_iteration_2(compiled, *args):
    calls.append(len(calls) + 1)
    if len(calls) == 2:
      if how == 'kill switch':
        open(kill_switch, 'w').close()
      else:
        os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler only sets a flag
    return compiled(*args)

  compile_step = trainer.steps.compile
  monkeypatch.setattr(
    trainer.steps,
    'compile',
    lambda shape: functools.partial(stop_in_iteration_2, compile_step(shape)),
  )
  progress = trainer.run()
  assert progress.iteration == 2 and len(calls) == 2
  assert read_alerts(workdir) == [
    ['stopped', '2', '0', f'> stopped: 2 iterations, 16 samples; {code}']
  ]


def test_bad_inputs_fail_before_compiling_and_touch_nothing(six_steps, tmp_path):
  workdir, _ = six_steps
  config_before = open(os.path.join(workdir, 'config.json')).read()
  other_shape = corpus_config(model=dict(hidden_size=32))
  with pytest.raises(ConfigError, match='model.hidden_size: checkpoint 64 vs config 32'):
    Trainer(other_shape, workdir)  # resuming a workdir of another model
  assert open(os.path.join(workdir, 'config.json')).read() == config_before
  assert len(read_metrics(workdir)) == 6
  with pytest.raises(ConfigError, match='init_from.*different model shape'):
    Trainer(
      corpus_config(
        model=dict(num_layers=3), checkpoint=dict(init_from=os.path.join(workdir, 'checkpoints'))
      ),
      str(tmp_path / 'new'),
    )
  assert not (tmp_path / 'new').exists() or not os.listdir(tmp_path / 'new')
  blocker = tmp_path / 'a_file'
  blocker.write_text('x')
  with pytest.raises(ConfigError, match='not writable'):
    Trainer(corpus_config(), str(blocker / 'workdir'))
  with pytest.raises(ConfigError, match='needs 16 devices but only 8'):
    Trainer(
      corpus_config(mesh=dict(data=8, tensor=2), train=dict(micro_batch_size=1)),
      str(tmp_path / 'big'),
    )


def test_restore_onto_a_mesh_with_another_vocab_padding(tmp_path):
  """Padding to 128 x tensor differs between tensor=2 (8448 rows) and tensor=1 (8320 rows)."""
  saved_cfg = corpus_config(
    model=dict(vocab_size=8300), mesh=dict(data=1, tensor=2), train=dict(steps=1)
  )
  trainer = Trainer(saved_cfg, str(tmp_path / 'run'))
  trainer.run()
  target_cfg = saved_cfg.replace(mesh={'data': 2, 'tensor': 1})
  assert (saved_cfg.padded_vocab_size, target_cfg.padded_vocab_size) == (8448, 8320)
  layout = make_layout(target_cfg, partitioning.make_mesh(2, 1, 1))
  state, progress = checkpoints.restore(str(tmp_path / 'run' / 'checkpoints'), layout, target_cfg)
  saved = jax.device_get(trainer.final_state)
  assert state.params['word_embeddings'].shape == (8320, 64)
  assert state.params['word_embeddings'].sharding == layout.shardings.params['word_embeddings']
  np.testing.assert_array_equal(
    state.params['word_embeddings'], saved.params['word_embeddings'][:8320]
  )
  np.testing.assert_array_equal(
    state.opt_state[0].mu['word_embeddings'], saved.opt_state[0].mu['word_embeddings'][:8320]
  )
  np.testing.assert_array_equal(
    state.params['layers']['mlp']['wi_kernel'], saved.params['layers']['mlp']['wi_kernel']
  )
  assert progress.iteration == 1


# ------------------------------------------------------------- Megatron data, evaluation, skips


@pytest.mark.parametrize('mesh', [(1, 1, 1), (2, 1, 2), (1, 2, 1)], ids=str)
def test_eval_step_is_the_train_steps_loss_on_every_mesh(mesh):
  """The evaluation step is the training loss without the update: equal to the train step's
  reported loss on one device, and to the one-device evaluation on data x tensor and on a
  pipeline (its forward-only schedule)."""
  from conftest import small_config

  from t5x_like.training.step import batch_sharding, make_eval_step

  cfg = small_config(
    mesh=dict(zip(('data', 'pipeline', 'tensor'), mesh)), model=dict(cross_entropy_impl='chunked')
  )
  tokens = np.random.default_rng(1).integers(0, 1000, (8, 17)).astype(np.int32)

  def evaluate(cfg):
    layout = make_layout(
      cfg, partitioning.make_mesh(*(cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor))
    )
    state = layout.init(cfg.train.seed)
    rows = cfg.train.micro_batch_size * cfg.mesh.data
    batch = jax.device_put(tokens.reshape(cfg.num_microbatches, rows, -1), batch_sharding(layout))
    return float(jax.jit(make_eval_step(cfg, layout))(state.params, batch)), layout, state, batch

  loss, layout, state, batch = evaluate(cfg)
  if mesh == (1, 1, 1):
    _, stats = jax.jit(make_train_step(cfg, layout))(state, batch, jnp.float32(0.0), jnp.int32(0))
    assert loss == pytest.approx(float(stats['lm_loss']), rel=1e-6)
  else:
    one_device = cfg.replace(mesh={'data': 1, 'pipeline': 1, 'tensor': 1})
    assert loss == pytest.approx(evaluate(one_device)[0], rel=2e-6)


def write_random_dataset(prefix, num_documents, seed, vocab=8192):
  """Documents of Zipf-distributed ids (learnable statistics, like text), each ending in EOD."""
  from t5x_like.data.indexed import IndexedDatasetWriter

  rng = np.random.default_rng(seed)
  with IndexedDatasetWriter(prefix, np.uint16) as writer:
    for _ in range(num_documents):
      ids = 2 + rng.zipf(1.2, rng.integers(20, 60)) % (vocab - 2)
      writer.add_document(list(ids) + [1])
  return prefix


@pytest.fixture(scope='module')
def megatron_data(tmp_path_factory):
  root = tmp_path_factory.mktemp('megatron_data')
  return {
    name: write_random_dataset(str(root / f'{name}_text_document'), n, seed)
    for name, n, seed in (('en', 150, 1), ('fr', 100, 2), ('held_out', 20, 3))
  }


def data_config(megatron_data, **sections):
  return corpus_config(
    **{
      'data': dict(
        train_path=f'0.6 {megatron_data["en"]} 0.4 {megatron_data["fr"]}',
        split='70,15,15',
        valid_path={'held_out': megatron_data['held_out']},
        skip_train_iteration_range=('2-3',),
      ),
      'eval': dict(interval=3, iters=2),
      **sections,
    }
  )


def test_megatron_data_evaluation_and_skipped_ranges(megatron_data, tmp_path):
  workdir = str(tmp_path / 'run')
  trainer = Trainer(data_config(megatron_data), workdir)
  trainer.run()
  records = read_metrics(workdir)
  # Iterations 2-3 consume their samples without training; the optimizer did not step.
  assert [r['iteration'] for r in records] == [1, 4, 5, 6]
  assert [r['consumed_samples'] for r in records] == [8, 32, 40, 48]
  assert [r['skipped_iterations'] for r in records] == [0, 2, 2, 2]
  assert int(optim.adam_count(trainer.final_state.opt_state)) == 4
  # The training batch of iteration 4 is samples 24..31 of the blend.
  np.testing.assert_array_equal(
    jax.device_get(trainer.global_batch(24, 8)).reshape(8, -1), trainer.source.rows(24, 32)
  )
  with open(os.path.join(workdir, 'eval_metrics.jsonl')) as f:
    evals = [json.loads(line) for line in f]
  assert [(e['iteration'], e['set']) for e in evals] == [
    (3, 'valid'),
    (3, 'held_out'),
    (6, 'valid'),
    (6, 'held_out'),
    (6, 'test'),
  ]
  for e in evals:
    assert e['samples'] == 16 and e['ppl'] == pytest.approx(np.exp(e['lm_loss']))
  # Training lowers the validation loss (random tokens: only their unigram statistics to learn).
  assert evals[2]['lm_loss'] < evals[0]['lm_loss']
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert 'data.skip_train_iteration_range: iterations 2-3' in log
  # The evaluation step is compiled before the first iteration, not at the first evaluation.
  assert log.index('> compiled the evaluation step') < log.index(' iteration        1/')
  assert log.count('> compiled the evaluation step') == 1
  assert re.search(
    r' valid loss at iteration 3 \| lm loss value: [\d.]+E\+00 \| '
    r'lm loss PPL: [\d.]+E\+0\d \|',
    log,
  )
  assert ' test loss at the end of training (iteration 6) |' in log
  assert f'> data: {megatron_data["en"]} (weight 0.6000): 150 documents' in log
  # How much of each dataset the whole run reads: 6 iterations x 8 samples, blended 0.6 / 0.4.
  drawn = trainer.data.train.blend.counts(48)
  assert sorted(drawn) == [19, 29]
  for name, count, source in zip(('en', 'fr'), drawn, trainer.data.train.sources):
    assert (
      f"> data: {megatron_data[name]}: {count} of the run's 48 training samples, "
      f'{count / source.num_samples:.3g} epoch(s) of its {source.num_samples}'
    ) in log
  scalars, vs_tokens = read_tensorboard(
    os.path.join(workdir, 'tensorboard'), os.path.join(workdir, 'tensorboard', 'vs_tokens')
  )
  assert scalars['lm-loss-validation/held_out_lm_loss'] == [
    (e['iteration'], pytest.approx(e['lm_loss'])) for e in evals if e['set'] == 'held_out'
  ]
  assert scalars['lm-loss-validation/test_lm_loss_PPL'] == [(6, pytest.approx(evals[-1]['ppl']))]
  # Against tokens: the skipped iterations 2-3 consumed theirs too (8 samples of 32 tokens each).
  assert [e['consumed_tokens'] for e in evals] == [3 * 8 * 32] * 2 + [6 * 8 * 32] * 3
  assert vs_tokens['lm-loss-validation/held_out_lm_loss_vs_tokens'] == [
    (e['consumed_tokens'], pytest.approx(e['lm_loss'])) for e in evals if e['set'] == 'held_out'
  ]
  event_files = os.listdir(os.path.join(workdir, 'tensorboard'))

  # A resumed run drops evaluation records written after its checkpoint, as it does metrics.
  with open(os.path.join(workdir, 'eval_metrics.jsonl'), 'a') as f:
    f.write(json.dumps({'iteration': 7, 'set': 'valid', 'lm_loss': 1.0}) + '\n')
  Trainer(
    data_config(megatron_data, train=dict(steps=7), runtime=dict(tensorboard_dir='')), workdir
  ).run()
  assert os.listdir(os.path.join(workdir, 'tensorboard')) == event_files  # '': none written
  with open(os.path.join(workdir, 'eval_metrics.jsonl')) as f:
    resumed = [json.loads(line) for line in f]
  assert [(e['iteration'], e['set']) for e in resumed] == [
    (3, 'valid'),
    (3, 'held_out'),
    (6, 'valid'),
    (6, 'held_out'),
    (6, 'test'),
    (7, 'valid'),
    (7, 'held_out'),
    (7, 'test'),
  ]
  assert resumed[-1]['lm_loss'] != 1.0


def test_bad_data_fails_before_compiling(megatron_data, tmp_path):
  from t5x_like.data.indexed import DataError

  with pytest.raises(ConfigError, match=r'missing_text_document\.idx not found'):
    missing = str(tmp_path / 'missing_text_document')
    Trainer(data_config(megatron_data, data=dict(train_path=missing)), str(tmp_path / 'a'))
  # Ids the model has no row for (a dataset tokenized for a larger vocabulary).
  big = write_random_dataset(str(tmp_path / 'big_vocab'), 30, 4, vocab=20000)
  trainer = Trainer(
    data_config(megatron_data, data=dict(train_path=big, valid_path={})), str(tmp_path / 'b')
  )
  with pytest.raises(DataError, match=r'training samples 0\.\.7 holds token id \d+, outside'):
    trainer.run()
  assert trainer.steps.programs == trainer.evaluator.compiled == {}
  assert not os.path.exists(str(tmp_path / 'b' / 'metrics.jsonl'))
  with pytest.raises(ConfigError, match='no validation set'):
    startup.check_config(data_config(megatron_data, data=dict(split='100,0,0', valid_path={})))


class SpikeAt:
  """Stands in for watches.SpikeWatch: a spike at one iteration (a real one is not reproducible
  in a few steps of a small model; the detection itself is tests/test_metrics.py's)."""

  def __init__(self, iteration):
    self.iteration = iteration

  def add(self, iteration, lm_loss, grad_norm):
    return '> spike at iteration 5: test' if iteration == self.iteration else None


class FakeClock:
  """Stands in for the `time` module of t5x_like.trainer: `perf_counter()` reads a clock that
  only the steps below advance, so each step lasts exactly what the test says, whatever the
  machine's speed."""

  def __init__(self):
    self.now = 1000.0

  def perf_counter(self):
    return self.now

  def __getattr__(self, name):
    return getattr(time, name)


class StepTakes:
  """The compiled step of a device on which each step takes `seconds` (on the fake clock)."""

  def __init__(self, compiled, clock, seconds):
    self.compiled, self.clock, self.seconds = compiled, clock, seconds

  def __call__(self, *args):
    self.clock.now += self.seconds
    return self.compiled(*args)


def test_the_next_job_keeps_a_spikes_checkpoint_and_the_step_time_baseline(tmp_path, monkeypatch):
  """What a job array's next job inherits through the checkpoint's meta: the checkpoint kept from
  before a loss spike, and the step-time baseline that finds a device slow from the job's start.
  Step times come from a fake clock: 0.05 s per step in the first job (steady: no slowdown is
  reported), 0.07 s in the next (40% slower, above the trainer's CPU threshold of 25%)."""
  # Baselines over 3 iterations after 1 (the trainer's watch takes 20 after 3); the trainer's
  # own threshold.
  watch_class = watches.ThroughputWatch
  monkeypatch.setattr(
    watches,
    'ThroughputWatch',
    lambda threshold: watch_class(window=3, threshold=threshold, warmup=1),
  )
  clock = FakeClock()
  monkeypatch.setattr(iteration_lib, 'time', clock)
  workdir = str(tmp_path / 'run')
  cfg = corpus_config(
    train=dict(steps=8),
    checkpoint=dict(save_interval=2, max_to_keep=1),
    runtime=dict(replica_check_interval=0, alert_command=ALERT_RECORD),
  )
  spike_class = watches.SpikeWatch
  monkeypatch.setattr(watches, 'SpikeWatch', lambda *args: SpikeAt(5))
  first = Trainer(cfg, workdir)
  monkeypatch.setattr(watches, 'SpikeWatch', spike_class)  # the resumed job watches for real
  compile_first = first.steps.compile
  monkeypatch.setattr(
    first.steps, 'compile', lambda shape: StepTakes(compile_first(shape), clock, 0.05)
  )
  first.run()
  # Outside the log too: runtime.alert_command heard of the spike and of the end.
  alerted = {a[0]: a for a in read_alerts(workdir)}
  assert sorted(alerted) == ['finished', 'spike'] and alerted['spike'][1] == '5'
  assert alerted['finished'][1:] == [
    '8',
    '0',
    '> done: 8 iterations, 64 samples; exit code 0 (FINISHED)',
  ]
  # And `python -m t5x_like.watch` (cron) reads the end from the log.
  assert watch.status(workdir, stale_mins=30)['state'] == 'finished'
  root = os.path.join(workdir, 'checkpoints')
  assert checkpoints.available_steps(root) == [4, 8]  # max_to_keep=1, and 4 from before 5
  meta = checkpoints.read_meta(root)
  assert meta['kept_steps'] == [4]
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert (
    '> spike at iteration 5: test. checkpoint 4 (the last before it) is kept past '
    f'checkpoint.max_to_keep; its batch: python -m t5x_like.data batch {workdir} '
    '--iteration 5'
  ) in log
  (baseline,) = meta['throughput']['baselines']
  assert (
    baseline['global_batch_size'],
    baseline['seq_len'],
    baseline['first'],
    baseline['last'],
  ) == (8, 0, 2, 4)
  assert baseline['step_s'] == pytest.approx(0.05)
  assert meta['throughput']['setup'] == first.watches.throughput_setup

  # The next job lands on a slow device: every step takes 40% longer.
  resumed = Trainer(
    corpus_config(
      train=dict(steps=12),
      checkpoint=dict(save_interval=2, max_to_keep=1),
      runtime=dict(replica_check_interval=0, alert_command=ALERT_RECORD),
    ),
    workdir,
  )
  compile_step = resumed.steps.compile
  monkeypatch.setattr(
    resumed.steps, 'compile', lambda shape: StepTakes(compile_step(shape), clock, 0.07)
  )
  resumed.run()
  assert checkpoints.available_steps(root) == [4, 12]  # 4 is still kept (the meta's list)
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert "> throughput: step times are compared with the earlier job's baseline" in log
  # Its own first window (iterations 10-12) is already slow; against the earlier job's it shows.
  assert (
    '> throughput: the median step time of iterations 10-12 is 0.07 s, 40.0% above an '
    "earlier job's 0.05 s (iterations 2-4, global batch size 8)"
  ) in log
  assert log.count('> throughput: the median step time') == 1  # not in the steady first job
  # (Two commands sent within a second may finish in either order.)
  assert sorted(a[:2] for a in read_alerts(workdir)[2:]) == [['finished', '12'], ['slowdown', '12']]
  # On another setup (here: other devices) the earlier baseline does not apply.
  other = dict(
    meta['throughput'], setup=dict(meta['throughput']['setup'], device_kind='a slower kind')
  )
  fresh_watch = watch_class()
  note = watches.seed_throughput(fresh_watch, other, resumed.watches.throughput_setup)
  assert fresh_watch.baselines() == []
  assert note.startswith("> throughput: the checkpoint's job ran on another setup")


def test_save_interval_mins_saves_when_the_minutes_passed_and_keeps_it_until_the_next_save(
  tmp_path, monkeypatch
):
  """checkpoint.save_interval_mins=1 beside save_interval=3, on a fake clock on which each step
  takes 30 s: a timed save once a minute passed since the last save of either kind (iterations
  2 and 5), the log saying why. A timed step is temporary: the newest checkpoint until the next
  save lands, then deleted, never pushing an interval step out of max_to_keep; a restart knows
  it from the checkpoint's meta, which lists only the timed saves still on disk. No timed save
  at the last iteration: the end's save follows."""
  clock = FakeClock()
  workdir = str(tmp_path / 'run')
  root = os.path.join(workdir, 'checkpoints')
  cfg = corpus_config(
    train=dict(steps=7),
    checkpoint=dict(save_interval=3, save_interval_mins=1, max_to_keep=5),
    runtime=dict(replica_check_interval=0),
  )
  trainer = Trainer(cfg, workdir)
  trainer.checkpoints.save_timer.clock = clock.perf_counter
  compile_step = trainer.steps.compile
  monkeypatch.setattr(
    trainer.steps, 'compile', lambda shape: StepTakes(compile_step(shape), clock, 30.0)
  )
  on_disk = {}

  def after_the_saves(info):
    trainer.checkpoints.opened.wait()  # the save in flight, and the deletions it triggered
    on_disk[info.iteration] = checkpoints.available_steps(root)

  trainer.hooks.add_hook(after_the_saves)
  trainer.run()
  assert on_disk == {1: [], 2: [2], 3: [3], 4: [3], 5: [3, 5], 6: [3, 6], 7: [3, 6]}
  assert checkpoints.available_steps(root) == [3, 6, 7]
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    saves = re.findall(r'> checkpoint at iteration (\d+): (.*)', f.read())
  why = (
    '1.0 minutes since the last save (checkpoint.save_interval_mins=1); kept until the next save'
  )
  assert saves == [('2', why), ('5', why)]
  # Each meta lists the timed saves on disk when it was saved: 2 went when 3 landed.
  assert [checkpoints.read_meta(root, s)['temporary_steps'] for s in (3, 6, 7)] == [[2], [5], []]


def test_a_timed_save_that_a_job_ended_on_goes_after_the_next_jobs_first_save(
  tmp_path, monkeypatch
):
  """A job stopped (here by the kill switch) right after a timed save leaves it as its newest
  checkpoint, which the next job resumes from; its meta says it is temporary, so the next job's
  first save deletes it."""
  clock = FakeClock()
  workdir, kill_switch = str(tmp_path / 'run'), str(tmp_path / 'stop')
  root = os.path.join(workdir, 'checkpoints')
  cfg = corpus_config(
    train=dict(steps=6),
    checkpoint=dict(save_interval=3, save_interval_mins=1),
    runtime=dict(replica_check_interval=0, kill_switch_path=kill_switch),
  )
  first = Trainer(cfg, workdir)
  first.checkpoints.save_timer.clock = clock.perf_counter
  compile_step = first.steps.compile
  monkeypatch.setattr(
    first.steps, 'compile', lambda shape: StepTakes(compile_step(shape), clock, 30.0)
  )
  first.hooks.add_hook(lambda info: open(kill_switch, 'w').close(), every=2)
  first.run()
  assert checkpoints.available_steps(root) == [2]
  assert checkpoints.read_meta(root)['temporary_steps'] == [2]
  os.remove(kill_switch)
  Trainer(cfg, workdir).run()  # resumes from 2; saves 3 (the interval's), then 6 (the end's)
  assert checkpoints.available_steps(root) == [3, 6]
  assert [r['iteration'] for r in read_metrics(workdir)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize('others', [[0, 0], [0, 1]])
def test_save_interval_mins_is_one_decision_for_every_process(others, monkeypatch):
  """Each process's clock differs: a save is due everywhere when it is due on any process, or a
  process would wait in a save the others never join."""
  from jax.experimental import multihost_utils

  from t5x_like.training.run_checkpoints import SaveTimer

  now = [0.0]
  sent = []

  def allgather(x):
    sent.append(int(x))
    return np.asarray(others, np.int32)

  monkeypatch.setattr(multihost_utils, 'process_allgather', allgather)
  timer = SaveTimer(1, num_processes=2, clock=lambda: now[0])
  now[0] = 30.0
  assert timer.due() is bool(max(others)) and sent == [0]
  alone = SaveTimer(1, num_processes=1, clock=lambda: now[0])
  now[0] = 90.0
  assert alone.due() and not SaveTimer(0, num_processes=2).due() and sent == [0]


def test_replica_check_names_the_arrays_whose_copies_differ(tmp_path):
  trainer = Trainer(
    corpus_config(runtime=dict(replica_check_interval=3, alert_command=ALERT_RECORD)), str(tmp_path)
  )  # nothing trains
  trainer.writer.open()  # the log file, as when the run starts
  mesh = trainer.mesh
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  copies = [
    jax.device_put(np.full(4, 1.0 + (i == 2) * 1e-6, np.float32), d)
    for i, d in enumerate(mesh.devices.flat)
  ]
  drifted = jax.make_array_from_single_device_arrays((4,), replicated, copies)
  same = jax.device_put(np.ones(4, np.float32), replicated)
  assert trainer.replica_check.check({'final_ln': {'scale': drifted, 'bias': same}}, 7) == [
    "['final_ln']['scale']"
  ]
  with open(trainer.writer.log_path) as f:
    assert (
      "> replica check at iteration 7: the copies of ['final_ln']['scale'] differ across "
      'devices. Resume from the last checkpoint'
    ) in f.read()
  trainer.alerts.wait()
  assert [a[:2] for a in read_alerts(tmp_path)] == [['replica_mismatch', '7']]

  # An exception out of training (once it started) is sent as 'crashed' and still raised.
  def fail(stop):
    trainer.start(trainer.resumption.progress)
    raise OSError('disk full')

  trainer._train = fail
  with pytest.raises(OSError, match='disk full'):
    trainer.run()
  assert read_alerts(tmp_path)[1:] == [['crashed', '', '0', 'OSError: disk full']]


@pytest.fixture(scope='module')
def curriculum_run(tmp_path_factory):
  """tr8b's curriculum run in small: lengths 8, 16, 24 over iterations 1-3 (multiples of 8), the
  learning rate decaying by tokens, evaluated every 2 iterations; resumed half-way from a
  checkpoint."""
  cfg = corpus_config(
    train=dict(steps=2, seq_len=24),
    checkpoint=dict(save_interval=2),
    mesh=dict(data=2, tensor=1),
    curriculum=dict(min_seq_len=8, total_iterations=3),
    optimizer=dict(decay_tokens=2000),
    eval=dict(interval=2),
    runtime=dict(replica_check_interval=0),
  )
  workdir = str(tmp_path_factory.mktemp('curriculum') / 'cl')
  first = Trainer(cfg, workdir)
  first.run()
  Trainer(cfg.replace(train={'steps': 4}), workdir).run()  # resumes at iteration 2
  return cfg, workdir, first


def test_curriculum_truncates_samples_counts_tokens_and_decays_by_tokens(curriculum_run):
  from t5x_like.model import losses
  from t5x_like.training import replay

  cfg, workdir, first = curriculum_run
  records = read_metrics(workdir)
  lengths = [8, 16, 24, 24]  # iteration n: floor(8 + 16 n / 3), rounded down to 8
  assert [r['seq_len'] for r in records] == [r['curriculum_seq_len'] for r in records] == lengths
  tokens = np.cumsum([8 * n for n in lengths])
  assert [r['consumed_tokens'] for r in records] == tokens.tolist()
  assert [r['tokens_per_sec'] * r['step_time_s'] for r in records] == pytest.approx(
    [8 * n for n in lengths]
  )
  # Warm-up over 16 samples (2 iterations: 8 x 8 + 8 x 16 = 192 tokens), then the decay counts
  # the tokens consumed before each iteration from there to optimizer.decay_tokens.
  assert first.iterations.warmup_end_tokens == 192
  before = [0, *tokens[:-1]]
  assert [r['learning_rate'] for r in records] == pytest.approx(
    [schedule.learning_rate(cfg.optimizer, 8 * i, int(before[i]), 192) for i in range(4)]
  )
  assert records[2]['learning_rate'] == pytest.approx(2e-3)  # the warm-up's end: the peak
  assert records[3]['learning_rate'] < records[2]['learning_rate']
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert re.findall(r'curriculum seqlen: +(\d+) \|', log) == [str(n) for n in lengths]
  assert (
    '> curriculum: sequence length 8 -> 24 in multiples of 8 over iterations 1-3 '
    '(linear): 3 lengths'
  ) in log
  # One compiled step per length: 2 in the first job, 1 after the resume.
  assert re.findall(r'compiled the train step for 2 micro-batch\(es\) of 4x(\d+) tokens', log) == [
    '9',
    '17',
    '25',
  ]
  # Iteration 1 trained on the first 8 + 1 tokens of its samples: its loss is the initial
  # model's loss on exactly those, which `python -m t5x_like.data batch` shows.
  samples = replay.iteration_batch(cfg, cfg.train.seed, 1).rows
  assert samples.shape == (8, 9)
  np.testing.assert_array_equal(samples, first.source.rows(0, 8)[:, :9])
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  initial = layout.init(cfg.train.seed).params
  loss = losses.mean_loss(layout.model, initial, jnp.asarray(samples))
  assert records[0]['lm_loss'] == pytest.approx(float(loss), rel=1e-5)
  assert records[0]['lm_loss'] != pytest.approx(
    float(losses.mean_loss(layout.model, initial, jnp.asarray(first.source.rows(0, 8)[:, :17]))),
    rel=1e-3,
  )


def test_curriculum_evaluates_at_the_full_sequence_length(curriculum_run):
  """At iteration 2 the curriculum trains at length 16; the evaluation then runs at
  train.seq_len (24): its loss is the loss of the iteration-2 params on the validation set's
  first batch at full length, computed here independently on one device, and not the loss of
  that batch cut to 16."""
  from t5x_like.model import losses

  cfg, workdir, first = curriculum_run
  assert read_metrics(workdir)[1]['curriculum_seq_len'] == 16
  with open(os.path.join(workdir, 'eval_metrics.jsonl')) as f:
    (evaluated,) = [r for r in map(json.loads, f) if (r['iteration'], r['set']) == (2, 'valid')]
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  params = jax.device_get(first.final_state.params)  # the first job ended at iteration 2
  (valid,) = first.data.valid.values()
  rows = valid.rows(0, cfg.train.global_batch_size)
  assert rows.shape[1] == 25
  full = float(losses.mean_loss(layout.model, params, jnp.asarray(rows)))
  cut = float(losses.mean_loss(layout.model, params, jnp.asarray(rows[:, :17])))
  # A barely trained model's losses are all near ln(8192), so the lengths differ by only ~3e-4
  # of the loss; the mesh's reduction order moves it by about 1e-7.
  assert abs(full - cut) > 1e-4 * full
  assert evaluated['lm_loss'] == pytest.approx(full, rel=1e-5, abs=0)
  # The one evaluation program compiled: [micro-batches, rows, 24 + 1].
  _, batch_info = first.evaluator.step_for(cfg.train.global_batch_size).args_info[0]
  assert batch_info.shape == (2, 4, 25)


def test_curriculum_padded_to_a_multiple_compiles_fewer_steps_and_trains_the_same(
  curriculum_run, tmp_path
):
  """curriculum.pad_to_multiple=16: lengths 8, 16, 24, 24 run at 16, 16, 24, 24 (at most
  train.seq_len), the padding outside the loss: 2 compiled steps instead of 3, and the same
  losses, gradient norms, tokens and learning rates as the unpadded run, in one job."""
  cfg, exact_workdir, _ = curriculum_run
  workdir = str(tmp_path / 'padded')
  Trainer(
    cfg.replace(train={'steps': 4}, curriculum={'pad_to_multiple': 16}, eval={'interval': 0}),
    workdir,
  ).run()
  exact, records = read_metrics(exact_workdir), read_metrics(workdir)
  assert [r['padded_seq_len'] for r in records] == [16, 16, 24, 24]
  for key in ('seq_len', 'curriculum_seq_len', 'consumed_tokens', 'learning_rate'):
    assert [r[key] for r in records] == [r[key] for r in exact], key
  for key in ('lm_loss', 'grad_norm'):
    assert [r[key] for r in records] == pytest.approx([r[key] for r in exact], rel=2e-5), key
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert re.findall(r'compiled the train step for 2 micro-batch\(es\) of 4x(\d+) tokens', log) == [
    '17',
    '25',
  ]
  assert '3 lengths, run at 2 lengths padded to multiples of 16 (padding outside the loss)' in log
  assert '> the train step runs at 2 shapes over the run' in log


def test_rampup_padded_to_a_multiple_compiles_fewer_steps_and_trains_the_same(tmp_path):
  """train.rampup_microbatch_multiple=2 on a data x tensor mesh without a pipeline: the ramp-up's
  2, 3, 4 micro-batches run as 2, 4, 4 (the padding micro-batch skipped by the step), 2 compiled
  steps instead of 3, and the unpadded run's losses and gradient norms; step-time baselines do
  not carry over between the two settings."""
  cfg = corpus_config(
    train=dict(steps=4, global_batch_size=16, rampup_batch_size=(8, 4, 16)),
    runtime=dict(replica_check_interval=0),
  )
  exact_trainer = Trainer(cfg, str(tmp_path / 'exact'))
  exact_trainer.run()
  padded = Trainer(cfg.replace(train={'rampup_microbatch_multiple': 2}), str(tmp_path / 'padded'))
  padded.run()
  exact, records = read_metrics(str(tmp_path / 'exact')), read_metrics(str(tmp_path / 'padded'))
  assert [r['global_batch_size'] for r in records] == [8, 12, 16, 16]
  assert [r['padded_microbatches'] for r in records] == [2, 4, 4, 4]
  for key in ('global_batch_size', 'consumed_samples', 'learning_rate'):
    assert [r[key] for r in records] == [r[key] for r in exact], key
  for key in ('lm_loss', 'grad_norm'):
    assert [r[key] for r in records] == pytest.approx([r[key] for r in exact], rel=2e-5), key
  # num_zeros counts gradient entries that are exactly 0. Another micro-batch count is another
  # program that sums in another order, which can leave a rounding residue where a cancellation
  # gave exactly 0: on a Zen 4 CPU iteration 3 had 1 zero entry exact and 0 padded (of 624,512).
  assert [r['num_zeros'] for r in records] == pytest.approx([r['num_zeros'] for r in exact], abs=2)
  assert sorted(padded.steps.programs) == [(2, 33), (4, 33)]
  with open(os.path.join(tmp_path, 'padded', 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert '> the train step runs at 2 shapes over the run' in log
  assert (
    "> ramp-up: micro-batch counts rounded up to multiples of 2, 1 of the run's 14 "
    'micro-batches (7.14%) padding (the step skips them)'
  ) in log
  # A job that pads where the checkpoint's job did not measures its own step-time baseline
  # (under a pipeline a padded ramp-up step takes longer than the exact one).
  saved = {
    'setup': exact_trainer.watches.throughput_setup,
    'baselines': [{'global_batch_size': 8, 'seq_len': 0, 'step_s': 0.1, 'first': 2, 'last': 4}],
  }
  padded_watch, exact_watch = watches.ThroughputWatch(), watches.ThroughputWatch()
  note = watches.seed_throughput(padded_watch, saved, padded.watches.throughput_setup)
  assert padded_watch.baselines() == []
  assert note.startswith("> throughput: the checkpoint's job ran on another")
  watches.seed_throughput(exact_watch, saved, exact_trainer.watches.throughput_setup)
  assert len(exact_watch.baselines()) == 1


def test_a_later_job_loads_its_programs_from_the_compilation_cache(tmp_path):
  """runtime.compilation_cache_dir: the first job stores its compiled programs, a restart finds
  every one there and compiles none anew (nothing is added to the cache). Also when the process
  had opened another cache before (here the session's, tests/conftest.py)."""
  from jax.experimental.compilation_cache import compilation_cache

  keys = ('jax_compilation_cache_dir', 'jax_persistent_cache_min_compile_time_secs')
  before = {k: getattr(jax.config, k) for k in keys}
  cfg = corpus_config(
    train=dict(steps=1),
    mesh=dict(data=1, tensor=1),
    runtime=dict(compilation_cache_dir='xla_cache', replica_check_interval=0),
  )
  try:
    workdir = str(tmp_path / 'run')
    Trainer(cfg, workdir).run()
    cache = os.path.join(workdir, 'xla_cache')
    stored = sorted(os.listdir(cache))
    assert any(name.startswith('jit_step') for name in stored), stored  # the train step
    Trainer(cfg.replace(train={'steps': 2}), workdir).run()  # resumes; iteration 2 trains
    assert sorted(os.listdir(cache)) == stored
    with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
      log = f.read()
    assert f'> compilation cache: {cache} ({len(stored)} programs stored;' in log
    assert [r['iteration'] for r in read_metrics(workdir)] == [1, 2]
  finally:
    for k, v in before.items():
      jax.config.update(k, v)
    compilation_cache.reset_cache()  # the next compilation opens the restored directory


def test_a_step_that_needs_more_memory_than_the_device_gives_is_one_error(tmp_path, monkeypatch):
  """On an accelerator, a compiled step whose XLA peak is more than JAX may allocate on one
  device ends the run before its first iteration with one ConfigError naming the figures and
  the fixes, not XLA's out-of-memory report at the first allocation; within the limit it runs,
  and logs the allocator's peak after its first iteration (the count faked here: a CPU keeps
  none) and records it with every iteration."""
  from t5x_like.training import device_memory

  monkeypatch.setattr(device_memory, 'accelerator_memory', lambda: (2**20, 'Small GPU'))
  cfg = corpus_config(train={'steps': 2}, mesh={'data': 1, 'tensor': 1})
  trainer = Trainer(cfg, str(tmp_path / 'small'))
  with pytest.raises(ConfigError) as found:
    trainer.run()
  message = str(found.value)
  assert re.match(
    r'the train step for 4 micro-batch\(es\) of 2x33 tokens needs [\d.]+ GiB per device '
    r"\(XLA's figure\), more than the 0\.00 GiB JAX may use of one Small GPU\. Use a smaller "
    r"train\.micro_batch_size \(now 2\), model\.remat_policy='full', more devices ",
    message,
  ), message
  assert '1f1b' not in message  # no pipeline here
  assert 'python -m t5x_like.plan --config CFG --search' in message
  assert not os.path.exists(tmp_path / 'small' / 'metrics.jsonl')  # no iteration ran
  monkeypatch.setattr(device_memory, 'accelerator_memory', lambda: (2**40, 'Large GPU'))
  monkeypatch.setattr(device_memory, 'allocator_bytes', lambda: (3 * 2**29, 2**29))
  trainer = Trainer(cfg, str(tmp_path / 'large'))
  trainer.run()
  records = read_metrics(str(tmp_path / 'large'))
  assert [(r['iteration'], r['peak_memory_gib']) for r in records] == [(1, 1.5), (2, 1.5)]
  log = (tmp_path / 'large' / 'logs' / 'main_log.txt').read_text()
  assert log.count('> device memory after') == 1
  assert (
    '> device memory after iteration 1: peak 1.50 GiB of the 1024.00 GiB JAX may use on one '
    'Large GPU, 0.50 GiB in use between iterations'
  ) in log


def test_a_curriculum_whose_last_step_would_not_fit_is_refused_before_its_first_iteration(
  tmp_path, monkeypatch
):
  """Early curriculum steps are short and need less memory than the run's last ones (the
  chronicles' 'false lower memory usage under early steps of CL'): on an accelerator the run's
  largest step is compiled before the first iteration too, and one that would not fit ends the
  run there, naming its shape."""
  from t5x_like.training import device_memory
  from t5x_like.training.step import CompiledSteps

  cfg = corpus_config(
    train={'steps': 3, 'seq_len': 128},
    mesh={'data': 1, 'tensor': 1},
    curriculum={'min_seq_len': 8, 'total_iterations': 3},
    runtime={'replica_check_interval': 0},
  ).validate()
  gbs, first_len = cfg.train.global_batch_size, schedule.padded_seq_len_at(cfg, 1)
  steps = CompiledSteps(cfg, make_layout(cfg, partitioning.mesh_of(cfg.mesh)), lambda line: None)
  first, last = (
    device_memory.peak_bytes(steps.get(gbs, n).memory_analysis()) for n in (first_len, 128)
  )
  assert first_len < 128 and first < last
  monkeypatch.setattr(device_memory, 'accelerator_memory', lambda: ((first + last) // 2, 'GPU'))
  workdir = tmp_path / 'run'
  with pytest.raises(ConfigError) as found:
    Trainer(cfg, str(workdir)).run()
  assert str(found.value).startswith('the train step for 4 micro-batch(es) of 2x129 tokens needs')
  assert not os.path.exists(workdir / 'metrics.jsonl')  # no iteration ran
  log = (workdir / 'logs' / 'main_log.txt').read_text()
  assert f'> compiled the train step for 4 micro-batch(es) of 2x{first_len + 1} tokens' in log
  assert (
    "> the run's largest step (iteration 3's, 8 samples of 128 tokens) is compiled now to "
    'check that it fits in memory'
  ) in log


def test_the_memory_error_names_the_fixes_that_apply():
  """A GPipe pipeline under full recomputation: the fixes name 1F1B, not 'full' again."""
  from t5x_like.training.step import CompiledSteps

  cfg = corpus_config(
    mesh={'data': 1, 'tensor': 1, 'pipeline': 2}, model={'remat_policy': 'full'}
  ).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  steps = CompiledSteps(cfg, layout, lambda line: None, memory_limit=(2**20, 'Small GPU'))
  with pytest.raises(ConfigError) as found:
    steps.get(cfg.train.global_batch_size, cfg.train.seq_len)
  message = str(found.value)
  assert "pipeline.schedule='1f1b' (GPipe keeps every micro-batch in flight)" in message
  assert "remat_policy='full'" not in message, message
  assert "grad_sync='tick'" not in message, message  # one data rank holds it whole anyway


def test_the_memory_error_of_a_step_summed_once_a_step_names_tick():
  """Data ranks that each hold their whole fp32 gradient (grad_sync 'step', here without a
  pipeline): the fixes name 'tick', which splits it over them."""
  from t5x_like.training.step import CompiledSteps

  cfg = corpus_config(mesh={'data': 2, 'tensor': 1}, pipeline={'grad_sync': 'step'}).validate()
  layout = make_layout(cfg, partitioning.mesh_of(cfg.mesh))
  steps = CompiledSteps(cfg, layout, lambda line: None, memory_limit=(2**20, 'Small GPU'))
  with pytest.raises(ConfigError, match=r"pipeline.grad_sync='tick' \(under 'step' each data"):
    steps.get(cfg.train.global_batch_size, cfg.train.seq_len)
