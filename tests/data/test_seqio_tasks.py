"""seqio Tasks and Mixtures as the data front end (`seqio_tasks.py`, `materialize.py`): a Task
materialised once into .bin/.idx equal to its tokens, the fingerprinted cache, `data prepare`,
one writer among several processes, bad input, and a Mixture that trains alike on two meshes and
resumes exactly."""

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import REPO, config_with

from t5x_like.cli import data as data_cli
from t5x_like.cli import train
from t5x_like.data import corpus, indexed, materialize, seqio_tasks
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.training.trainer import Trainer
from t5x_like.training.workdir import read_metrics

# A user's registry module (data.mixture_or_task_module): two small Tasks over generated text (one
# text empty, as real corpora have), their Mixture, and a Task without 'targets'. A source that
# sleeps (SEQIO_TEST_SLOW_S) holds the lock long enough for a second process to meet it.
USER_TASKS = textwrap.dedent('''
    import functools, os, time
    import numpy as np
    import seqio
    import tensorflow as tf
    from t5x_like.data.tokenizer import seqio_vocabulary

    WORDS = 'the data of a task is read once and cached on disk for every later run'.split()
    EDITION = {'alpha': 1, 'beta': 1}

    def texts(name, split):
      rng = np.random.default_rng([len(name), len(split)])
      count = 30 if split == 'train' else 8
      return [''] + [' '.join(rng.choice(WORDS, rng.integers(20, 60))) for _ in range(count)]

    class Source(seqio.FunctionDataSource):
      def __init__(self, name):
        self.name = name
        def dataset_fn(split, shuffle_files, seed=None):
          time.sleep(float(os.environ.get('SEQIO_TEST_SLOW_S', '0')))
          return tf.data.Dataset.from_tensor_slices({'targets': texts(name, split)})
        dataset_fn.__name__ = name
        super().__init__(dataset_fn, splits=('train', 'validation'))

      def content_fingerprint(self):
        return f'{self.name}-{EDITION[self.name]}'

    PREPROCESSORS = [functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
                     seqio.preprocessors.append_eos]
    for name in ('alpha', 'beta'):
      seqio.TaskRegistry.add(
          f'user_{name}', source=Source(name), preprocessors=PREPROCESSORS,
          output_features={'targets': seqio.Feature(seqio_vocabulary(), add_eos=True)})
    seqio.MixtureRegistry.add('user_mix', [('user_alpha', 2.0), ('user_beta', 1.0)])
    seqio.TaskRegistry.add(
        'user_no_targets', source=Source('alpha'), preprocessors=PREPROCESSORS,
        output_features={'inputs': seqio.Feature(seqio_vocabulary(), add_eos=True)})

    # Tasks whose 'targets' are no token ids, declared so or found so: each is refused.
    class ArraySource(seqio.FunctionDataSource):
      """40 examples of `make(rng)` as the feature `key` (the ids of a tokenizer of yours)."""
      def __init__(self, name, make, key='targets'):
        def dataset_fn(split, shuffle_files, seed=None):
          rng = np.random.default_rng(len(name))
          return tf.data.Dataset.from_tensor_slices({key: np.stack([make(rng, i)
                                                                    for i in range(40)])})
        dataset_fn.__name__ = name
        super().__init__(dataset_fn, splits=('train', 'validation'))

    def ids(rng, i, bad=None):
      row = rng.integers(2, 8000, 35).astype(np.int32)
      if bad is not None and i == 30:  # late: 30 good documents come first
        row[17] = bad
      return row

    BAD_TARGETS = {
        # Scores, not ids (they truncate to id 0), declared as float32.
        'user_float_targets': (lambda rng, i: rng.random(35).astype(np.float32),
                               dict(dtype=tf.float32, add_eos=False), [], 'targets'),
        # Text that nothing tokenizes (no seqio.preprocessors.tokenize).
        'user_text_targets': (None, dict(add_eos=True), [seqio.preprocessors.append_eos], None),
        # The ids land in 'text', not 'targets'.
        'user_missing_targets': (ids, dict(add_eos=False), [], 'text'),
        # Rows of ids, two per example.
        'user_rank2_targets': (lambda rng, i: np.stack([ids(rng, i), ids(rng, i)]),
                               dict(add_eos=False, rank=2), [], 'targets'),
        'user_negative_ids': (functools.partial(ids, bad=-3), dict(add_eos=False), [], 'targets'),
        'user_large_ids': (functools.partial(ids, bad=8192), dict(add_eos=False), [], 'targets'),
    }
    for name, (make, feature, preprocessors, key) in BAD_TARGETS.items():
      seqio.TaskRegistry.add(
          name, source=Source('beta') if make is None else ArraySource(name, make, key),
          preprocessors=preprocessors,
          output_features={'targets': seqio.Feature(seqio_vocabulary(), **feature)})
    # A good Task and a bad one: the good one's splits are not written either.
    seqio.MixtureRegistry.add('user_mix_with_text', [('user_alpha', 1.0),
                                                     ('user_text_targets', 1.0)])
''')
BROKEN_TASKS = 'raise RuntimeError("the bucket gs://nowhere is not reachable")\n'


