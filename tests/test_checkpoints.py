"""Checkpoints: what is saved, keep policy, atomic saves, exact resume after SIGKILL, restore onto
any mesh, restart controls, leaving cleanly (kill switch, time limit, signals), bad input."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, config_with, run_cli, small_config

from t5x_like.checkpointing import checkpoints
from t5x_like.checkpointing.checkpoints import CheckpointError
from t5x_like.cli import train
from t5x_like.config import Config, ConfigError
from t5x_like.mesh import partitioning
from t5x_like.model import losses
from t5x_like.optim import adamw as optim
from t5x_like.parallel.train_state import Progress, TrainState, make_layout
from t5x_like.training import runtime, schedule
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics


def corpus_config(**sections) -> Config:
  """A one-layer BLOOM with dropout (so the RNG matters) on the embedded corpus, one device."""
  return config_with(
    {
      'model': dict(
        num_layers=1,
        hidden_size=32,
        num_heads=4,
        vocab_size=8192,
        init_std=0.02,
        hidden_dropout=0.1,
      ),
      'train': dict(steps=4, global_batch_size=4, micro_batch_size=2, seq_len=16, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=4, decay_samples=400),
      'mesh': dict(data=1, pipeline=1, tensor=1),
      'checkpoint': dict(save_interval=2),
    },
    sections,
  )


@pytest.fixture(scope='module')
def base_run(tmp_path_factory):
  """4 iterations, checkpoints at 2 and 4."""
  workdir = str(tmp_path_factory.mktemp('base'))
  trainer = Trainer(corpus_config(), workdir)
  trainer.run()
  return workdir, trainer


def resumable_copy(base_workdir: str, dest, keep_step: int = 2) -> str:
  """A copy of the base workdir that resumes from `keep_step`."""
  dest = str(dest)
  shutil.copytree(base_workdir, dest)
  for step in checkpoints.available_steps(os.path.join(dest, 'checkpoints')):
    if step > keep_step:
      shutil.rmtree(os.path.join(dest, 'checkpoints', str(step)))
  return dest


def losses_of(workdir):
  return [(r['iteration'], r['lm_loss'], r['grad_norm']) for r in read_metrics(workdir)]


# ------------------------------------------------------------------------------ what is saved


def test_a_checkpoint_holds_everything_a_restart_needs(base_run):
  workdir, trainer = base_run
  root = os.path.join(workdir, 'checkpoints')
  assert checkpoints.available_steps(root) == [2, 4]
  step_dir = os.path.join(root, '4')
  assert set(checkpoints.ITEMS) <= set(os.listdir(step_dir))
  state, progress = checkpoints.restore(root, trainer.layout, trainer.cfg)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype('float32')}
  assert int(optim.adam_count(state.opt_state)) == 4
  assert progress == Progress(iteration=4, consumed_samples=16, consumed_tokens=256)
  meta = checkpoints.read_meta(root)
  assert meta['rng'] == {'seed': 3, 'iteration': 4}
  assert meta['data'] == {'seed': 3, 'consumed_samples': 16}
  assert meta['lr_schedule'] == checkpoints.lr_schedule(trainer.cfg)
  assert meta['adam_count_base'] == {'iteration': 0, 'skipped_iterations': 0}
  assert checkpoints.read_config(root) == trainer.cfg
  saved = jax.device_get(trainer.final_state)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), saved)


def tiny_state():
  cfg = small_config().validate()
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  return cfg, layout, layout.init(0)


def save_step(checkpointer, cfg, state, step):
  progress = Progress(iteration=step)
  meta = checkpoints.make_meta(
    cfg, progress, cfg.train.seed, {'iteration': 0, 'skipped_iterations': 0}
  )
  return checkpointer.save(state, progress, cfg, meta)


def test_keep_policy_keeps_the_latest_k_and_every_nth(tmp_path):
  cfg, layout, state = tiny_state()
  root = str(tmp_path / 'ckpt')
  checkpointer = checkpoints.Checkpointer(root, 1, max_to_keep=1, layout=layout, keep_period=2)
  for step in range(1, 6):
    assert save_step(checkpointer, cfg, state, step)
  assert not save_step(checkpointer, cfg, state, 5)  # the final save of a step saved already
  checkpointer.close()
  assert checkpoints.available_steps(root) == [2, 4, 5]
  # Dropped steps went through `.deleted/` (one atomic rename each) and are gone from it.
  assert not os.listdir(os.path.join(root, checkpoints.DELETED_SUBDIR))


def orbax_thread_error(message: str) -> logging.LogRecord:
  """A record as Orbax's writer threads log one through absl (their file is Orbax's)."""
  path = os.path.join(os.sep, 'site-packages', 'orbax', 'checkpoint', 'future.py')
  return logging.LogRecord('absl', logging.ERROR, path, 1, message, None, None)


@pytest.mark.parametrize('fails', [False, True])
def test_a_failed_saves_late_thread_reports_stay_unprinted_after_close(
  tmp_path, monkeypatch, caplog, fails
):
  """After a failed save, Orbax's writer threads can still log the failure once the manager is
  closed (a full disk: CI once printed its signalling thread's 35-line traceback after the
  SaveError's one line). Those reports stay counted, not printed, after close(); after a good
  save the filter is gone, and an Orbax error is printed."""
  import orbax.checkpoint as ocp

  cfg, layout, state = tiny_state()
  checkpointer = checkpoints.Checkpointer(str(tmp_path / 'ckpt'), 1, 5, layout)
  if fails:

    def no_space(*args, **kwargs):
      raise OSError('Failed to write 188 bytes to file 23: No space left on device')

    monkeypatch.setattr(ocp.CheckpointManager, 'save', no_space)
    with pytest.raises(checkpoints.SaveError, match='No space left on device'):
      save_step(checkpointer, cfg, state, 2)
  else:
    assert save_step(checkpointer, cfg, state, 2)
  checkpointer.close()
  caplog.clear()
  with caplog.at_level(logging.ERROR):
    logging.getLogger('absl').handle(orbax_thread_error('_SignalingThread.run() raised'))
  printed = [r for r in caplog.records if '_SignalingThread' in r.getMessage()]
  assert len(printed) == (0 if fails else 1), printed


INTERRUPTED_SAVE = """
import os, sys
sys.path.insert(0, {tests!r})
from conftest import small_config
from t5x_like.checkpointing import checkpoints; from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import Progress, make_layout
cfg = small_config(model=dict(num_layers=4, hidden_size=256)).validate()
layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
state = layout.init(0)
checkpointer = checkpoints.Checkpointer({root!r}, 1, 5, layout)
for step in (1, 2):
  progress = Progress(iteration=step)
  checkpointer.save(state, progress, cfg, checkpoints.make_meta(
      cfg, progress, 7, {{'iteration': 0, 'skipped_iterations': 0}}))
  if step == 1:
    checkpointer.wait()
os._exit(9)  # dies while step 2 is being written
"""


def test_an_interrupted_save_is_never_restored_and_is_cleaned_up(tmp_path):
  root = str(tmp_path / 'ckpt')
  script = INTERRUPTED_SAVE.format(tests=os.path.join(REPO, 'tests'), root=root)
  r = run_cli(['-c', script])
  assert r.returncode == 9, r.stderr[-2000:]
  leftovers = [d for d in os.listdir(root) if not d.isdigit()]
  assert leftovers and all(d.startswith('2.') for d in leftovers), os.listdir(root)
  assert checkpoints.available_steps(root) == [1]
  assert checkpoints.resolve(root) == (root, 1)
  cfg = small_config(model=dict(num_layers=4, hidden_size=256)).validate()
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  _, progress = checkpoints.restore(root, layout, cfg)
  assert progress.iteration == 1
  checkpoints.Checkpointer(root, 1, 5, layout).close()  # the next run opens the root
  assert sorted(os.listdir(root)) == [checkpoints.DELETED_SUBDIR, '1']
  assert not os.listdir(os.path.join(root, checkpoints.DELETED_SUBDIR))


# ------------------------------------------------------------------------------- exact resume

TINY = [
  '--config',
  'configs/tiny.py',
  '--config.eval.interval=0',
  '--config.model.num_layers=2',
  '--config.model.hidden_size=64',
  '--config.model.num_heads=4',
  '--config.model.hidden_dropout=0.1',
  '--config.train.seq_len=32',
  '--config.train.global_batch_size=8',
  '--config.train.micro_batch_size=2',
  '--config.train.steps=8',
  '--config.checkpoint.save_interval=2',
  '--config.optimizer.warmup_samples=16',
  # No TensorBoard: clu's writer imports TensorFlow, half of a run's time (docs/tests.md).
  '--config.runtime.tensorboard_dir=',
]


# `python -m t5x_like.train ARGS` that stops at one point of its work ($KILL_POINT): it creates
# the file $REACHED there and waits, for the test to SIGKILL it. The points: start-up (the first
# compilation, before any iteration or checkpoint); between iterations 3 and 4 (checkpoint 2 may
# be in flight); during checkpoint 4's asynchronous save (its arrays written in the background,
# not committed: training goes on meanwhile); and in its finalisation, with the commit marker
# written in `4.orbax-checkpoint-tmp` but the rename to `4` not done (Orbax's own functions).
_STOPPING_TRAINER = r"""
import os, sys, threading
from orbax.checkpoint._src.path import atomicity
from t5x_like.checkpointing import checkpoints
from t5x_like.cli import train
from t5x_like.training import step, trainer

point = os.environ['KILL_POINT']


def arrive():
  open(os.environ['REACHED'], 'w').close()
  threading.Event().wait()  # until SIGKILL


if point == 'start-up':
  def compile_step(self, shape):
    arrive()
  step.CompiledSteps.compile = compile_step
elif point == 'between iterations':
  train_iteration = trainer.Trainer.train_iteration
  def iteration_then_stop(self, state, progress):
    out = train_iteration(self, state, progress)
    if progress.iteration == 3:
      arrive()
    return out
  trainer.Trainer.train_iteration = iteration_then_stop
elif point == 'asynchronous save':
  on_commit = atomicity.on_commit_callback
  async def commit_then_stop(tmp_dir, **kwargs):
    if tmp_dir.get_final().name == '4':
      arrive()
    return await on_commit(tmp_dir, **kwargs)
  atomicity.on_commit_callback = commit_then_stop
elif point == 'finalisation':
  rename = atomicity.async_path.rename
  async def rename_then_stop(source, destination, *args, **kwargs):
    if checkpoints.TMP_MARKER in str(source) and os.path.basename(str(destination)) == '4':
      arrive()
    return await rename(source, destination, *args, **kwargs)
  atomicity.async_path.rename = rename_then_stop
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """TINY's losses without interruption. The runs compared with it load the programs it compiled
  from the session's compilation cache (tests/conftest.py): the same executables."""
  workdir = tmp_path_factory.mktemp('uninterrupted') / 'run'
  r = run_cli(['-m', 't5x_like.train', *TINY, '--workdir', str(workdir)])
  assert r.returncode == 0, r.stderr[-3000:]
  return losses_of(workdir)


def kill_9_at(point: str, workdir, args=TINY) -> None:
  """Starts TINY's run (or `args`') stopping at `point`, and SIGKILLs it there."""
  reached = str(workdir) + '.reached'
  log_path = str(workdir) + '.log'
  with open(log_path, 'w') as log:
    process = subprocess.Popen(
      [sys.executable, '-c', _STOPPING_TRAINER, *args, '--workdir', str(workdir)],
      cwd=REPO,
      env={**os.environ, 'KILL_POINT': point, 'REACHED': reached},
      stdout=log,
      stderr=subprocess.STDOUT,
    )
    try:
      deadline = time.monotonic() + 400  # a guard against a point never reached
      while not os.path.exists(reached):
        assert process.poll() is None, f'training ended early: {open(log_path).read()[-3000:]}'
        assert time.monotonic() < deadline, f'{point} not reached'
        time.sleep(0.02)
      process.send_signal(signal.SIGKILL)
    finally:
      process.kill()
      process.wait(timeout=60)
  assert process.returncode == -signal.SIGKILL


@pytest.mark.parametrize(
  'point', ['start-up', 'between iterations', 'asynchronous save', 'finalisation']
)
def test_kill_9_then_restart_reproduces_the_uninterrupted_run(uninterrupted, point, tmp_path):
  """SIGKILL at `point` (see _STOPPING_TRAINER), then the same command: it resumes from the last
  complete checkpoint (none after a kill at start-up) and its losses and gradient norms are the
  uninterrupted run's, bitwise."""
  straight = uninterrupted
  workdir = tmp_path / 'interrupted'
  kill_9_at(point, workdir)
  root = os.path.join(workdir, 'checkpoints')
  on_disk = sorted(os.listdir(root)) if os.path.isdir(root) else []
  complete = checkpoints.available_steps(root) if on_disk else []
  if point == 'start-up':
    assert complete == []
  elif point == 'between iterations':
    assert complete in ([], [2])  # checkpoint 2's save may still have been in flight
  else:  # checkpoint 4's save starts once 2's is complete
    assert complete == [2]
    assert '4' + checkpoints.TMP_MARKER in on_disk, on_disk  # what the restart must ignore
  if point == 'finalisation':
    assert os.path.exists(os.path.join(root, '4' + checkpoints.TMP_MARKER, 'commit_success.txt'))
  r = run_cli(['-m', 't5x_like.train', *TINY, '--workdir', str(workdir)])
  assert r.returncode == runtime.ExitCode.FINISHED, r.stderr[-3000:]
  if complete:
    assert f'resumed from {root}/2' in r.stdout, r.stdout[-3000:]
  else:
    assert 'resumed from' not in r.stdout
  assert [x[0] for x in losses_of(workdir)] == list(range(1, 9))
  assert losses_of(workdir) == straight  # bitwise: lm_loss and grad_norm


# ---------------------------------------------------------------------------- any-mesh restore

# (data, pipeline, tensor). A pipeline stores its layers in stage order; checkpoints hold the
# canonical [L, ...] order, so pipeline meshes are just more rows and columns of the matrix.
SAVE_MESHES = [(1, 1, 1), (2, 1, 2), (4, 1, 2), (1, 2, 2)]
RESTORE_MESHES = [(1, 1, 1), (8, 1, 1), (1, 1, 4), (2, 1, 4), (2, 2, 2)]


def mesh_config(mesh) -> Config:
  data, pipe, tensor = mesh
  return small_config(
    mesh=dict(data=data, pipeline=pipe, tensor=tensor),
    train=dict(global_batch_size=8, micro_batch_size=1),
  ).validate()


def layout_on(mesh):
  return make_layout(mesh_config(mesh), partitioning.make_mesh(*mesh))


@pytest.fixture(scope='module')
def saved_on_each_mesh(tmp_path_factory):
  """The same non-trivial state (random params and Adam moments) saved from each save mesh."""
  rng = np.random.default_rng(0)
  reference = layout_on((1, 1, 1)).canonical

  def random_like(a):
    if jnp.issubdtype(a.dtype, jnp.integer):
      return np.full(a.shape, 5, a.dtype)  # the Adam step count
    return np.abs(rng.standard_normal(a.shape)).astype(a.dtype) * 0.02

  canonical = jax.tree.map(random_like, reference)
  roots = {}
  for mesh in SAVE_MESHES:
    cfg, layout = mesh_config(mesh), layout_on(mesh)
    placed = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), canonical, layout.canonical)
    state = TrainState(
      layout.from_canonical(placed.params, 'params'),
      layout.from_canonical(placed.opt_state, 'opt_state'),
    )
    roots[mesh] = str(tmp_path_factory.mktemp('mesh') / 'ckpt')
    checkpointer = checkpoints.Checkpointer(roots[mesh], 1, 1, layout)
    save_step(checkpointer, cfg, state, 5)
    checkpointer.close()
  return canonical, roots


