"""What a run records about itself, and what a resume reports as changed."""

import re

import jax

from t5x_like.checkpointing import provenance
from t5x_like.config import Config


def test_software_names_the_versions_in_use_and_the_git_commit():
  versions = provenance.software()
  assert versions['jax'] == jax.__version__ and versions['t5x_like'] is not None
  commit = versions['t5x_like_git']
  assert commit is None or re.fullmatch(r'[0-9a-f]{7,12}(\+dirty)?', commit)
  line = provenance.describe(versions)
  assert f'jax {jax.__version__}' in line and line.startswith('python ')


def test_config_changes_name_every_changed_key_and_nothing_else():
  saved = Config.from_dict(
    {
      'train': dict(rampup_batch_size=(4, 4, 16), global_batch_size=8),
      'data': dict(valid_path={'en': '/d/en'}),
    }
  )
  # A config read back from a checkpoint's JSON has lists where the run had tuples: no change.
  assert provenance.config_changes(saved, Config.from_dict(saved.to_dict())) == []
  now = saved.replace(train={'global_batch_size': 16}, data={'valid_path': {'fr': '/d/fr'}})
  assert provenance.config_changes(saved, now) == [
    "data.valid_path: checkpoint [['en', '/d/en']] -> now [['fr', '/d/fr']]",
    'train.global_batch_size: checkpoint 8 -> now 16',
  ]


def test_software_changes_compare_the_recorded_versions():
  assert provenance.software_changes(
    {'jax': '0.1', 'flax': '0.2'}, {'jax': '0.1', 'flax': '0.3', 'optax': '1'}
  ) == ['flax: checkpoint 0.2 -> now 0.3']
  assert provenance.software_changes({}, {'jax': '0.1'}) == []  # an older checkpoint: no record