@pytest.fixture(scope='module')
def user_module(tmp_path_factory):
  """`seqio_user_tasks` and `seqio_broken_tasks` importable from a directory on sys.path."""
  directory = tmp_path_factory.mktemp('user_tasks')
  (directory / 'seqio_user_tasks.py').write_text(USER_TASKS)
  (directory / 'seqio_broken_tasks.py').write_text(BROKEN_TASKS)
  sys.path.insert(0, str(directory))
  yield str(directory)
  sys.path.remove(str(directory))


def task_tokens(task, split):
  """The Task's 'targets' ids per example, straight from seqio, in its unshuffled order."""
  data = task.get_dataset(sequence_length=None, split=split, shuffle=False, num_epochs=1)
  return [example['targets'].tolist() for example in data.as_numpy_iterator()]


def stored_documents(prefix):
  dataset = indexed.IndexedDataset(prefix)
  return [dataset.document(i).tolist() for i in range(dataset.num_documents)]


def test_a_task_materialises_to_documents_equal_to_its_tokens(user_module, tmp_path, caplog):
  task = seqio_tasks.get_mixture_or_task('user_alpha', 'seqio_user_tasks')
  with caplog.at_level(logging.WARNING):
    entry = materialize.materialize(task, 'train', str(tmp_path))
  assert entry.built and entry.prefix == str(tmp_path / 'seqio' / 'user_alpha' / 'train')
  want = task_tokens(task, 'train')
  # The empty text comes out of seqio as a lone EOS: skipped, as preprocess and Megatron skip it.
  assert want[0] == [1] and all(len(ids) > 1 and ids[-1] == 1 for ids in want[1:])
  assert stored_documents(entry.prefix) == want[1:]
  assert (entry.documents, entry.tokens) == (30, sum(map(len, want[1:])))
  assert 'skipped 1 example(s) without tokens' in caplog.text
  # The project's own corpus Task: its validation split is every 16th reference topic, each
  # encoded by the shipped tokenizer and ended with the EOD id.
  reference = seqio_tasks.get_mixture_or_task(seqio_tasks.REFERENCE_TASK)
  held_out = materialize.materialize(reference, 'validation', str(tmp_path))
  tokenizer = Tokenizer.load_default()
  topics = seqio_tasks.split_documents(corpus.topic_documents(), 'validation')
  assert stored_documents(held_out.prefix) == [
    ids + [tokenizer.eod_id] for ids in tokenizer.encode_batch(topics)
  ]


def listing(directory):
  return {
    os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
    for d, _, files in os.walk(directory)
    for f in files
    if not f.endswith('.lock')
  }


