"""TensorBoard event files through clu's metric writers (t5x_like/training/summaries.py), read back
with TensorFlow's own reader."""

import json
import os
import socket
import time

import pytest
from conftest import read_tensorboard, run_cli

from t5x_like.training import metrics, summaries


def test_clu_writer_scalars_and_a_resume_purge_read_back(tmp_path):
  first = summaries.RunWriter(str(tmp_path))
  first.scalars(1, {'loss/lm_loss': 2.5, 'lr/lr': 1e-4})
  first.scalars(2, {'loss/lm_loss': 2.25})
  first.scalars(3, {'loss/lm_loss': 2.0})
  first.scalars(2**40, {'big/step': -1.0})
  first.close()
  # A resumed run from step 2: the first file's steps 2 and on are dropped. In the same second
  # and process as the first writer: the purge's file must still sort between the two.
  second = summaries.RunWriter(str(tmp_path), purge_from=2)
  second.scalars(2, {'loss/lm_loss': 2.125})
  second.close()
  names = sorted(os.listdir(tmp_path))
  assert len(names) == 3 and 'purge' in names[1], names
  (scalars,) = read_tensorboard(str(tmp_path))
  assert scalars['loss/lm_loss'] == [(1, 2.5), (2, 2.125)]
  assert scalars['lr/lr'] == [(1, pytest.approx(1e-4))]
  assert scalars['big/step'] == []  # purged: 2**40 >= 2


def test_a_purge_sorts_after_the_earlier_files_and_before_the_next_writers(tmp_path):
  earlier = 'events.out.tfevents.0000000001.otherhost.1.7.v2'  # an earlier job, elsewhere
  (tmp_path / earlier).touch()
  path = summaries.write_purge(str(tmp_path), 5)
  assert sorted(os.listdir(tmp_path)) == [earlier, os.path.basename(path)]
  assert path.endswith(f'.{os.getpid()}.-purge')
  # A file of this second from this process's 10th writer: TensorFlow's counter sorts '10'
  # before '9', so the purge waits for the next second to sort after both.
  now = int(time.time())
  host_pid = f'{socket.gethostname()}.{os.getpid()}'
  written = [f'events.out.tfevents.{now:010d}.{host_pid}.{n}.v2' for n in (9, 10)]
  for name in written:
    (tmp_path / name).touch()
  purge = os.path.basename(summaries.write_purge(str(tmp_path), 5))
  next_writer = f'events.out.tfevents.{int(time.time()):010d}.{host_pid}.11.v2'
  assert sorted(written + [purge, next_writer])[2:] == [purge, next_writer]


def test_metrics_writer_runs_config_text_and_resume(tmp_path):
  record = {
    'iteration': 1,
    'consumed_samples': 8,
    'consumed_tokens': 128,
    'lm_loss': 3.0,
    'learning_rate': 1e-3,
    'global_batch_size': 8,
    'grad_norm': 1.0,
    'num_zeros': 0.0,
    'step_time_s': 1.0,
    'samples_per_sec': 8.0,
    'tflops': 1.0,
    'skipped_iterations': 0,
    'nan_iterations': 0,
  }
  with metrics.MetricsWriter(str(tmp_path), tensorboard_dir='tb') as writer:
    writer.open()
    writer.config_text(json.dumps({'train': {'steps': 2}}, indent=1), 1)
    for it in (1, 2):
      writer.record(
        dict(
          record, iteration=it, consumed_samples=8 * it, consumed_tokens=128 * it, lm_loss=3.0 - it
        ),
        2,
      )
  # The next job resumes from iteration 1 (8 samples, 128 tokens) and redoes iteration 2.
  with metrics.MetricsWriter(str(tmp_path), tensorboard_dir='tb') as writer:
    writer.open()
    writer.truncate_after(1, 8, 128)
    writer.config_text('{"train": {"steps": 3}}', 2)
    writer.record(
      dict(record, iteration=2, consumed_samples=16, consumed_tokens=256, lm_loss=0.5), 3
    )
  tb = tmp_path / 'tb'
  iterations, vs_tokens = read_tensorboard(str(tb), str(tb / 'vs_tokens'), kind='all')
  assert iterations['scalars']['lm-loss-training/lm_loss'] == [(1, 2.0), (2, 0.5)]
  assert vs_tokens['scalars']['lm-loss-training/lm_loss_vs_tokens'] == [(128, 2.0), (256, 0.5)]
  assert vs_tokens['texts'] == {}  # the config goes with the iterations only
  texts = iterations['texts']
  assert set(texts) == {'config'}
  (first_step, first), (second_step, second) = texts['config']
  assert (first_step, second_step) == (1, 2)
  # An indented Markdown code block: TensorBoard shows the JSON as it is.
  assert json.loads(''.join(line[4:] for line in first.splitlines(True))) == {'train': {'steps': 2}}
  assert second == '    {"train": {"steps": 3}}\n'


def test_tensorflow_is_imported_only_by_a_tensorboard_write_and_sees_no_gpu(tmp_path):
  script = (
    'import sys\n'
    'from t5x_like.training import metrics, summaries, trainer; from t5x_like.cli import train\n'
    'assert "tensorflow" not in sys.modules, "imported before any TensorBoard write"\n'
    'import tensorflow as tf\n'
    # This machine may have no GPU: the call that hides them is what is checked.
    'hide, calls = tf.config.set_visible_devices, []\n'
    'tf.config.set_visible_devices = lambda *args: calls.append(args) or hide(*args)\n'
    'summaries.import_tensorflow()\n'
    'print(calls, tf.config.get_visible_devices("GPU"))\n'
  )
  r = run_cli(['-c', script], env={'TF_CPP_MIN_LOG_LEVEL': '3'})
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == "[([], 'GPU')] []"