_loss_fns, _losses = {}, {}


def next_step_loss(mesh, layout, state) -> float:
  """The loss the next step would compute (a fixed batch of 8 rows) on the restore mesh."""
  if mesh not in _loss_fns:
    batch = jax.sharding.NamedSharding(layout.mesh, jax.sharding.PartitionSpec('data', None))
    params = jax.tree.map(lambda a: a.sharding, layout.canonical.params)
    _loss_fns[mesh] = jax.jit(
      lambda p, tokens: losses.token_losses(layout.model, p, tokens).mean(),
      in_shardings=(params, batch),
    )
  tokens = np.random.default_rng(1).integers(0, 1000, (8, 17)).astype(np.int32)
  return float(_loss_fns[mesh](layout.to_canonical(state.params, 'params'), tokens))


@pytest.mark.parametrize('restore_mesh', RESTORE_MESHES, ids=lambda m: 'to{}x{}x{}'.format(*m))
@pytest.mark.parametrize('save_mesh', SAVE_MESHES, ids=lambda m: 'from{}x{}x{}'.format(*m))
def test_restore_onto_any_mesh(saved_on_each_mesh, save_mesh, restore_mesh):
  canonical, roots = saved_on_each_mesh
  cfg, layout = mesh_config(restore_mesh), layout_on(restore_mesh)
  state, progress = checkpoints.restore(roots[save_mesh], layout, cfg)
  assert progress.iteration == 5
  placed = jax.tree.map(lambda x, want: x.sharding == want, state, layout.shardings)
  assert all(jax.tree.leaves(placed))  # restored straight into the target shardings
  for which in ('params', 'opt_state'):
    restored = layout.to_canonical(getattr(state, which), which)
    jax.tree.map(
      np.testing.assert_array_equal, jax.device_get(restored), getattr(canonical, which)
    )  # bitwise
  loss = next_step_loss(restore_mesh, layout, state)
  reference = _losses.setdefault('loss', loss)
  assert abs(loss - reference) <= 1e-5 * abs(reference)


