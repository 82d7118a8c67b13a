"""launch/slurm/train.sbatch's handling of the trainer's exit code, run by bash with stand-ins
for `srun` and `scancel` on PATH that record their command lines."""

import os
import stat
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'launch', 'slurm', 'train.sbatch')


def run_job(tmp_path, srun_exit: int, array_job_id: str | None):
  """The script's exit code and the commands it ran, with `srun` exiting `srun_exit`."""
  bin_dir, calls = tmp_path / 'bin', tmp_path / 'calls'
  bin_dir.mkdir()
  for name, code in (('srun', srun_exit), ('scancel', 0)):
    path = bin_dir / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\nexit {code}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
  env = {k: v for k, v in os.environ.items() if k != 'SLURM_ARRAY_JOB_ID'}
  env['PATH'] = f'{bin_dir}:{env["PATH"]}'
  if array_job_id is not None:
    env['SLURM_ARRAY_JOB_ID'] = array_job_id
  done = subprocess.run(
    ['bash', SCRIPT, 'configs/tiny.py', '/shared/run', '--config.train.steps=3'],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  return done.returncode, calls.read_text().splitlines(), done.stderr


@pytest.mark.parametrize(
  'code, cancels',
  [(0, True), (1, False), (2, True), (3, False), (4, False), (5, True)],
)
def test_a_job_cancels_its_arrays_pending_jobs_when_the_next_would_end_the_same_way(
  code, cancels, tmp_path
):
  """Finished (or the kill switch), bad input, diverged: the array's next job would do nothing
  or fail the same way, so the pending ones are cancelled. Crashed, requeue, hung: the next
  job resumes. The job's own exit code is the trainer's either way."""
  exit_code, calls, stderr = run_job(tmp_path, code, array_job_id='4242')
  assert exit_code == code
  assert calls[0] == (
    'srun --wait=60 --kill-on-bad-exit=1 python -m t5x_like.train --config configs/tiny.py '
    '--workdir /shared/run --config.train.steps=3'
  )
  assert calls[1:] == (['scancel --state=PENDING 4242'] if cancels else [])
  assert ('cancelling the pending jobs of array 4242' in stderr) == cancels


def test_a_job_outside_an_array_cancels_nothing(tmp_path):
  exit_code, calls, _ = run_job(tmp_path, 0, array_job_id=None)
  assert exit_code == 0 and [c.split()[0] for c in calls] == ['srun']
