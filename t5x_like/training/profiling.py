"""A JAX profiler trace of chosen iterations (`runtime.profile_steps`, e.g. '20-25').

The trace goes under the TensorBoard directory, `plugins/profile/<date>/<host>.xplane.pb` (with
`<host>.trace.json.gz` and `perfetto_trace.json.gz` beside it), where TensorBoard's Profile tab
finds it; ui.perfetto.dev opens the `.json.gz` files (docs/monitoring.md). One process
(`runtime.profile_process`) records it. Every iteration is a `StepTraceAnnotation('train',
step_num=iteration)`, traced or not, so a trace captured from outside (`jax.profiler` server,
TensorBoard's "Capture profile") shows the steps too.
"""

from __future__ import annotations

import glob
import os

import jax

from t5x_like.errors import ConfigError


class Profiler:
  """Brackets each iteration (`before_iteration`, `after_iteration`) and traces the iterations
  `steps` = (first, last) if this is process `process`; `close()` ends a trace that an
  early stop left open. A resumed run inside the range traces the range's remaining iterations.
  `log`: a function that prints a line to the run's log."""

  def __init__(self, steps: tuple[int, int] | None, log_dir: str, process: int, log=print):
    if steps and not 0 <= process < jax.process_count():
      raise ConfigError(
        f'runtime.profile_process={process} names no process of this job '
        f'(0-{jax.process_count() - 1}); pick one of them'
      )
    self.steps = steps if process == jax.process_index() else None
    self.log_dir = log_dir
    self.log = log
    self.tracing_since: int | None = None  # the first traced iteration while tracing
    # (first, last) once a trace is written; last None: stopped inside the first iteration.
    self.traced: tuple[int, int | None] | None = None
    self._annotation: jax.profiler.StepTraceAnnotation | None = None
    self._last_ended: int | None = None

  def before_iteration(self, iteration: int) -> None:
    """`iteration` (1-based, the one about to run) starts."""
    if (
      self.steps
      and self.tracing_since is None
      and self.traced is None
      and self.steps[0] <= iteration <= self.steps[1]
    ):
      jax.profiler.start_trace(self.log_dir, create_perfetto_trace=True)
      self.tracing_since = iteration
    self._annotation = annotation = jax.profiler.StepTraceAnnotation('train', step_num=iteration)
    annotation.__enter__()

  def after_iteration(self, iteration: int) -> None:
    """`iteration` has ended, its results on the host."""
    if self._annotation is not None:
      annotation, self._annotation = self._annotation, None
      annotation.__exit__(None, None, None)
    self._last_ended = iteration
    if self.tracing_since is not None and self.steps and iteration >= self.steps[1]:
      self._stop()

  def close(self) -> None:
    """Ends an annotation or a trace still open (an early stop, an error)."""
    if self._annotation is not None:
      annotation, self._annotation = self._annotation, None
      annotation.__exit__(None, None, None)
    if self.tracing_since is not None:
      self._stop()

  def _stop(self) -> None:
    first, self.tracing_since = self.tracing_since, None
    assert first is not None, 'no trace is running'
    jax.profiler.stop_trace()
    last = self._last_ended if self._last_ended is not None and self._last_ended >= first else None
    self.traced = (first, last)
    runs = sorted(glob.glob(os.path.join(self.log_dir, 'plugins', 'profile', '*')))
    where = runs[-1] if runs else self.log_dir
    ended = f'-{last}' if last is not None else ' (stopped before it ended)'
    self.log(
      f'> profile: iterations {first}{ended} traced to '
      f'{where} (TensorBoard: tensorboard --logdir {self.log_dir}, Profile tab; '
      'Perfetto: open its perfetto_trace.json.gz at ui.perfetto.dev)'
    )
