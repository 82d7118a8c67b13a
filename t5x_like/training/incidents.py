"""What a run tells its user when a watch fires: a loss or grad-norm spike, or a divergence
(watches.SpikeWatch, watches.DivergenceWatch, a non-finite state at a save). Each report says
what to do next, with the chronicles' remedies, and is sent as an alert."""

from __future__ import annotations

from collections.abc import Callable

from t5x_like.training import alerts as alerts_lib
from t5x_like.training.watches import DivergenceWatch


class IncidentReports:
  """Writes the reports to the run's log (`log`) and sends them (`alerts`). What the run does at
  a spike or a divergence (keep a checkpoint, save the last finite state) is
  run_checkpoints.RunCheckpoints': it says which checkpoints there are."""

  def __init__(
    self,
    log: Callable[[str], None],
    alerts: alerts_lib.Alerts,
    workdir: str,
    ckpt_root: str,
    divergence: DivergenceWatch,
  ):
    self.log, self.alerts, self.workdir, self.ckpt_root = log, alerts, workdir, ckpt_root
    self.divergence = divergence

  def spike(self, message: str, iteration: int, kept: int | None) -> None:
    """A spike, with the checkpoint from before it (`kept`: kept past the keep policy, None when
    no checkpoint was saved before it) and the command that shows the batch it trained on."""
    where = (
      f'checkpoint {kept} (the last before it) is kept past checkpoint.max_to_keep'
      if kept is not None
      else 'no checkpoint was saved before it'
    )
    self.log(
      f'{message}. {where}; its batch: python -m t5x_like.data batch '
      f'{self.workdir} --iteration {iteration}'
    )
    self.alerts.send('spike', message, iteration)

  def diverged(self, message: str, saved: list[int]) -> None:
    """A divergence, and what to do about it (`saved`: the checkpoint steps, oldest first)."""
    before = saved[-1] if saved else None
    first = self.divergence.first_non_finite or self.divergence.last_finite.iteration + 1
    rollback = (
      f'rerun: the next run resumes from checkpoint {before}, the last finite state; to start '
      'from an earlier one, from before the trouble began, first run python -m t5x_like.ckpt '
      f'rollback {self.ckpt_root} --to STEP'
      if before is not None
      else 'no checkpoint was saved: rerun from scratch'
    )
    self.log(
      f"{message}. What to try (the BLOOM runs' remedies): {rollback}; skip the data that "
      f'diverged with --config.data.skip_train_iteration_range="(\'{first}-{first + 99}\',)" '
      f'(its batch: python -m t5x_like.data batch {self.workdir} --iteration {first}); lower '
      'optimizer.lr (with checkpoint.override_lr_scheduler=True); or reset the optimizer '
      '(checkpoint.load_optimizer=False with checkpoint.reset_warmup_iterations=N: lr 0 while '
      'the Adam moments warm up, docs/checkpoints.md, "Restart controls")'
    )
    self.alerts.send('diverged', message, self.divergence.last_finite.iteration)
