"""Crash- and race-safe file writes for shipped assets and on-disk caches."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import BinaryIO


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
