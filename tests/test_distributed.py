"""Multi-process runs: two JAX processes on this CPU (gloo collectives) train exactly like one, find
each other from flags or from SLURM's environment, and stop together."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ALERT_RECORD, REPO, free_port, read_alerts, run_cli

from t5x_like.checkpointing import checkpoints
from t5x_like.config import ConfigError
from t5x_like.mesh import distributed

# configs/tiny.py made small enough to compile in seconds, on a data=2 x tensor=2 mesh: 2 virtual
# CPU devices in each of two processes. No evaluation (one compilation less) unless a test asks,
# no TensorBoard (clu's writer imports TensorFlow, half of a run's time; docs/tests.md).
SMALL_TINY = [
  '--config',
  os.path.join(REPO, 'configs', 'tiny.py'),
  '--config.model.num_layers=2',
  '--config.model.hidden_size=64',
  '--config.train.seq_len=32',
  '--config.mesh.data=2',
  '--config.mesh.tensor=2',
  '--config.eval.interval=0',
  '--config.runtime.tensorboard_dir=',
]


def start(args, env=None):
  full_env = {**os.environ, **(env or {})}
  return subprocess.Popen(
    [sys.executable, '-m', 't5x_like.train', *SMALL_TINY, *args],
    cwd=REPO,
    env=full_env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )


def finish(procs, timeout=300):
  """(returncode, stdout, stderr) of each process; a hang fails the test instead of blocking it."""
  out = []
  try:
    for p in procs:
      stdout, stderr = p.communicate(timeout=timeout)
      out.append((p.returncode, stdout, stderr))
  finally:
    for p in procs:
      p.kill()
  return out


def eval_metrics(workdir):
  with open(os.path.join(workdir, 'eval_metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def two_processes_by_flags(args):
  port = free_port()
  return [
    start(
      [
        *args,
        '--coordinator_address',
        f'localhost:{port}',
        '--num_processes',
        '2',
        '--process_id',
        str(i),
      ]
    )
    for i in range(2)
  ]


def two_processes_under_slurm(args, job_id):
  """Two tasks as `srun --ntasks=2` on one node would start them: JAX's SLURM detection runs."""
  port = free_port()
  return [
    start(
      args,
      env={
        'SLURM_JOB_ID': str(job_id),
        'SLURM_STEP_NODELIST': 'localhost',
        'SLURM_NTASKS': '2',
        'SLURM_PROCID': str(i),
        'SLURM_LOCALID': str(i),
        'JAX_COORDINATOR_PORT': str(port),
      },
    )
    for i in range(2)
  ]


def wait_for_iterations(workdir, count, procs, timeout=240):
  deadline = time.monotonic() + timeout
  path = os.path.join(workdir, 'metrics.jsonl')
  while not (os.path.exists(path) and len(metrics(workdir)) >= count):
    if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
      for p in procs:  # killed first, so that reading their output cannot block
        p.kill()
      pytest.fail(f'no iteration {count}: {procs[0].communicate()[1][-3000:]}')
    time.sleep(0.2)


def test_two_processes_train_exactly_like_one_and_one_process_resumes_their_checkpoint(tmp_path):
  multi, single = str(tmp_path / 'multi'), str(tmp_path / 'single')
  saves = ['--config.checkpoint.save_interval=2', '--config.eval.interval=2']
  # All three processes at once: most of their time is compiling, which is single-threaded.
  results = finish(
    two_processes_by_flags(['--config.train.steps=4', *saves, '--workdir', multi])
    + [start(['--config.train.steps=6', *saves, '--workdir', single])]
  )
  for code, _, stderr in results:
    assert code == 0, stderr[-3000:]
  # Only process 0 logs and writes metrics: one line per iteration, not one per process.
  assert 'iteration        4/       4' in results[0][1] and 'iteration' not in results[1][1]
  assert [r['iteration'] for r in metrics(multi)] == [1, 2, 3, 4]
  assert sorted(os.listdir(os.path.join(multi, 'checkpoints'))) == ['2', '4']

  # The two processes' checkpoint restores in one process (each reads the slices it holds).
  code, stdout, stderr = finish([start(['--config.train.steps=6', *saves, '--workdir', multi])])[0]
  assert code == 0 and f'resumed from {multi}/checkpoints/4' in stdout, stderr[-3000:]
  a, b = metrics(multi), metrics(single)
  assert [r['iteration'] for r in a] == [r['iteration'] for r in b] == [1, 2, 3, 4, 5, 6]
  for x, y in zip(a, b):
    for key in ('lm_loss', 'grad_norm', 'learning_rate', 'consumed_samples'):
      assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x['iteration'], key)
  # Evaluation, one SPMD program over both processes, gives the single process's losses.
  # (The two processes' run of 4 iterations also evaluated the test split at its end, 4.)
  a = [r for r in eval_metrics(multi) if (r['iteration'], r['set']) != (4, 'test')]
  b = eval_metrics(single)
  assert (
    [(r['iteration'], r['set']) for r in a]
    == [(r['iteration'], r['set']) for r in b]
    == [(2, 'valid'), (4, 'valid'), (6, 'valid'), (6, 'test')]
  )
  for x, y in zip(a, b):
    assert x['lm_loss'] == pytest.approx(y['lm_loss'], rel=1e-6), x


