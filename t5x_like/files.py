"""Crash- and race-safe file writes, and the check that an output can be written before the work
that makes it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO

from t5x_like.errors import ConfigError


def atomic_write(path: str, write: Callable[[BinaryIO], object]) -> None:
  """Calls write(file) on a temporary file beside `path`, then renames it into place.

  os.replace is atomic within a filesystem, so readers see either the old file or the complete
  new one, even when several processes write the same path at once or one of them crashes midway.
  """
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, temp_path = tempfile.mkstemp(dir=directory, prefix='.tmp-')
  try:
    with os.fdopen(fd, 'wb') as f:
      write(f)
    # mkstemp creates owner-only files; caches and assets are meant to be shared read-only.
    os.chmod(temp_path, 0o644)
    os.replace(temp_path, path)
  except BaseException:
    os.unlink(temp_path)
    raise


def make_dirs(path: str) -> list[str]:
  """os.makedirs(path), returning the directories it made, innermost first (for
  remove_made_dirs: a refused or failed command leaves none behind)."""
  made, directory = [], os.path.abspath(path)
  while not os.path.lexists(directory):
    made.append(directory)
    directory = os.path.dirname(directory)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:  # part of the way: what it made goes again
    remove_made_dirs(made)
    raise
  return made


def remove_made_dirs(made: list[str]) -> None:
  """Removes make_dirs' directories, innermost first, while they are empty (files someone else
  put there since are left, with the directories that hold them)."""
  for directory in made:
    try:
      os.rmdir(directory)
    except OSError:
      return


def nearest_existing(path: str) -> str:
  """`path` or the nearest of its parents that exists (a relative path: from the working
  directory)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path


def check_writable(path: str, what: str, fix: str) -> None:
  """Refuses `path` (a directory a command will create or write to) with one ConfigError when it
  cannot be: a file in its way, or a read-only or unwritable directory. Nothing is left behind."""
  existing = nearest_existing(path)
  if not os.path.isdir(existing):
    raise ConfigError(f'{what} {path} cannot be created: {existing} is a file; {fix}')
  try:
    probe = os.path.join(existing, f'.t5x_like_write_probe_{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(
      f'{what} {path} is not writable ({e.strerror} in {existing}); {fix}'
    ) from None