# ----------------------------------------------------------------------------- restart controls


def test_load_optimizer_false_starts_fresh_moments_and_count(base_run, tmp_path):
  workdir = resumable_copy(base_run[0], tmp_path / 'w')
  cfg = corpus_config(checkpoint=dict(save_interval=2, load_optimizer=False))
  trainer = Trainer(cfg, workdir)
  state, progress = trainer.initial_state()
  assert progress.iteration == 2 and int(optim.adam_count(state.opt_state)) == 0
  assert all(not np.any(x) for x in jax.tree.leaves(state.opt_state[0].mu))
  trainer.run()
  root = os.path.join(workdir, 'checkpoints')
  restored, _ = checkpoints.restore(root, trainer.layout, trainer.cfg)
  assert int(optim.adam_count(restored.opt_state)) == 2  # iterations 3 and 4
  meta = checkpoints.read_meta(root)
  assert meta['adam_count_base'] == {'iteration': 2, 'skipped_iterations': 0}
  assert (
    'load_optimizer=False: fresh Adam moments'
    in open(os.path.join(workdir, 'logs', 'main_log.txt')).read()
  )
  # The job is requeued with the same flags: the reset is not repeated (Megatron's
  # --no-load-optim reset the optimizer at every restart of such a job).
  again = Trainer(
    corpus_config(train=dict(steps=6), checkpoint=dict(save_interval=2, load_optimizer=False)),
    workdir,
  )
  state, progress = again.initial_state()
  assert progress.iteration == 4 and int(optim.adam_count(state.opt_state)) == 2
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.device_get(state.opt_state),
    jax.device_get(restored.opt_state),
  )
  again.writer.open()  # as the run's start does: the lines logged so far reach the log file
  assert (
    'already applied at iteration 2 by the job that saved this checkpoint'
    in open(os.path.join(workdir, 'logs', 'main_log.txt')).read()
  )
  assert again.resumption.adam_count_base == {'iteration': 2, 'skipped_iterations': 0}