def test_two_processes_summing_gradients_once_a_step_train_exactly_like_one(tmp_path):
  """pipeline.grad_sync='step' without a pipeline: each data rank's micro-batch loop runs in a
  shard_map over `data`, here one rank per process, and the ranks' sums cross the processes
  once a step (gloo): the same losses and gradient norms as one process. The two processes
  also agree on each timed save (checkpoint.save_interval_mins, here due at every iteration)."""
  multi, single = str(tmp_path / 'multi'), str(tmp_path / 'single')
  args = ['--config.train.steps=3', '--config.pipeline.grad_sync=step']
  timed = ['--config.checkpoint.save_interval_mins=1e-6', '--config.checkpoint.max_to_keep=5']
  results = finish(
    two_processes_by_flags([*args, *timed, '--workdir', multi])
    + [start([*args, '--workdir', single])]
  )
  for code, _, stderr in results:
    assert code == 0, stderr[-3000:]
  assert "summed once a step (pipeline.grad_sync 'step'" in results[0][1]
  # Timed (temporary) saves at 1 and 2, each deleted by the next save; none at the last
  # iteration, whose save the end makes.
  assert results[0][1].count('minutes since the last save') == 2
  assert checkpoints.available_steps(os.path.join(multi, 'checkpoints')) == [3]
  a, b = metrics(multi), metrics(single)
  assert [r['iteration'] for r in a] == [r['iteration'] for r in b] == [1, 2, 3]
  for x, y in zip(a, b):
    for key in ('lm_loss', 'grad_norm'):
      assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x['iteration'], key)


def test_a_signal_to_one_slurm_task_stops_both_at_the_same_iteration_and_they_resume(tmp_path):
  """SLURM's pre-timeout signal may reach one task first; if only that one stopped, the other
  would wait in the next step's collectives forever (a hang). Both stop at one iteration, save
  it, exit 3 (requeue), and a resubmitted pair resumes from it. The mesh puts one pipeline stage
  in each process, as stages on different nodes are."""
  workdir = str(tmp_path / 'run')
  pipeline = ['--config.mesh.data=1', '--config.mesh.pipeline=2', '--workdir', workdir]
  procs = two_processes_under_slurm(['--config.train.steps=100000', *pipeline], job_id=4242)
  wait_for_iterations(workdir, 2, procs)
  procs[1].send_signal(signal.SIGUSR1)  # the task that writes no log
  results = finish(procs)
  assert [code for code, _, _ in results] == [3, 3], results[0][2][-3000:]
  last = metrics(workdir)[-1]['iteration']
  assert 'received a signal on another process' in results[0][1]
  assert max(int(s) for s in os.listdir(os.path.join(workdir, 'checkpoints'))) == last

  resumed = finish(
    two_processes_under_slurm([f'--config.train.steps={last + 2}', *pipeline], job_id=4243)
  )
  assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:]
  assert f'resumed from {os.path.join(workdir, "checkpoints")}/{last}' in resumed[0][1]
  assert [r['iteration'] for r in metrics(workdir)][-3:] == [last, last + 1, last + 2]


