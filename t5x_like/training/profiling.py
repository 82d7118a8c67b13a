"""JAX profiler traces of chosen iterations: a range (`runtime.profile_steps`, e.g. '20-25') and,
with `runtime.profile_every_mins`, one of `runtime.profile_length` iterations each time that
many minutes passed, timed by clu's periodic actions (`clu.periodic_actions.PeriodicCallback`).

Each trace goes under the TensorBoard directory, `plugins/profile/<date_time>/<host>.xplane.pb`
(with `<host>.trace.json.gz` and `perfetto_trace.json.gz` beside it), where TensorBoard's Profile
tab finds it; ui.perfetto.dev opens the `.json.gz` files (docs/monitoring.md). One process
(`runtime.profile_process`) records them. Every iteration is a `StepTraceAnnotation('train',
step_num=iteration)`, traced or not, so a trace captured from outside (`jax.profiler` server,
TensorBoard's "Capture profile") shows the steps too.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable

import jax

from t5x_like.data.tf_runtime import import_tensorflow
from t5x_like.errors import ConfigError


class Profiler:
  """Brackets each iteration (`before_iteration`, `after_iteration`) and traces the iterations
  `steps` = (first, last) if this is process `process`; `close()` ends a trace that an
  early stop left open. A resumed run inside the range traces the range's remaining iterations.
  `every_mins` > 0: `register(hooks)` adds the hook that asks for a trace of the `length`
  iterations after the one that ended once that many minutes (of `clock`, seconds) passed since
  the last periodic trace, or since the job's first iteration. `log`: a function that prints a
  line to the run's log."""

  def __init__(
    self,
    steps: tuple[int, int] | None,
    log_dir: str,
    process: int,
    log=print,
    every_mins: float = 0.0,
    length: int = 3,
    clock: Callable[[], float] = time.monotonic,
  ):
    if (steps or every_mins) and not 0 <= process < jax.process_count():
      raise ConfigError(
        f'runtime.profile_process={process} names no process of this job '
        f'(0-{jax.process_count() - 1}); pick one of them'
      )
    records = process == jax.process_index()
    # The ranges still to trace, (first, last) each; a range is dropped once an iteration after
    # its first one starts outside a trace.
    self.pending: list[tuple[int, int]] = [steps] if steps and records else []
    self.log_dir = log_dir
    self.log = log
    self.length = length
    self.clock = clock
    self.tracing: tuple[int, int] | None = None  # the range being traced
    self.tracing_since: int | None = None  # the first traced iteration while tracing
    # Each written trace: (first, last); last None: stopped inside the first iteration.
    self.traces: list[tuple[int, int | None]] = []
    # The wall-clock second the last trace was written in: a trace's directory is named by its
    # second, so a trace that ended within the same one would overwrite it.
    self.last_written_second: int | None = None
    self.periodic = None
    if every_mins and records:
      import_tensorflow()  # clu's modules import it; its GPUs hidden first
      from clu import periodic_actions  # pylint: disable=import-outside-toplevel

      self.periodic = periodic_actions.PeriodicCallback(
        every_secs=every_mins * 60.0, callback_fn=self.request_after
      )
    self._annotation: jax.profiler.StepTraceAnnotation | None = None
    self._last_ended: int | None = None

  def register(self, hooks) -> None:
    """The periodic traces' hook, after every iteration (nothing without `every_mins`)."""
    if self.periodic is not None:
      hooks.add_hook(self.periodic_hook)

  def periodic_hook(self, info) -> None:
    assert self.periodic is not None
    self.periodic(info.iteration, t=self.clock())

  def request_after(self, step: int, t: float) -> None:
    """clu's callback: a trace of the `length` iterations after `step`, unless one is being
    traced or one still to trace overlaps them (the periodic timer counts from now all the
    same)."""
    del t
    wanted = (step + 1, step + self.length)
    if self.tracing is None and all(
      last < wanted[0] or first > wanted[1] for first, last in self.pending
    ):
      self.pending.append(wanted)

  def before_iteration(self, iteration: int) -> None:
    """`iteration` (1-based, the one about to run) starts."""
    if self.tracing is None and self.pending:
      self.pending = [r for r in self.pending if r[1] >= iteration]
      due = [r for r in self.pending if r[0] <= iteration]
      if due:
        self.pending.remove(due[0])
        self._start(due[0], iteration)
    self._annotation = annotation = jax.profiler.StepTraceAnnotation('train', step_num=iteration)
    annotation.__enter__()

  def after_iteration(self, iteration: int) -> None:
    """`iteration` has ended, its results on the host."""
    if self._annotation is not None:
      annotation, self._annotation = self._annotation, None
      annotation.__exit__(None, None, None)
    self._last_ended = iteration
    if self.tracing is not None and iteration >= self.tracing[1]:
      self._stop()

  def close(self) -> None:
    """Ends an annotation or a trace still open (an early stop, an error)."""
    if self._annotation is not None:
      annotation, self._annotation = self._annotation, None
      annotation.__exit__(None, None, None)
    if self.tracing is not None:
      self._stop()

  def _start(self, traced: tuple[int, int], iteration: int) -> None:
    while self.last_written_second is not None and int(time.time()) <= self.last_written_second:
      time.sleep(0.05)
    jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
    self.tracing, self.tracing_since = traced, iteration

  def _stop(self) -> None:
    first, self.tracing, self.tracing_since = self.tracing_since, None, None
    assert first is not None, 'no trace is running'
    jax.profiler.stop_trace()
    self.last_written_second = int(time.time())
    last = self._last_ended if self._last_ended is not None and self._last_ended >= first else None
    self.traces.append((first, last))
    runs = sorted(glob.glob(os.path.join(self.log_dir, 'plugins', 'profile', '*')))
    where = runs[-1] if runs else self.log_dir
    ended = f'-{last}' if last is not None else ' (stopped before it ended)'
    self.log(
      f'> profile: iterations {first}{ended} traced to '
      f'{where} (TensorBoard: tensorboard --logdir {self.log_dir}, Profile tab; '
      'Perfetto: open its perfetto_trace.json.gz at ui.perfetto.dev)'
    )