def test_a_changed_lr_schedule_needs_override_lr_scheduler(base_run, tmp_path):
  """Without the override, one clear error before any work (the recipe below trains with it)."""
  workdir = resumable_copy(base_run[0], tmp_path / 'w')
  metrics_before = read_metrics(workdir)
  changed = dict(lr=1e-3, min_lr=1e-4, warmup_samples=4, decay_samples=400)
  with pytest.raises(
    ConfigError,
    match=r'optimizer.lr: checkpoint 0.002 vs config 0.001; '
    r'optimizer.min_lr: .*override_lr_scheduler=True',
  ):
    Trainer(corpus_config(optimizer=changed), workdir)
  assert read_metrics(workdir) == metrics_before
  overridden = corpus_config(optimizer=changed, checkpoint=dict(override_lr_scheduler=True))
  assert Trainer(overridden, workdir).cfg.optimizer.lr == 1e-3


def test_a_checkpoint_from_before_token_decay_has_the_default_schedule():
  """Checkpoints written before optimizer.decay_tokens existed lack it in their meta: they
  resume with its default (decay by samples), and setting it is a schedule change."""
  cfg = corpus_config()
  old_meta = {
    'lr_schedule': {k: v for k, v in checkpoints.lr_schedule(cfg).items() if k != 'decay_tokens'}
  }
  checkpoints.check_lr_schedule(old_meta, cfg, 'the checkpoint')
  with pytest.raises(ConfigError, match='optimizer.decay_tokens: checkpoint 0 vs config 5000'):
    checkpoints.check_lr_schedule(
      old_meta, cfg.replace(optimizer={'decay_tokens': 5000}), 'the checkpoint'
    )