def test_a_process_stuck_in_a_collective_exits_4_with_every_threads_stack(tmp_path):
  """The chronicles' hang: one rank stops responding and the others wait in a collective that
  never times out. SIGUSR2 first makes both print their stacks and go on; then process 1 is
  frozen (SIGSTOP) and process 0's watchdog ends it after runtime.hang_timeout_mins, with its
  stacks on stderr and in the log, exit code 4."""
  workdir = str(tmp_path / 'run')
  procs = two_processes_by_flags(
    [
      '--config.train.steps=100000',
      '--workdir',
      workdir,
      '--config.runtime.hang_timeout_mins=0.1',
      f'--config.runtime.alert_command={ALERT_RECORD}',
    ]
  )
  try:
    wait_for_iterations(workdir, 2, procs)
    for p in procs:
      p.send_signal(signal.SIGUSR2)
    done = len(metrics(workdir))
    wait_for_iterations(workdir, done + 2, procs)  # the dump did not stop training
    procs[1].send_signal(signal.SIGSTOP)
    code = procs[0].wait(timeout=120)  # a guard only: a watchdog that never fires fails here
    stdout, stderr = procs[0].communicate()
  finally:
    for p in procs:
      p.kill()
  assert code == 4, stderr[-3000:]
  # The SIGUSR2 dump: the main thread's stack, and training went on.
  assert stderr.count('(most recent call first)') >= 2 and 't5x_like/training/trainer.py' in stderr
  message = re.search(
    r'> hang: no progress for ([\d.]+) minutes \(runtime.hang_timeout_mins=0.1\) '
    r'while in iteration (\d+);',
    stderr,
  )
  assert message, stderr[-3000:]
  # Not before the timeout: the silence the watchdog measured (its own clock, whatever the
  # machine's speed; the timing rule itself is tests/test_runtime.py's, on a fake clock) is at
  # least hang_timeout_mins. And it names the iteration in flight: the one after the last logged.
  assert float(message.group(1)) >= 0.1
  assert int(message.group(2)) == len(metrics(workdir)) + 1
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert message.group(0) in log and 'in _train' in log.split(message.group(0))[1]
  # runtime.alert_command heard of it from process 0 (its own session outlives the exit).
  deadline = time.monotonic() + 60
  while not read_alerts(workdir) and time.monotonic() < deadline:
    time.sleep(0.1)
  ((event, iteration, process, text),) = read_alerts(workdir)
  assert (event, iteration, process) == ('hang', '', '0') and text.startswith(message.group(0))


def test_processes_given_different_runs_all_stop_with_one_clear_error(tmp_path):
  port = free_port()
  procs = [
    start(
      [
        '--workdir',
        str(tmp_path / 'w'),
        f'--config.train.seed={seed}',
        '--coordinator_address',
        f'localhost:{port}',
        '--num_processes',
        '2',
        '--process_id',
        str(i),
      ]
    )
    for i, seed in enumerate((1, 2))
  ]
  for code, _, stderr in finish(procs):
    assert code == 2
    assert (
      'error: process(es) [1] were started with another config or workdir than process 0 '
      '(2 processes, command-line flags); start every process with the same command line' in stderr
    )
  assert not os.path.exists(tmp_path / 'w')


SLURM_TASK = {
  'SLURM_JOB_ID': '77',
  'SLURM_STEP_NODELIST': 'gpu[003-004]',
  'SLURM_NTASKS': '16',
  'SLURM_PROCID': '9',
  'SLURM_LOCALID': '1',
}


