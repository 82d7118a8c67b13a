"""When the training loop saves: checkpoint.save_interval as hooks (t5x_like/hooks.py).

A save every save_interval iterations (Checkpointer.should_save; 0: none in between), never in
the middle of non-finite iterations (a divergence keeps the last finite state), and one at the
end or before leaving early, after which the save in flight is waited for. A save that finds
non-finite params writes nothing and stops the run as diverged.
"""

from __future__ import annotations

from collections.abc import Callable

from t5x_like.training import runtime


class CheckpointCadence:
  """`save(state, progress)` saves and returns whether the run goes on (False: the state was not
  finite, already reported); `should_save(iteration)` is the checkpointer's interval;
  `divergence` the run's watches.DivergenceWatch; `beat(what)` the watchdog's; `close()` waits
  for the save in flight."""

  def __init__(
    self,
    save: Callable,
    should_save: Callable[[int], bool],
    divergence,
    beat: Callable[[str], None],
    close: Callable[[], None],
  ):
    self.save, self.should_save, self.divergence = save, should_save, divergence
    self.beat, self.close = beat, close

  def iteration_hook(self, info) -> None:
    """After every iteration (every=1): a save when the interval says so."""
    if self.should_save(info.iteration) and not self.divergence.consecutive:
      if not self.save(info.state, info.progress):
        info.request_stop(runtime.StopReason.DIVERGED)

  def final_hook(self, info) -> None:
    """At the end and on a stop: the last save, unless nothing trained or the run diverged;
    then the checkpointer is closed (a failed save raises checkpoints.SaveError here)."""
    trained = info.iteration > info.start_iteration
    if trained and info.stop_reason is not runtime.StopReason.DIVERGED:
      self.beat(f'saving the checkpoint of iteration {info.iteration}')
      if not self.save(info.state, info.progress):
        info.stop_reason = runtime.StopReason.DIVERGED
    self.close()
