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
  `steps` = (first, last) if this is process `process`. A resumed run inside the range traces
  the range's remaining iterations. `every_mins` > 0: once that many minutes (of `clock`,
  seconds) passed since the last periodic trace, or since the job's first iteration, a trace of
  the next `length` iterations that train, unless a trace is running or it would overlap the
  range. `register(hooks)` adds the periodic hook and ends a trace still open when the loop ends
  (before the final save) or stops; `close()` ends one an error left open. A trace that cannot
  start or stop (another profiling session, a full disk) is logged and the run goes on. `log`: a
  function that prints a line to the run's log."""

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
    # The range still to trace, (first, last); dropped once an iteration after it starts.
    self.pending: tuple[int, int] | None = steps if steps and records else None
    self.log_dir = log_dir
    self.log = log
    self.length = length
    self.clock = clock
    self.periodic_due = False  # a periodic trace starts at the next iteration that trains
    self.tracing: tuple[int, int] | None = None  # the range being traced
    self.tracing_since: int | None = None  # the first traced iteration while tracing
    # Each written trace: (first, last); last None: stopped inside the first iteration.
    self.traces: list[tuple[int, int | None]] = []
    # The wall-clock second the last trace was written in: a trace's directory is named by its
    # second, so a trace that ended within the same one would overwrite it.
    self.last_written_second: int | None = None
    # Why no trace starts any more in this process (a trace that could not stop leaves jax's
    # profiler started); '' while they can.
    self.broken = ''
    self.periodic = None
    if every_mins and records:
      import_tensorflow()  # clu's modules import it; its GPUs hidden first
      from clu import periodic_actions  # pylint: disable=import-outside-toplevel

      self.periodic = periodic_actions.PeriodicCallback(
        every_secs=every_mins * 60.0, callback_fn=self.request_periodic
      )
    self._annotation: jax.profiler.StepTraceAnnotation | None = None
    self._last_ended: int | None = None

  def register(self, hooks) -> None:
    """The periodic traces' hook (with `every_mins`), and the end of a trace still open when
    the loop ends or stops, before the hooks that save and evaluate."""
    if self.periodic is not None:
      hooks.add_hook(self.periodic_hook)
    hooks.at_end(self.end_hook)
    hooks.on_stop(self.end_hook)

  def periodic_hook(self, info) -> None:
    assert self.periodic is not None
    self.periodic(info.iteration, t=self.clock())

  def end_hook(self, info) -> None:
    del info
    self.close()

  def request_periodic(self, step: int, t: float) -> None:
    """clu's callback after iteration `step`: the periodic trace is due, unless one is being
    traced (the timer counts from now all the same)."""
    del step, t
    if self.tracing is None:
      self.periodic_due = True

  def before_iteration(self, iteration: int) -> None:
    """`iteration` (1-based, the one about to run and train) starts."""
    if self.tracing is None:
      if self.pending and self.pending[1] < iteration:
        self.pending = None
      periodic, self.periodic_due = self.periodic_due, False
      if self.pending and self.pending[0] <= iteration:
        traced, self.pending = self.pending, None
        self._start(traced, iteration)
      elif periodic and (not self.pending or iteration + self.length - 1 < self.pending[0]):
        self._start((iteration, iteration + self.length - 1), iteration)
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
    """Ends an annotation or a trace still open (the end of the loop, an early stop, an
    error)."""
    if self._annotation is not None:
      annotation, self._annotation = self._annotation, None
      annotation.__exit__(None, None, None)
    if self.tracing is not None:
      self._stop()

  def _start(self, traced: tuple[int, int], iteration: int) -> None:
    if self.broken:
      return
    while self.last_written_second is not None and int(time.time()) <= self.last_written_second:
      time.sleep(0.05)
    try:
      jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
    except Exception as e:  # pylint: disable=broad-except
      self.log(
        f'> profile: iterations {traced[0]}-{traced[1]} not traced: the profiler did not start '
        f'({type(e).__name__}: {e}); training goes on'
      )
      return
    self.tracing, self.tracing_since = traced, iteration

  def _stop(self) -> None:
    first, self.tracing, self.tracing_since = self.tracing_since, None, None
    assert first is not None, 'no trace is running'
    try:
      jax.profiler.stop_trace()
    except Exception as e:  # pylint: disable=broad-except
      self.broken = f'{type(e).__name__}: {e}'
      self.log(
        f'> profile: the trace from iteration {first} could not be written ({self.broken}); '
        'no more traces in this job, training goes on'
      )
      return
    finally:
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