def test_process_group_comes_from_flags_then_slurm_then_is_a_single_process():
  group = distributed.from_flags_or_environment('node7:1234', 4, 3, environ=SLURM_TASK)
  assert (group.num_processes, group.process_id, group.coordinator_address) == (4, 3, 'node7:1234')
  group = distributed.from_flags_or_environment(None, None, None, environ=SLURM_TASK)
  assert (group.num_processes, group.process_id, group.coordinator_address) == (16, 9, None)
  assert group.source == 'SLURM job 77'
  one_task = {**SLURM_TASK, 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0'}
  for environ in (one_task, {}):
    assert not distributed.from_flags_or_environment(None, None, None, environ).is_multi_process


@pytest.mark.parametrize(
  'flags, message',
  [
    (('node7:1234', 4, None), '--coordinator_address, --num_processes given without --process_id'),
    (('node7:1234', 4, 4), '--process_id 4 is not in [0, --num_processes 4)'),
    (('node7', 2, 0), "--coordinator_address 'node7' is not HOST:PORT"),
  ],
)
def test_incomplete_or_wrong_process_flags_are_one_clear_error(flags, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    distributed.from_flags_or_environment(*flags, environ={})


def test_a_mesh_that_cpu_processes_cannot_share_evenly_fails_before_joining():
  group = distributed.ProcessGroup(3, 0, 'localhost:1', 'command-line flags')
  with pytest.raises(
    ConfigError, match='the mesh has 4 devices, which 3 CPU processes cannot share evenly'
  ):
    distributed.initialize(group, 4)
  assert not distributed.joined().is_multi_process


def test_bad_process_flags_exit_2_with_one_message_and_no_workdir(tmp_path):
  result = run_cli(
    [
      '-m',
      't5x_like.train',
      *SMALL_TINY,
      '--workdir',
      str(tmp_path / 'w'),
      '--num_processes',
      '2',
      '--process_id',
      '0',
    ],
    timeout=120,
  )
  assert result.returncode == 2
  assert result.stderr.strip() == (
    'error: --num_processes, --process_id given without '
    '--coordinator_address: a multi-process run needs all three '
    '(or none, under SLURM or for one process)'
  )
  assert not os.path.exists(tmp_path / 'w')


# Each of two processes (2 CPU devices each, one data=2 x tensor=2 mesh) checks the replicas of a
# tree whose replicated LayerNorm scale differs on process 1 only (its two local copies agree, so
# only a comparison across processes finds it), then of the same tree without the difference.
_REPLICA_CHECK = r"""
import json, sys
import numpy as np
from t5x_like.mesh import distributed; from t5x_like.cli import train
cfg, workdir, group = train.parse_command_line(sys.argv[1:])
distributed.initialize(group, cfg.mesh.num_devices)
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
from t5x_like.training.trainer import Trainer
trainer = Trainer(cfg, workdir)
trainer.writer.open()  # as a started run: main_log.txt
me = jax.process_index()

def tree(offset):
  def array(shape, spec, value):
    sharding = NamedSharding(trainer.mesh, spec)
    return jax.make_array_from_callback(shape, sharding, lambda index: value[index])
  return {'final_ln': {'scale': array((4,), P(), np.full(4, 1 + offset * me, np.float32)),
                       'bias': array((4,), P(), np.zeros(4, np.float32))},
          # Copies over `tensor` within a process; each process holds other rows.
          'rows': array((2, 4), P('data'), np.full((2, 4), me, np.float32)),
          # No copies at all: each device its own slice.
          'blocks': array((2, 2), P('data', 'tensor'), np.full((2, 2), me, np.float32))}

print(json.dumps([trainer.replica_check.check(tree(1e-6), 7),
                  trainer.replica_check.check(tree(0), 8)]))
"""


def test_replica_check_compares_the_copies_that_other_processes_hold(tmp_path):
  workdir = str(tmp_path / 'run')
  port = free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        '-c',
        _REPLICA_CHECK,
        *SMALL_TINY,
        '--workdir',
        workdir,
        '--coordinator_address',
        f'localhost:{port}',
        '--num_processes',
        '2',
        '--process_id',
        str(i),
      ],
      cwd=REPO,
      env=dict(os.environ),
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  results = finish(procs, timeout=120)
  for code, stdout, stderr in results:
    assert code == 0, stderr[-3000:]
    # Both processes reach the same verdict: the scale differs, then nothing does.
    assert json.loads(stdout.strip().splitlines()[-1]) == [["['final_ln']['scale']"], []]
  drifted = (
    "> replica check at iteration 7: the copies of ['final_ln']['scale'] differ across "
    'devices. Resume from the last checkpoint (a restore reads one copy) and report it '
    "with this log. The differing copies: ['final_ln']['scale'] on process 1"
  )
  assert drifted in results[1][2]  # process 1 writes no log: it says so on stderr
  with open(os.path.join(workdir, 'logs', 'main_log.txt')) as f:
    log = f.read()
  assert drifted in log
  assert (
    '> replica check at iteration 8: every replicated array of the params and optimizer '
    'state is identical on all 4 devices of the 2 processes'
  ) in log
