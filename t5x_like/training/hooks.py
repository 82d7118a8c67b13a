"""The training loop's hooks (Levanter's `TrainerHooks.add_hook(fn, every=N)`): what watches or
acts on a run registers here instead of living in the Trainer.

  trainer.hooks.add_hook(fn, every=N)   # fn(info: StepInfo) after every N-th iteration
  trainer.hooks.at_start(fn)            # fn(info) once training begins (the resumed position)
  trainer.hooks.at_end(fn)              # fn(info) after the last iteration (and its save)
  trainer.hooks.on_stop(fn)             # fn(info) when the run leaves early (info.stop_reason)

Iteration hooks run in the order they were added. A hook ends the run by calling
`info.request_stop(reason, message)`; the hooks after it are not called for that iteration and
the loop stops at once (the message is logged by the hook that asked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class StepInfo:
  """What a hook sees. `progress` is the run's train_state.Progress after the iteration (at
  start: the resumed one); `state` the train_state.TrainState after it; `record` the
  iteration's metrics record and `finite` whether its loss and gradient norm were finite, both
  None for an iteration that did not run the train step (data.skip_train_iteration_range; and
  at start, end and stop)."""

  progress: Any
  state: Any = None
  record: dict | None = None
  finite: bool | None = None
  start_iteration: int = 0  # the iteration this job resumed from
  stop_reason: Any = None  # a runtime.StopReason once a hook (or the loop) stops the run
  stop_message: str = ''
  message: str = ''  # at end and stop: the line that ends the log ('> done: ...')

  @property
  def iteration(self) -> int:
    return self.progress.iteration

  @property
  def trained(self) -> bool:
    """Whether this iteration ran the train step."""
    return self.finite is not None

  def request_stop(self, reason: Any, message: str = '') -> None:
    if self.stop_reason is None:
      self.stop_reason, self.stop_message = reason, message


@dataclasses.dataclass(frozen=True)
class Hook:
  fn: Callable[[StepInfo], None]
  every: int = 1
  name: str = ''


class Hooks:
  """The registered hooks of one run."""

  def __init__(self):
    self.iteration_hooks: list[Hook] = []
    self.start_hooks: list[Hook] = []
    self.end_hooks: list[Hook] = []
    self.stop_hooks: list[Hook] = []

  def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1, name: str = '') -> Hook:
    """`fn(info)` after every iteration whose number is a multiple of `every` (>= 1)."""
    if not isinstance(every, int) or every < 1:
      raise ValueError(f'a hook runs every N >= 1 iterations, got every={every!r}')
    hook = Hook(fn, every, name or getattr(fn, '__name__', repr(fn)))
    self.iteration_hooks.append(hook)
    return hook

  def at_start(self, fn: Callable[[StepInfo], None]) -> None:
    self.start_hooks.append(Hook(fn, name=getattr(fn, '__name__', repr(fn))))

  def at_end(self, fn: Callable[[StepInfo], None]) -> None:
    self.end_hooks.append(Hook(fn, name=getattr(fn, '__name__', repr(fn))))

  def on_stop(self, fn: Callable[[StepInfo], None]) -> None:
    self.stop_hooks.append(Hook(fn, name=getattr(fn, '__name__', repr(fn))))

  def run_iteration(self, info: StepInfo) -> None:
    """The hooks due at info.iteration, in order, until one requests a stop."""
    for hook in self.iteration_hooks:
      if info.iteration % hook.every == 0:
        hook.fn(info)
        if info.stop_reason is not None:
          return

  def run_start(self, info: StepInfo) -> None:
    for hook in self.start_hooks:
      hook.fn(info)

  def run_end(self, info: StepInfo) -> None:
    for hook in self.end_hooks:
      hook.fn(info)

  def run_stop(self, info: StepInfo) -> None:
    for hook in self.stop_hooks:
      hook.fn(info)