def test_load_rng_keeps_the_checkpoints_stream_and_false_takes_the_configs(base_run, tmp_path):
  other_seed = corpus_config(train=dict(seed=99))
  kept = resumable_copy(base_run[0], tmp_path / 'kept')
  trainer = Trainer(other_seed, kept)  # load_rng=True (default): seed 3 of the checkpoint
  assert (trainer.cfg.train.seed, trainer.resumption.data_seed) == (3, 3)
  trainer.run()
  assert losses_of(kept) == losses_of(base_run[0])  # the same masks and data: bitwise
  fresh = resumable_copy(base_run[0], tmp_path / 'fresh')
  trainer = Trainer(other_seed.replace(checkpoint={'load_rng': False}), fresh)
  assert (trainer.cfg.train.seed, trainer.resumption.data_seed) == (
    99,
    3,
  )  # new masks, same data order
  trainer.run()
  assert losses_of(fresh)[:2] == losses_of(base_run[0])[:2]
  assert losses_of(fresh)[2][1] != losses_of(base_run[0])[2][1]
  assert checkpoints.read_meta(os.path.join(fresh, 'checkpoints'))['rng']['seed'] == 99


def test_optimizer_reset_recipe(base_run, tmp_path):
  """The chronicles' recipe (docs/checkpoints.md): fresh Adam state, lr 0 while the moments warm
  up, then the normal schedule again. Here: 2 warm-up iterations after iteration 2, then back to
  normal."""
  workdir = resumable_copy(base_run[0], tmp_path / 'w')
  root = os.path.join(workdir, 'checkpoints')
  before, _ = checkpoints.restore(root, base_run[1].layout, base_run[1].cfg)
  before = jax.device_get(before.params)
  warmup = corpus_config(
    optimizer=dict(lr=0.0, min_lr=0.0),
    checkpoint=dict(save_interval=2, load_optimizer=False, override_lr_scheduler=True),
  )
  trainer = Trainer(warmup, workdir)
  trainer.run()
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  # The reset job says it reset the Adam state, and only that.
  assert log.count('> checkpoint.load_optimizer=False: fresh Adam moments') == 1
  assert 'already applied' not in log and '> lr 0 through' not in log
  state = jax.device_get(trainer.final_state)
  jax.tree.map(np.testing.assert_array_equal, state.params, before)  # lr 0: weights untouched
  assert int(optim.adam_count(state.opt_state)) == 2
  assert all(np.any(x) for x in jax.tree.leaves(state.opt_state[0].nu))  # moments warmed up
  # Back to the normal schedule; the checkpoint holds lr 0, so override once more.
  normal = corpus_config(
    train=dict(steps=6), checkpoint=dict(save_interval=2, override_lr_scheduler=True)
  )
  Trainer(normal, workdir).run()
  records = read_metrics(workdir)
  assert [r['learning_rate'] for r in records[2:4]] == [0.0, 0.0]
  assert records[4]['learning_rate'] == pytest.approx(
    float(schedule.learning_rate(normal.optimizer, 16))
  )
  assert all(np.isfinite(r['lm_loss']) for r in records)
  restored, _ = checkpoints.restore(root, trainer.layout, trainer.cfg)
  assert int(optim.adam_count(restored.opt_state)) == 4  # counted since the reset
  assert checkpoints.read_meta(root)['adam_count_base']['iteration'] == 2


