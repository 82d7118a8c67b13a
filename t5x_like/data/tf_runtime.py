"""TensorFlow, for the libraries that need it (seqio's data pipelines, clu's metric writers):
imported only by them, through `import_tensorflow`.

TensorFlow's C++ start-up writes straight to file descriptor 2, below Python and before any of
its logging settings apply (TF_CPP_MIN_LOG_LEVEL does not reach these lines in TF 2.21): 'All log
messages before absl::InitializeLog() ...', oneDNN's notice, 'Could not find cuda drivers', the
CPU instruction notice and, when the GPUs are hidden on a machine without a driver, 'failed call
to cuInit: ... UNKNOWN ERROR (303)', which reads like a failure of the run. They are caught while
TensorFlow starts and dropped, unless the import fails: then they are printed, as they explain why.

Layer 1 (data): imports nothing of the package.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Any

_LOCK = threading.Lock()


def import_tensorflow() -> Any:
  """TensorFlow, started quietly, with the GPUs hidden from it: only JAX uses them."""
  if 'tensorflow' in sys.modules:  # started by someone else: only hide the GPUs
    return _hide_gpus(sys.modules['tensorflow'])
  with _LOCK, tempfile.TemporaryFile() as captured:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow as tf  # pylint: disable=import-outside-toplevel

      _hide_gpus(tf)
    except BaseException:
      os.dup2(saved, 2)
      captured.seek(0)
      sys.stderr.write(captured.read().decode(errors='replace'))
      raise
    finally:
      os.dup2(saved, 2)
      os.close(saved)
  return tf


def _hide_gpus(tf: Any) -> Any:
  try:
    tf.config.set_visible_devices([], 'GPU')
  except RuntimeError:  # TensorFlow was initialised before: whoever did chose its devices
    pass
  return tf
