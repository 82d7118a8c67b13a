"""TensorBoard event files through `clu.metric_writers`, TensorFlow imported only when used.

TensorFlow takes a few seconds to import and, left alone, claims every GPU of the process beside
JAX. It is imported on the first write, when TensorBoard output is on (`runtime.tensorboard_dir`),
and the GPUs are hidden from it before it initialises, as t5x does.

A resumed run writes its iterations again from the checkpoint on. TensorBoard drops a run's
earlier events from step N on when it reads a SessionLog START at step N in a later file (the
purge PyTorch's `SummaryWriter(purge_step=N)` writes); TF2's summary writer has no call for it, so
a resumed run writes that one event, with TensorFlow's record writer and Event proto, in a file
named to sort between the earlier files and the one its writer opens next (`write_purge`).
"""

from __future__ import annotations

import os
import socket
import time

from t5x_like.data.tf_runtime import import_tensorflow


def _seconds(name: str) -> int:
  """The <seconds> of an event file's name `events.out.tfevents.<seconds>.<host>...`."""
  field = name.split('tfevents.', 1)[-1].split('.', 1)[0]
  return int(field) if field.isdigit() else 0


def write_purge(directory: str, step: int) -> str:
  """Writes the SessionLog START at `step` (TensorBoard drops the events of the earlier files of
  `directory` from `step` on) in a file of its own; returns its path.

  TensorBoard reads a run's files in name order. TensorFlow names its files
  `events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2` (n counts the process's writers: 10 sorts
  before 9); this one is `events.out.tfevents.<seconds>.<host>.<pid>.-purge`, in a second later
  than every file there (a resume within the second of the last write, as tests do, waits for
  the next), so it sorts after all of them and, '-' sorting before the digits, before the file
  the writer opens next. Files stamped ahead of this clock by more than 2 s (another node's)
  get it named after the newest of them instead.
  """
  tf = import_tensorflow()
  os.makedirs(directory, exist_ok=True)
  names = [n for n in os.listdir(directory) if 'tfevents' in n]
  newest = max(map(_seconds, names), default=0)
  deadline = time.time() + 2.0
  while int(time.time()) <= newest and time.time() < deadline:
    time.sleep(0.05)
  name = f'events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.-purge'
  if int(time.time()) <= newest:
    name = max(names) + '.purge'
  path = os.path.join(directory, name)
  version = tf.compat.v1.Event(wall_time=time.time(), step=0, file_version='brain.Event:2')
  start = tf.compat.v1.Event(
    wall_time=time.time(),
    step=step,
    session_log=tf.compat.v1.SessionLog(status=tf.compat.v1.SessionLog.START),
  )
  with tf.io.TFRecordWriter(path) as records:
    records.write(version.SerializeToString())
    records.write(start.SerializeToString())
  return path


class RunWriter:
  """One TensorBoard run (a directory): scalars and texts through clu's `SummaryWriter`, each
  write flushed at once (a killed job loses no event). `purge_from`: a resumed run, whose earlier
  events from that step on TensorBoard drops."""

  def __init__(self, directory: str, purge_from: int | None = None):
    import_tensorflow()
    from clu import metric_writers  # pylint: disable=import-outside-toplevel

    if purge_from is not None:
      write_purge(directory, purge_from)
    self.writer = metric_writers.SummaryWriter(directory)

  def scalars(self, step: int, values: dict[str, float]) -> None:
    self.writer.write_scalars(step, values)
    self.writer.flush()

  def texts(self, step: int, texts: dict[str, str]) -> None:
    self.writer.write_texts(step, texts)
    self.writer.flush()

  def close(self) -> None:
    self.writer.close()