def test_the_cache_is_reused_and_rebuilt_when_stale_or_damaged(user_module, tmp_path, caplog):
  import seqio_user_tasks  # pylint: disable=import-outside-toplevel

  cache = str(tmp_path)
  first = materialize.prepare('user_mix', 'seqio_user_tasks', cache)
  assert [(t.name, t.rate) for t in first] == [('user_alpha', 2.0), ('user_beta', 1.0)]
  assert all(t.train.built and t.valid['validation'].built for t in first)
  written = listing(cache)
  again = materialize.prepare('user_mix', 'seqio_user_tasks', cache)
  assert not any(t.train.built or t.valid['validation'].built for t in again)
  assert listing(cache) == written  # nothing written, nothing touched

  task = seqio_tasks.get_mixture_or_task('user_beta')
  prefix = first[1].train.prefix
  bin_path, idx_path = indexed.paths(prefix)
  with open(bin_path, 'r+b') as f:  # a short .bin: a copy cut off
    f.truncate(os.path.getsize(bin_path) - 2)
  with caplog.at_level(logging.WARNING):
    assert materialize.materialize(task, 'train', cache).built
  assert f'seqio cache {prefix} is damaged' in caplog.text
  assert stored_documents(prefix) == task_tokens(task, 'train')[1:]
  os.unlink(idx_path)
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    assert materialize.materialize(task, 'train', cache).built
  assert 'is damaged' in caplog.text
  assert not materialize.materialize(task, 'train', cache).built
  # The source's content changed under the same definition: the fingerprint tells.
  seqio_user_tasks.EDITION['beta'] = 2
  caplog.clear()
  try:
    with caplog.at_level(logging.WARNING):
      assert materialize.materialize(task, 'train', cache).built
  finally:
    seqio_user_tasks.EDITION['beta'] = 1
  assert f'seqio cache {prefix} is stale' in caplog.text