def test_optimizer_reset_in_one_command_with_reset_warmup_iterations(base_run, tmp_path):
  """checkpoint.load_optimizer=False with reset_warmup_iterations=2 is the recipe in one command:
  lr 0 at iterations 3 and 4 (the weights untouched, the moments warming up), then the config's
  own schedule, with no override and no iteration arithmetic. A restart inside the warm-up (a
  requeue after iteration 3, the same command) keeps lr 0 through 4 from the checkpoint, does
  not reset Adam again, and trains exactly as the uninterrupted job."""
  reset = corpus_config(
    train=dict(steps=6),
    checkpoint=dict(save_interval=2, load_optimizer=False, reset_warmup_iterations=2),
  )
  whole = resumable_copy(base_run[0], tmp_path / 'whole')
  root = os.path.join(whole, 'checkpoints')
  before = jax.device_get(checkpoints.restore(root, base_run[1].layout, base_run[1].cfg)[0].params)
  trainer = Trainer(reset, whole)
  trainer.run()
  records = read_metrics(whole)
  assert [r['iteration'] for r in records] == [1, 2, 3, 4, 5, 6]
  assert [r['learning_rate'] for r in records[2:4]] == [0.0, 0.0]
  assert records[4]['learning_rate'] == pytest.approx(
    float(schedule.learning_rate(reset.optimizer, 16))
  )
  at_4, _ = checkpoints.restore(root, trainer.layout, trainer.cfg, step=4)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(at_4.params), before)
  assert int(optim.adam_count(at_4.opt_state)) == 2
  assert checkpoints.read_meta(root)['lr_zero_until'] == 4
  from t5x_like.checkpointing import inspection

  described = inspection.format_inspect(inspection.inspect(inspection.CheckpointReader(root)))
  assert (
    "started from 0 at iteration 2; lr 0 through iteration 4 (the reset's warm-up)" in described
  )
  assert int(optim.adam_count(trainer.final_state.opt_state)) == 4  # counted since the reset

  requeued = resumable_copy(base_run[0], tmp_path / 'requeued')
  Trainer(reset.replace(train={'steps': 3}), requeued).run()
  Trainer(reset, requeued).run()
  with open(os.path.join(requeued, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert log.count('> checkpoint.load_optimizer=False: fresh Adam moments') == 1
  assert log.count('> checkpoint.load_optimizer=False: already applied at iteration 2') == 1
  assert '> lr 0 through iteration 4 while the fresh Adam moments warm up' in log
  assert losses_of(requeued) == losses_of(whole)
  assert [r['learning_rate'] for r in read_metrics(requeued)] == [
    r['learning_rate'] for r in records
  ]


# ------------------------------------------------------------------------------ leaving cleanly


def _on_iteration(trainer, iteration, action):
  """Runs `action` right after the trainer logs `iteration`."""
  record = trainer.writer.record

  def wrapped(r, total):
    record(r, total)
    if r['iteration'] == iteration:
      action()

  trainer.writer.record = wrapped


def test_kill_switch_saves_and_exits_0_then_blocks_new_starts(tmp_path):
  switch = str(tmp_path / 'STOP')
  cfg = corpus_config(runtime=dict(kill_switch_path=switch))
  workdir = str(tmp_path / 'w')
  trainer = Trainer(cfg, workdir)
  _on_iteration(trainer, 1, lambda: open(switch, 'w').close())
  progress = trainer.run()
  assert progress.iteration == 1 and trainer.stop_reason is runtime.StopReason.KILL_SWITCH
  assert runtime.exit_code(trainer.stop_reason) == runtime.ExitCode.FINISHED == 0
  assert checkpoints.available_steps(os.path.join(workdir, 'checkpoints')) == [1]
  log_before = open(os.path.join(workdir, 'logs', 'main_log.txt')).read()
  # At start-up: no work at all, from the command line (before JAX) and from the library.
  assert (
    train.main(
      [
        '--config',
        os.path.join(REPO, 'configs', 'tiny.py'),
        '--workdir',
        workdir,
        f'--config.runtime.kill_switch_path={switch}',
      ]
    )
    == 0
  )
  again = Trainer(cfg, workdir)
  assert again.run().iteration == 1 and again.stop_reason is runtime.StopReason.KILL_SWITCH
  # Printed, not logged: a run that never starts leaves the workdir as it was.
  assert open(os.path.join(workdir, 'logs', 'main_log.txt')).read() == log_before


def test_time_limit_saves_and_asks_for_a_requeue(tmp_path, monkeypatch):
  clock = [0.0]
  monkeypatch.setattr(runtime, 'PROCESS_START', 0.0)
  monkeypatch.setattr(runtime, 'now', lambda: clock[0])
  trainer = Trainer(corpus_config(runtime=dict(exit_duration_mins=2.5)), str(tmp_path / 'w'))
  record = trainer.writer.record

  def a_minute_per_iteration(r, total):
    record(r, total)
    clock[0] += 60.0

  trainer.writer.record = a_minute_per_iteration
  progress = trainer.run()
  # After 2 iterations 120 s are used; a third ends at ~180 s > 150 s: stop and save first.
  assert progress.iteration == 2 and trainer.stop_reason is runtime.StopReason.TIME_LIMIT
  assert runtime.exit_code(trainer.stop_reason) == runtime.ExitCode.REQUEUE == 3
  assert checkpoints.available_steps(str(tmp_path / 'w' / 'checkpoints')) == [2]


@pytest.mark.parametrize(
  'sig', [signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP], ids=['SIGTERM', 'SIGUSR1', 'SIGHUP']
)
def test_sigterm_sigusr1_and_sighup_save_and_ask_for_a_requeue(tmp_path, sig):
  # Under nohup (SIGHUP ignored) the trainer leaves SIGHUP ignored, as nohup asks (runtime.py);
  # this test is about the handler, so it runs with the default disposition.
  ignored = signal.getsignal(sig) == signal.SIG_IGN
  if ignored:
    signal.signal(sig, signal.SIG_DFL)
  try:
    handler_before = signal.getsignal(sig)
    trainer = Trainer(corpus_config(), str(tmp_path / 'w'))
    _on_iteration(trainer, 1, lambda: os.kill(os.getpid(), sig))
    progress = trainer.run()
    assert progress.iteration == 1 and trainer.stop_reason is runtime.StopReason.SIGNAL
    assert checkpoints.available_steps(str(tmp_path / 'w' / 'checkpoints')) == [1]
    assert (
      f'received {signal.Signals(sig).name}'
      in open(str(tmp_path / 'w' / 'logs' / 'main_log.txt')).read()
    )
    assert signal.getsignal(sig) == handler_before  # the handler is put back
  finally:
    if ignored:
      signal.signal(sig, signal.SIG_IGN)


def test_the_command_line_exits_3_to_be_requeued(tmp_path):
  """A limit already used up at start: no iteration is begun, nothing is saved, exit code 3."""
  workdir = str(tmp_path / 'w')
  code = train.main(
    [
      '--config',
      os.path.join(REPO, 'configs', 'tiny.py'),
      '--workdir',
      workdir,
      '--config.model.num_layers=1',
      '--config.runtime.exit_duration_mins=1e-9',
    ]
  )
  assert code == runtime.ExitCode.REQUEUE == 3
  assert checkpoints.available_steps(os.path.join(workdir, 'checkpoints')) == []
  assert 'exit code 3 (REQUEUE)' in open(os.path.join(workdir, 'logs', 'main_log.txt')).read()


# ---------------------------------------------------------------------------------- bad input


def test_damaged_or_missing_checkpoints_are_one_clear_error(base_run, tmp_path):
  workdir, trainer = base_run
  layout, cfg = trainer.layout, trainer.cfg
  with pytest.raises(CheckpointError, match='does not exist'):
    checkpoints.restore(str(tmp_path / 'nope'), layout, cfg)
  os.makedirs(tmp_path / 'empty')
  with pytest.raises(CheckpointError, match='holds no complete checkpoint'):
    checkpoints.restore(str(tmp_path / 'empty'), layout, cfg)
  root = os.path.join(workdir, 'checkpoints')
  with pytest.raises(CheckpointError, match=r'step 3 is not in .*available steps: \[2, 4\]'):
    checkpoints.restore(root, layout, cfg, step=3)
  for damage in ('truncate', 'remove'):
    copy = str(tmp_path / damage)
    shutil.copytree(root, copy)
    data = os.path.join(copy, '4', 'params', 'ocdbt.process_0', 'd')
    biggest = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
    if damage == 'truncate':
      os.truncate(biggest, 100)
    else:
      os.remove(biggest)
    with pytest.raises(
      CheckpointError,
      match=r'4 is damaged or incomplete and cannot be '
      r'restored: .*available: \[2\]',
    ):
      checkpoints.restore(copy, layout, cfg)
    state, progress = checkpoints.restore(copy, layout, cfg, step=2)  # an older step still works
    assert progress.iteration == 2
  incomplete = str(tmp_path / 'incomplete')
  shutil.copytree(root, incomplete)
  shutil.rmtree(os.path.join(incomplete, '4', 'progress'))
  assert checkpoints.available_steps(incomplete) == [2]
  with pytest.raises(CheckpointError, match='incomplete checkpoint'):
    checkpoints.resolve(os.path.join(incomplete, '4'))


def test_the_shape_check_names_the_keys_to_set_and_only_the_ones_that_shape_parameters():
  """The FFN width by its settable key (ffn_hidden_size; the effective sizes shown); learned
  positions and the embedding LayerNorm only where GPT-2 has them: a BLOOM's
  max_position_embeddings shapes nothing, and a GPT-2 switching stable_embedding gains or loses
  embed_ln (its restore failed as a 'damaged' checkpoint)."""

  def check(saved, **model):
    checkpoints.check_compatible(saved, small_config(model=model), 'the checkpoint')

  bloom = small_config()
  with pytest.raises(ConfigError, match=r'model.ffn_hidden_size: checkpoint 256 vs config 512\.'):
    check(bloom, ffn_hidden_size=512)
  check(bloom, max_position_embeddings=4096)  # no refusal
  gpt2 = dict(architecture='gpt2', max_position_embeddings=64)
  with pytest.raises(ConfigError, match='model.stable_embedding: checkpoint False vs config True'):
    check(small_config(model=gpt2), **gpt2, stable_embedding=True)
  with pytest.raises(
    ConfigError, match='model.max_position_embeddings: checkpoint 64 vs config 32'
  ):
    check(small_config(model=gpt2), **{**gpt2, 'max_position_embeddings': 32})
