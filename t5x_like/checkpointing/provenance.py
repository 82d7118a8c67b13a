"""What a run was made with, and what changed when it resumed.

The chronicles lost days to changes nobody saw: launch scripts edited in place with `perl -pi`
between jobs (learning rate, batch size, data), and a regression after a dependency upgrade
that took a week to trace to the upgrade. Every checkpoint's `meta` therefore records the
software that wrote it (`software()`), and a resumed run logs, before training, every config key
and software version that differs from its checkpoint's (`changes`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
from typing import Any

from t5x_like.config import Config

# Distributions whose version changes numerics, checkpoint format or collectives.
PACKAGES = (
  't5x_like',
  'jax',
  'jaxlib',
  'flax',
  'optax',
  'orbax-checkpoint',
  'tensorstore',
  'numpy',
)


def _git_commit(directory: str) -> str | None:
  """HEAD of the git checkout that holds `directory`, '+dirty' when it has changes; None outside
  a checkout (an installed wheel) or without git."""
  try:

    def git(*args):
      return subprocess.run(
        ['git', '-C', directory, *args], capture_output=True, text=True, timeout=10, check=True
      ).stdout.strip()

    commit = git('rev-parse', '--short=12', 'HEAD')
    dirty = git('status', '--porcelain', '--untracked-files=no')
  except (OSError, subprocess.SubprocessError):
    return None
  return commit + ('+dirty' if dirty else '')


def software() -> dict[str, Any]:
  """Versions of Python and of PACKAGES, the accelerator platform, and t5x_like's git commit."""
  versions: dict[str, Any] = {'python': platform.python_version()}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  versions['t5x_like_git'] = _git_commit(os.path.dirname(os.path.abspath(__file__)))
  return versions


def describe(versions: dict[str, Any]) -> str:
  """One log line: 'python 3.11.7, t5x_like 0.1.0 (git 1a2b3c), jax 0.10.2, ...'."""
  parts = []
  for name, version in versions.items():
    if name == 't5x_like_git':
      continue
    if name == 't5x_like' and versions.get('t5x_like_git'):
      version = f'{version} (git {versions["t5x_like_git"]})'
    parts.append(f'{name} {version}')
  return ', '.join(parts)


def _flatten(tree: dict[str, Any], prefix: str = '') -> dict[str, Any]:
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value and prefix == '':  # sections; mapping values stay whole
      flat.update(_flatten(value, f'{key}.'))
    else:
      flat[prefix + key] = value
  return flat


def config_changes(saved: Config, current: Config) -> list[str]:
  """'section.key: checkpoint VALUE -> now VALUE' for every config key that differs."""
  # Through JSON, as a checkpoint stores it: a tuple and the list it was saved as are equal.
  old, new = (_flatten(json.loads(json.dumps(c.to_dict()))) for c in (saved, current))
  return [
    f'{key}: checkpoint {old.get(key)!r} -> now {new.get(key)!r}'
    for key in sorted(old.keys() | new.keys())
    if old.get(key) != new.get(key)
  ]


def software_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[str]:
  """'NAME: checkpoint VERSION -> now VERSION' for every version that differs; nothing for a
  checkpoint that predates the record."""
  if not saved:
    return []
  return [
    f'{name}: checkpoint {saved.get(name)} -> now {current.get(name)}'
    for name in current
    if name in saved and saved[name] != current[name]
  ]