def test_two_processes_preparing_at_once_write_once(user_module, tmp_path):
  code = (
    'import json, sys; from t5x_like.data import materialize; '
    'tasks = materialize.prepare("user_alpha", "seqio_user_tasks", sys.argv[1]); '
    'print(json.dumps([[e.split, e.built, e.documents, e.tokens] '
    'for t in tasks for e in (t.train, *t.valid.values())]))'
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([user_module, REPO]), SEQIO_TEST_SLOW_S='2')
  processes = [
    subprocess.Popen(
      [sys.executable, '-c', code, str(tmp_path)],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for _ in range(2)
  ]
  results = []
  for process in processes:
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    results.append(json.loads(out.strip().splitlines()[-1]))
  # Each split was written by exactly one of them; both read the same documents.
  for split in ('train', 'validation'):
    built = [b for result in results for s, b, _, _ in result if s == split]
    assert sorted(built) == [False, True], results
  assert [r[2:] for r in results[0]] == [r[2:] for r in results[1]]
  leftovers = [f for f in os.listdir(tmp_path / 'seqio' / 'user_alpha') if f.startswith('.tmp')]
  assert leftovers == []


def test_a_process_waiting_too_long_for_the_writer_stops_with_one_message(user_module, tmp_path):
  import fcntl  # pylint: disable=import-outside-toplevel

  task = seqio_tasks.get_mixture_or_task('user_beta', 'seqio_user_tasks')
  prefix = materialize.cache_prefix('user_beta', 'train', str(tmp_path))
  os.makedirs(os.path.dirname(prefix))
  with open(prefix + '.lock', 'w', encoding='utf-8') as held:  # another writer holds the split
    fcntl.flock(held, fcntl.LOCK_EX)
    with pytest.raises(
      indexed.DataError,
      match=r'waited 0\.5 s for another process preparing '
      r'.*user_beta/train \(it holds .*train\.lock\)',
    ):
      materialize.materialize(task, 'train', str(tmp_path), timeout_s=0.5)
  assert not indexed.exists(prefix)


def test_a_writer_that_fails_removes_its_lock_and_a_waiter_locks_the_path_anew(tmp_path):
  import threading  # pylint: disable=import-outside-toplevel

  prefix = str(tmp_path / 'cache' / 'seqio' / 'task' / 'train')
  held = []
  with materialize.SplitLock(prefix, 60) as first:

    def wait():
      with materialize.SplitLock(prefix, 60) as second:
        held.append(os.path.samestat(os.fstat(second.file.fileno()), os.stat(second.path)))

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive() and not held  # it waits on the file that `first` holds
    first.discard()
    assert not (tmp_path / 'cache').exists()  # what `first` created: the lock and directories
  waiter.join(30)
  # The waiter locked the path that exists now, not the removed file it was waiting on.
  assert held == [True]


def test_prepare_command(user_module, tmp_path, capsys):
  argv = [
    'prepare',
    '--mixture_or_task',
    'user_mix',
    '--mixture_or_task_module',
    'seqio_user_tasks',
    '--cache_dir',
    str(tmp_path),
  ]
  assert data_cli.main(argv) == 0
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert [(r['task'], r['split'], r['rate'], r['built']) for r in lines] == [
    ('user_alpha', 'train', 2.0, True),
    ('user_alpha', 'validation', 2.0, True),
    ('user_beta', 'train', 1.0, True),
    ('user_beta', 'validation', 1.0, True),
  ]
  for r in lines:
    assert indexed.IndexedDataset(r['prefix']).num_documents == r['documents']
  assert data_cli.main(argv) == 0
  assert all(not json.loads(line)['built'] for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize(
  'argv, fragment',
  [
    (
      ['--config.data.mixture_or_task=no_such_task'],
      "data.mixture_or_task='no_such_task' is not a registered seqio Task or Mixture (a Task of "
      'your own: name its module in data.mixture_or_task_module); registered: t5x_like_corpus, ',
    ),
    (
      [
        '--config.data.mixture_or_task=user_mix',
        '--config.data.mixture_or_task_module=seqio_broken_tasks',
      ],
      "data.mixture_or_task_module='seqio_broken_tasks' failed to import: RuntimeError: the bucket "
      'gs://nowhere is not reachable',
    ),
    (
      [
        '--config.data.mixture_or_task=user_no_targets',
        '--config.data.mixture_or_task_module=seqio_user_tasks',
      ],
      "the seqio Task 'user_no_targets' has no \"targets\" output feature (it has ['inputs'])",
    ),
  ],
)
def test_train_refuses_a_bad_task_before_compiling(argv, fragment, user_module, tmp_path, capfd):
  workdir = tmp_path / 'workdir'
  code = train.main(
    [
      '--config',
      os.path.join(REPO, 'configs', 'tiny.py'),
      *argv,
      '--workdir',
      str(workdir),
    ]
  )
  out, err = capfd.readouterr()
  assert code == 2, out + err
  assert fragment in err and 'Traceback' not in err, err
  assert not os.path.exists(workdir / 'checkpoints')
  # `data prepare` says the same, also with exit code 2.
  name = argv[0].split('=', 1)[1]
  module = argv[1].split('=', 1)[1] if len(argv) > 1 else ''
  assert (
    data_cli.main(
      [
        'prepare',
        '--mixture_or_task',
        name,
        '--mixture_or_task_module',
        module,
        '--cache_dir',
        str(tmp_path),
      ]
    )
    == 2
  )
  assert fragment in capfd.readouterr().err


@pytest.mark.parametrize(
  'name, fragment',
  [
    (
      'user_float_targets',
      'the seqio Task \'user_float_targets\' declares its "targets" output '
      'feature as float32 of rank 1; a decoder-only model trains on integer token ids',
    ),
    (
      'user_rank2_targets',
      'the seqio Task \'user_rank2_targets\' declares its "targets" output '
      'feature as int32 of rank 2',
    ),
    (
      'user_text_targets',
      "the seqio Task 'user_text_targets' cannot build its split 'train' "
      '(ValueError: Fill dimensions must be >= 0',
    ),
    (
      'user_mix_with_text',
      'its source gives "targets" as string of rank 0 (text, not token '
      'ids): a decoder-only model trains on integer token ids, one sequence per example: make '
      '"targets" rank-1 int32 ids of its vocabulary, e.g. add seqio.preprocessors.tokenize',
    ),
    (
      'user_missing_targets',
      "the seqio Task 'user_missing_targets' cannot build its split "
      "'train' (ValueError: Task dataset is missing expected output feature after preprocessing: "
      'targets); its source gives no "targets" (it gives [\'text\'])',
    ),
    (
      'user_negative_ids',
      "the seqio Task 'user_negative_ids', split 'train': example 30 has the "
      'token id -3, outside its "targets" vocabulary (ids 0..8191); nothing was written',
    ),
    (
      'user_large_ids',
      "the seqio Task 'user_large_ids', split 'train': example 30 has the token "
      'id 8192, outside its "targets" vocabulary (ids 0..8191); nothing was written',
    ),
  ],
)
def test_a_task_without_token_ids_is_refused_before_anything_is_written(
  name, fragment, user_module, tmp_path, capfd
):
  """Float scores, untokenized text, no 'targets', rows of ids, ids outside the vocabulary: one
  message, exit code 2 from `prepare` and `train`, and neither a cache entry nor a workdir."""

  def one_error(err):
    errors = [line for line in err.splitlines() if line.startswith('error:')]
    assert len(errors) == 1 and fragment in errors[0] and 'Traceback' not in err, err
    return errors[0]

  cache = tmp_path / 'cache'
  assert (
    data_cli.main(
      [
        'prepare',
        '--mixture_or_task',
        name,
        '--mixture_or_task_module',
        'seqio_user_tasks',
        '--cache_dir',
        str(cache),
      ]
    )
    == 2
  )
  one_error(capfd.readouterr().err)
  assert not cache.exists()  # no .bin/.idx, no temporary file, no lock, no directory
  workdir = tmp_path / 'workdir'
  code = train.main(
    [
      '--config',
      os.path.join(REPO, 'configs', 'tiny.py'),
      '--config.data.split=969,30,1',
      f'--config.data.mixture_or_task={name}',
      '--config.data.mixture_or_task_module=seqio_user_tasks',
      f'--config.data.cache_dir={cache}',
      '--workdir',
      str(workdir),
    ]
  )
  out, err = capfd.readouterr()
  assert code == 2, out + err
  one_error(err)
  assert not cache.exists() and not workdir.exists()


def mixture_config(cache_dir, **sections):
  """A small BLOOM on the project's Mixture of two corpus Tasks (rates 1:3), evaluated on each
  Task's validation split every 2 iterations."""
  return config_with(
    {
      'model': dict(num_layers=2, hidden_size=64, num_heads=4, vocab_size=8192, init_std=0.02),
      'train': dict(steps=4, global_batch_size=8, micro_batch_size=1, seq_len=32, seed=3),
      'optimizer': dict(lr=2e-3, min_lr=2e-4, warmup_samples=16, decay_samples=400),
      'mesh': dict(data=1, pipeline=1, tensor=1),
      'data': dict(mixture_or_task=seqio_tasks.CORPUS_MIXTURE, cache_dir=cache_dir),
      'eval': dict(interval=2, iters=1),
      'checkpoint': dict(save_interval=2),
      'runtime': dict(tensorboard_dir=''),
    },
    sections,
  )


def test_a_mixture_trains_alike_on_two_meshes_and_resumes_exactly(tmp_path, capfd):
  cache = str(tmp_path / 'cache')
  single = Trainer(mixture_config(cache), str(tmp_path / 'single'))
  single.run()
  assert single.data.train.names == [seqio_tasks.REFERENCE_TASK, seqio_tasks.STDLIB_TASK]
  assert single.data.train.blend.counts(32).tolist() == [8, 24]  # the Mixture's rates, 1:3
  sharded_cfg = mixture_config(cache, mesh=dict(data=2, tensor=4))
  sharded = str(tmp_path / 'sharded')
  Trainer(sharded_cfg, sharded).run()
  want = [r['lm_loss'] for r in read_metrics(str(tmp_path / 'single'))]
  got = [r['lm_loss'] for r in read_metrics(sharded)]
  assert len(want) == 4
  np.testing.assert_allclose(got, want, rtol=2e-5)
  with open(os.path.join(sharded, 'eval_metrics.jsonl')) as f:
    evals = [(e['iteration'], e['set']) for e in map(json.loads, f)]
  assert evals == [
    (i, s) for i in (2, 4) for s in (seqio_tasks.REFERENCE_TASK, seqio_tasks.STDLIB_TASK)
  ]
  # Stopped after 2 iterations and resumed: the same losses, bit for bit.
  resumed = str(tmp_path / 'resumed')
  Trainer(mixture_config(cache, mesh=dict(data=2, tensor=4), train=dict(steps=2)), resumed).run()
  trainer = Trainer(sharded_cfg, resumed)
  trainer.run()
  assert [r['lm_loss'] for r in read_metrics(resumed)] == got
  # `data batch` replays iteration 3 from the workdir: the samples the trainer read.
  capfd.readouterr()
  assert data_cli.main(['batch', resumed, '--iteration', '3', '--json']) == 0
  replayed = json.loads(capfd.readouterr().out.splitlines()[-1])
  np.testing.assert_array_equal(
    [s['ids'] for s in replayed['samples']], trainer.source.rows(16, 24)
  )
  assert {s['dataset'] for s in replayed['samples']} <= {
    seqio_tasks.REFERENCE_TASK,
    seqio_tasks.STDLIB_TASK,
  }
  decode = Tokenizer.load_default().decode  # the Tasks' vocabulary is the shipped tokenizer
  assert [s['text'] for s in replayed['samples']] == [decode(s['ids']) for s in replayed['samples']]
