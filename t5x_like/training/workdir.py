"""The run's workdir: its path, its lock, and what must be writable before a run starts.

A run changes its workdir only once every check that can refuse it has passed (Trainer.start):
a refused run leaves the workdir as it found it. Two trainers on one workdir would interleave
their records and checkpoints, so the workdir is locked for the whole run: an exclusive
`flock` on WORKDIR/trainer.lock, held by process 0 (the lock is released by the kernel when
the process dies, so a lock left by a killed trainer never blocks the next one). The lock file
says which host and process hold it, for the message that refuses a second trainer.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from typing import Any

from t5x_like.errors import ConfigError
from t5x_like.files import atomic_write, check_writable, make_dirs, remove_made_dirs

LOCK_FILE = 'trainer.lock'


def resolve(workdir: str | None) -> str:
  """The absolute workdir; an empty or blank one (an unset $WORKDIR) or a file is refused."""
  if workdir is None or not str(workdir).strip():
    raise ConfigError(
      '--workdir is empty (an unset shell variable?): pass the directory the run '
      'writes its checkpoints and logs to, e.g. --workdir /shared/runs/tr11'
    )
  path = os.path.abspath(os.path.expanduser(workdir))
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(f'workdir {path} is a file, not a directory; pass a directory')
  return path


class Lock:
  """The exclusive lock of a workdir; `acquire()` refuses a second trainer with a ConfigError
  naming the host and process that hold it. Creates the workdir if needed; `release()` removes
  what `acquire()` created when the run never started (`started=False`).

  The lock file is opened without following a symbolic link (a link is refused: the trainer
  writes nothing outside its workdir), and an existing one is rewritten with this process's
  name only by `mark_started()`: a refused run leaves its bytes as they were."""

  def __init__(self, workdir: str):
    self.workdir = workdir
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd: int | None = None
    # The workdir and the parents that acquire made, innermost first.
    self._created_dirs: list[str] = []
    self._created_file = False

  @property
  def held(self) -> bool:
    return self._fd is not None

  def acquire(self) -> None:
    self._created_dirs = []
    try:
      self._created_dirs = make_dirs(self.workdir)
      self._created_file = not os.path.lexists(self.path)
      fd = os.open(
        self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644
      )
    except OSError as e:
      remove_made_dirs(self._created_dirs)
      if e.errno == errno.ELOOP:
        raise ConfigError(
          f'{self.path} is a symbolic link (to {os.readlink(self.path)}); the '
          'trainer writes nothing outside its workdir: remove the link and '
          'rerun'
        ) from None
      raise ConfigError(
        f'workdir {self.workdir} is not writable ({e.strerror}); pass a '
        '--workdir that you can write to'
      ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
      os.close(fd)  # not a file this lock made: nothing to remove
      raise ConfigError(
        f'{self.path} is not a regular file; remove it and rerun (the trainer '
        'makes its own lock file)'
      )
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = os.pread(fd, 4096, 0).decode(errors='replace').strip()
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        if self._created_file:  # no file locks here: the file and directories made go again
          os.remove(self.path)
        remove_made_dirs(self._created_dirs)
        raise ConfigError(
          f'cannot lock workdir {self.workdir} ({e.strerror}); the filesystem '
          'may not support file locks: use a workdir on one that does'
        ) from None
      raise ConfigError(
        f'workdir {self.workdir} is in use by another trainer '
        f'({describe_holder(holder)}); wait for it to end, stop it, or pass '
        'another --workdir'
      ) from None
    self._fd = fd
    if self._created_file:  # removed again if the run is refused
      self._write_holder(fd)

  def mark_started(self) -> None:
    """The run starts: the lock file names this process (for the message refusing another)."""
    if self._fd is not None and not self._created_file:
      self._write_holder(self._fd)

  def _write_holder(self, fd: int) -> None:
    holder = (
      json.dumps(
        {
          'host': socket.gethostname(),
          'pid': os.getpid(),
          'since': time.strftime('%Y-%m-%d %H:%M:%S'),
        }
      )
      + '\n'
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode(), 0)

  def release(self, started: bool = True) -> None:
    """Lets the lock go. A run that never started removes the lock file, the workdir and the
    parent directories acquire created, so a refused run leaves no trace."""
    if self._fd is None:
      return
    if not started and self._created_file:
      try:
        os.remove(self.path)
      except OSError:
        pass  # someone else's files appeared meanwhile: leave them
      remove_made_dirs(self._created_dirs)
    os.close(self._fd)  # closing the only descriptor releases the flock
    self._fd = None


def atomic_write_text(path: str, text: str) -> None:
  """Writes `text` to `path` through a temporary file and a rename: never a half-written file."""
  atomic_write(path, lambda f: f.write(text.encode()))


def describe_holder(text: str) -> str:
  """The holder a lock file names; a holder that is gone is the earlier run that wrote it (the
  file names the new holder only once its run starts)."""
  try:
    holder = json.loads(text)
    described = f'host {holder["host"]}, pid {holder["pid"]}, since {holder["since"]}'
  except (ValueError, KeyError, TypeError):
    return f'see {LOCK_FILE}'
  if holder['host'] == socket.gethostname() and not _process_exists(holder['pid']):
    return f'one still starting up; {LOCK_FILE} names the earlier run: {described}'
  return described


def _process_exists(pid: Any) -> bool:
  try:
    os.kill(int(pid), 0)
  except (ValueError, TypeError, ProcessLookupError):
    return False
  except PermissionError:
    return True  # another user's process
  return True


# The files a run appends to or rewrites in its workdir (metrics.py, alerts.py, data/replay.py,
# resume.py); none may be a link that would carry its writes outside the workdir.
RUN_FILES = (
  'config.json',
  'config_history.jsonl',
  'metrics.jsonl',
  'eval_metrics.jsonl',
  os.path.join('logs', 'main_log.txt'),
  os.path.join('logs', 'alerts.log'),
)


def check_run_files(workdir: str) -> None:
  """Refuses a run file of `workdir` that is a symbolic link or not a regular file."""
  for name in RUN_FILES:
    path = os.path.join(workdir, name)
    if os.path.islink(path):
      raise ConfigError(
        f'{path} is a symbolic link (to {os.readlink(path)}); the trainer writes '
        'nothing outside its workdir: replace the link by the file it points to '
        '(or remove it) and rerun'
      )
    if os.path.exists(path) and not os.path.isfile(path):
      raise ConfigError(f'{path} is not a regular file; move it away and rerun')


def check_run_outputs(workdir: str, tensorboard_dir: str, compilation_cache_dir: str) -> None:
  """Every directory a training run writes to can be written, before anything is: the workdir,
  its logs and checkpoints, runtime.tensorboard_dir and runtime.compilation_cache_dir; and its
  files are its own (check_run_files)."""
  check_run_files(workdir)
  outputs = [
    (workdir, 'the workdir', 'pass a --workdir that you can write to'),
    (
      os.path.join(workdir, 'logs'),
      'the log directory',
      'remove what is in its way in the workdir',
    ),
  ]
  if tensorboard_dir:
    outputs.append(
      (
        os.path.join(workdir, tensorboard_dir),
        'runtime.tensorboard_dir',
        "point it at a writable directory or set it to '' for no TensorBoard files",
      )
    )
  if compilation_cache_dir:
    outputs.append(
      (
        os.path.join(workdir, compilation_cache_dir),
        'runtime.compilation_cache_dir',
        "point it at a writable directory or set it to '' for no cache",
      )
    )
  outputs.append(
    (
      os.path.join(workdir, 'checkpoints'),
      'the checkpoint directory',
      'remove what is in its way in the workdir',
    )
  )
  for path, what, fix in outputs:
    check_writable(path, what, fix)


def lock_run(workdir: str, is_writer: bool, multi_process: bool) -> Lock:
  """The run's Lock of `workdir`: process 0 (the writer) takes it; every process learns whether
  it could (one verdict, so none goes on alone into a collective). Raises the ConfigError of a
  refusal."""
  lock, error = Lock(workdir), None
  if is_writer:
    try:
      lock.acquire()
    except ConfigError as e:
      error = e
  if multi_process:  # (JAX only here: train.py imports this module before JAX starts)
    import numpy as np
    from jax.experimental import multihost_utils

    locked = multihost_utils.process_allgather(np.int32(error is None))
    if error is None and not np.all(locked):
      error = ConfigError(f'process 0 could not lock workdir {workdir}; its message says why')
  if error is not None:
    lock.release(started=False)
    raise error
  return lock


def read_records(path: str, torn_tail_ok: bool = False) -> list[dict[str, Any]]:
  """The JSON records of a .jsonl file; any bad line is an error. With `torn_tail_ok`, a last
  line without its newline (one a kill tore mid-write, which a restart drops) is left out."""
  try:
    with open(path) as f:
      lines = f.readlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f'cannot read {path}: {e}') from None
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise ValueError(f'a JSON {type(record).__name__}, not an object')
    except ValueError as e:
      if torn_tail_ok and number == len(lines) and not line.endswith('\n'):
        continue
      raise ConfigError(
        f'{path}, line {number}: not a metrics record ({e}); the file is not one '
        'a run wrote, or it was edited'
      ) from None
    records.append(record)
  return records


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The iteration records of a run (WORKDIR/metrics.jsonl), every line whole."""
  return read_records(os.path.join(workdir, 'metrics.jsonl'))
