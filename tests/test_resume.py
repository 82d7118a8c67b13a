"""resume.resolve: where a run starts, a pure function of (config, workdir) that reads only the
checkpoints' metadata and writes nothing."""

import os

from conftest import small_config

from t5x_like.checkpointing import checkpoints
from t5x_like.mesh import partitioning
from t5x_like.parallel.train_state import Progress, make_layout
from t5x_like.training import resume


def save_checkpoint(workdir, cfg, progress, adam_count_base):
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  root = os.path.join(workdir, 'checkpoints')
  checkpointer = checkpoints.Checkpointer(root, 1, max_to_keep=3, layout=layout)
  meta = checkpoints.make_meta(cfg, progress, cfg.train.seed, adam_count_base)
  assert checkpointer.save(layout.init(0), progress, cfg, meta)
  checkpointer.close()


def listing(workdir):
  return sorted(
    (os.path.relpath(os.path.join(d, f), workdir), os.stat(os.path.join(d, f)).st_mtime_ns)
    for d, _, files in os.walk(workdir)
    for f in files
  )


def test_resume_plan_is_a_pure_function_of_config_and_workdir(tmp_path):
  workdir = str(tmp_path)
  software = {'python': 'test'}
  cfg = small_config(train=dict(seed=7))
  scratch = resume.resolve(cfg, workdir, software)
  assert (scratch.steps, scratch.step, scratch.progress, scratch.data_seed) == (
    [],
    None,
    Progress(),
    7,
  )
  assert scratch.adam_count_base == {'iteration': 0, 'skipped_iterations': 0}
  assert scratch.config == cfg and scratch.notes == []

  saved_progress = Progress(
    iteration=2, consumed_samples=16, consumed_tokens=256, skipped_iterations=1
  )
  save_checkpoint(workdir, cfg, saved_progress, {'iteration': 1, 'skipped_iterations': 0})
  before = listing(workdir)
  # The next job: more steps, another seed. The data order stays the checkpoint's; with
  # checkpoint.load_rng (the default) so does the dropout seed.
  wanted = small_config(train=dict(seed=11, steps=5))
  resumption = resume.resolve(wanted, workdir, software)
  assert resumption == resume.resolve(wanted, workdir, software)
  assert listing(workdir) == before  # nothing written, nothing moved
  assert (resumption.steps, resumption.step, resumption.progress) == ([2], 2, saved_progress)
  assert resumption.data_seed == 7 and resumption.config.train.seed == 7
  assert resumption.config_changes == ['train.steps: checkpoint 3 -> now 5']
  assert resumption.load_optimizer and not resumption.reset_optimizer
  assert resumption.adam_count_base == {'iteration': 1, 'skipped_iterations': 0}  # the checkpoint's
  assert (
    '> dropout seed 7 from the checkpoint (config: 11; checkpoint.load_rng=False would use '
    'it)' in resumption.notes
  )

  # checkpoint.load_optimizer=False: fresh Adam moments, whose step count starts at the resumed
  # iteration (and its skipped count).
  reset = resume.resolve(wanted.replace(checkpoint={'load_optimizer': False}), workdir, software)
  assert not reset.load_optimizer and reset.reset_optimizer
  assert reset.adam_count_base == {'iteration': 2, 'skipped_iterations': 1}
  # checkpoint.load_rng=False: the config's dropout seed, the checkpoint's data order.
  own_seed = resume.resolve(wanted.replace(checkpoint={'load_rng': False}), workdir, software)
  assert (own_seed.config.train.seed, own_seed.data_seed) == (11, 7)
  assert 'train.seed: checkpoint 7 -> now 11' in own_seed.config_changes
