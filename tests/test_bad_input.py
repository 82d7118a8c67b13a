"""Every bad input a hostile-user review found, refused with one clear message and its exit code
(2: bad input; 1 for `ckpt diff`/`verify` findings), before any compilation, leaving nothing
half-written. One table per tool; each row is the input, the exit code and a fragment of the
message. The tools run in-process through their `main(argv)`."""

import errno
import json
import os
import shutil

import numpy as np
import pytest
from conftest import REPO, random_bloom

from t5x_like.cli import ckpt, devices, evaluate, generate, train
from t5x_like.cli import data as data_cli
from t5x_like.config import load_config_file
from t5x_like.data import blending, indexed, sources
from t5x_like.data.tokenizer import DEFAULT_MODEL_PATH

TINY = os.path.join(REPO, 'configs', 'tiny.py')
TINY_GIN = os.path.join(REPO, 'configs', 'tiny.gin')

# Files the rows name as {tmp}/NAME.
CONFIG_FILES = {
  'syntax.py': 'def get_config(:\n',
  'raises.py': 'def get_config():\n  raise RuntimeError("no such cluster")\n',
  'list.py': 'def get_config():\n  return [1, 2]\n',
  'int.py': 'def get_config():\n  return 3\n',
  'syntax.gin': 'train.steps = (\n',
  'include.gin': 'include "missing.gin"\n',
}


def run_main(main, argv, capsys, tmp):
  code = main([a.replace('{tmp}', str(tmp)) for a in argv])
  out, err = capsys.readouterr()
  return code, out + err


def check(result, code, fragment):
  got_code, text = result
  assert got_code == code, text[-2000:]
  assert fragment in text, text[-2000:]
  assert 'Traceback' not in text


@pytest.mark.parametrize(
  'argv, code, fragment',
  [
    (['--config', '{tmp}/syntax.py'], 2, 'syntax.py, line 1: syntax error'),
    (['--config', '{tmp}/raises.py'], 2, 'get_config() raised RuntimeError: no such cluster'),
    (['--config', '{tmp}/list.py'], 2, 'get_config() returned [1, 2], not a mapping'),
    (['--config', '{tmp}/int.py'], 2, 'get_config() returned 3, not a mapping'),
    (['--config', TINY_GIN], 2, 'is a gin file; pass it with --gin_file'),
    (['--gin_file', '{tmp}/syntax.gin'], 2, 'gin configuration error in'),
    (['--gin_file', '{tmp}/include.gin'], 2, 'Unable to open file: missing.gin'),
    (
      ['--gin_file', TINY_GIN, '--gin_bindings', 'train.steps == 4'],
      2,
      "--gin_bindings 'train.steps == 4'",
    ),
    (
      ['--config', TINY, '--config.train.seed=1e20'],
      2,
      'train.seed must be in [0, 4294967295], got 100000000000000000000',
    ),
    (['--config', TINY, '--config.train.seed=-1'], 2, 'train.seed must be in [0, 4294967295]'),
    (
      ['--config', TINY, '--config.model.ffn_hidden_size=-8'],
      2,
      'model.ffn_hidden_size must be >= 0, got -8',
    ),
    (
      ['--config', TINY, '--config.optimizer.min_lr=0.1'],
      2,
      'optimizer.min_lr (0.1) must not exceed optimizer.lr (0.002)',
    ),
    (
      ['--config', TINY, '--config.optimizer.eps=-1e-8'],
      2,
      'optimizer.eps must be > 0 and finite, got -1e-08',
    ),
    (['--config', TINY, '--config.optimizer.eps=nan'], 2, 'optimizer.eps must be > 0 and finite'),
    (
      ['--config', TINY, '--config.optimizer.weight_decay=-0.1'],
      2,
      'optimizer.weight_decay must be >= 0 and finite, got -0.1',
    ),
    (
      ['--config', TINY, '--config.optimizer.weight_decay=nan'],
      2,
      'optimizer.weight_decay must be >= 0 and finite, got nan',
    ),
    (
      ['--config', TINY, '--config.model.layernorm_epsilon=-1e-5'],
      2,
      'model.layernorm_epsilon must be > 0 and finite',
    ),
    (
      ['--config', TINY, '--config.model.init_std=inf'],
      2,
      'model.init_std must be >= 0 and finite, got inf',
    ),
    (
      ['--config', TINY, '--config.model.init_std=nan'],
      2,
      'model.init_std must be >= 0 and finite, got nan',
    ),
    (['--config', TINY, '--config.optimizer.beta2=1.0'], 2, 'optimizer.beta2 must be in [0, 1)'),
    (
      ['--config', TINY, '--config.model.hidden_dropout=1.0'],
      2,
      'model.hidden_dropout must be in [0, 1)',
    ),
    (
      ['--config', TINY, '--config.optimizer.clip_grad=-1'],
      2,
      'optimizer.clip_grad must be >= 0 and finite',
    ),
    (
      ['--config', TINY, '--config.runtime.exit_duration_mins=inf'],
      2,
      'runtime.exit_duration_mins must be >= 0 and finite',
    ),
    (
      ['--config', TINY, '--config.runtime.profile_steps=25-20'],
      2,
      "runtime.profile_steps: '25-20' is not a range of iterations FIRST-LAST with 1 <= FIRST <= "
      "LAST, e.g. '20-25' ('' for none)",
    ),
    (
      ['--config', TINY, '--config.runtime.profile_steps=20'],
      2,
      "runtime.profile_steps: '20' is not a range of iterations FIRST-LAST",
    ),
    (
      ['--config', TINY, '--config.runtime.profile_steps=1-2', '--config.runtime.tensorboard_dir='],
      2,
      "runtime.profile_steps='1-2' writes its trace under runtime.tensorboard_dir, which is ''",
    ),
    (
      [
        '--config',
        TINY,
        '--config.runtime.profile_every_mins=60',
        '--config.runtime.tensorboard_dir=',
      ],
      2,
      'runtime.profile_every_mins=60.0 writes its traces under runtime.tensorboard_dir, which '
      "is ''",
    ),
    (
      ['--config', TINY, '--config.runtime.profile_every_mins=-1'],
      2,
      'runtime.profile_every_mins must be >= 0',
    ),
    (
      [
        '--config',
        TINY,
        '--config.runtime.profile_every_mins=60',
        '--config.runtime.profile_process=1',
      ],
      2,
      'runtime.profile_process=1 names no process of this job (0-0); pick one of them',
    ),
    (['--config', TINY, '--config.mesh.data=100000'], 2, 'at most 4096 are allowed on CPU'),
    (['--config', TINY, '--config.data.train_path=1e308 A 1e308 B'], 2, 'the weights sum to inf'),
    (
      ['--config', TINY, '--config.data.train_path=1 A 1e-320 B'],
      2,
      'the weight 1e-320 is too small a share',
    ),
    # Megatron's weighted split paths (data.*_weighted_split_paths): range, weight, name.
    (
      ['--config', TINY, '--config.data.train_weighted_split_paths=train: 1 0:1.5 /d/en'],
      2,
      "group 'train': the range '0:1.5' of /d/en must be START:END with 0 <= START < END <= 1",
    ),
    (
      ['--config', TINY, '--config.data.train_weighted_split_paths=train: 1 0.95:0.95 /d/en'],
      2,
      "the range '0.95:0.95' of /d/en must be START:END with 0 <= START < END <= 1",
    ),
    (
      ['--config', TINY, '--config.data.train_weighted_split_paths=train: 0 0:0.95 /d/en'],
      2,
      "group 'train': the weight '0' of /d/en must be a number > 0",
    ),
    (
      [
        '--config',
        TINY,
        "--config.data.valid_weighted_split_paths=('en: 1 0.95:1 /d/en', '1 0.95:1 /d/fr')",
        '--config.data.train_weighted_split_paths=train: 1 0:0.95 /d/en',
      ],
      2,
      "data.valid_weighted_split_paths: the group '1 0.95:1 /d/fr' has no name",
    ),
    (
      [
        '--config',
        TINY,
        '--config.data.train_path=/d/fr',
        '--config.data.train_weighted_split_paths=train: 1 0:0.95 /d/en',
      ],
      2,
      "data.train_path (Megatron's --data-path, cut by data.split) cannot be combined with "
      'data.*_weighted_split_paths',
    ),
    (
      [
        '--config',
        TINY,
        '--config.data.train_weighted_split_paths=train: 1 0:0.95 {tmp}/en',
        '--config.data.root={tmp}/no_such_dir',
        '--config.eval.interval=0',
      ],
      2,
      "no_such_dir' is not a directory; point it at the directory that holds",
    ),
    # seqio Tasks and Mixtures (data.mixture_or_task; tests/data/test_seqio_tasks.py has the rows
    # that need a registry module of their own).
    (
      [
        '--config',
        TINY,
        '--config.data.mixture_or_task=no_such_task',
      ],
      2,
      "data.mixture_or_task='no_such_task' is not a registered seqio Task or Mixture (a Task of "
      'your own: name its module in data.mixture_or_task_module); registered: t5x_like_corpus, '
      't5x_like_corpus_mix, t5x_like_corpus_reference, t5x_like_corpus_stdlib',
    ),
    (
      [
        '--config',
        TINY,
        '--config.data.mixture_or_task=t5x_like_corpus_mix',
        '--config.data.mixture_or_task_module=no_such_registry',
      ],
      2,
      "data.mixture_or_task_module='no_such_registry' failed to import: ModuleNotFoundError: No "
      "module named 'no_such_registry'",
    ),
    (
      [
        '--config',
        TINY,
        '--config.data.train_path=/d/en',
        '--config.data.mixture_or_task=t5x_like_corpus_mix',
      ],
      2,
      "data.mixture_or_task='t5x_like_corpus_mix' names the training data and its splits itself, "
      'and data.train_path too; keep one of the two',
    ),
    (
      ['--config', TINY, '--config.data.mixture_or_task_module=my_tasks'],
      2,
      "data.mixture_or_task_module='my_tasks' registers seqio Tasks for data.mixture_or_task, "
      'which is empty',
    ),
  ],
)
def test_train_refuses(argv, code, fragment, tmp_path, capfd):
  # capfd, not capsys: the trainer's watchdog hands faulthandler the real stderr's descriptor.
  for name, text in CONFIG_FILES.items():
    (tmp_path / name).write_text(text)
  workdir = tmp_path / 'workdir'
  check(run_main(train.main, [*argv, '--workdir', str(workdir)], capfd, tmp_path), code, fragment)
  assert not os.path.exists(workdir / 'checkpoints')


def test_train_refuses_an_evaluation_longer_than_its_set(tmp_path, capfd):
  """After the data is opened, before anything compiles. The embedded corpus is the standard
  library's prose, so its splits' sizes depend on the Python version (tiny's test split holds 97
  samples on 3.11, 123 on 3.12): they are read here, not assumed."""
  cfg = load_config_file(TINY, {}).validate()
  data = sources.build(cfg.data, cfg.train.seq_len, cfg.train.seed)
  sets = {**data.valid, 'test': data.test}
  batch = cfg.train.global_batch_size
  iters = min(s.num_samples for s in sets.values()) // batch + 1
  name, held = next((n, s.num_samples) for n, s in sets.items() if s.num_samples < iters * batch)
  fragment = (
    f'the evaluation set {name!r} holds {held} samples, fewer than the {iters * batch} an '
    f'evaluation reads (eval.iters={iters} x global batch {batch}), so it would repeat samples; '
    f'set eval.iters <= {held // batch}'
  )
  argv = ['--config', TINY, f'--config.eval.iters={iters}', '--workdir', str(tmp_path / 'workdir')]
  check(run_main(train.main, argv, capfd, tmp_path), 2, fragment)
  assert not os.path.exists(tmp_path / 'workdir' / 'checkpoints')


def test_train_refuses_a_damaged_config_history_and_leaves_it_as_it_was(tmp_path, capfd):
  """A run appends its job to config_history.jsonl; after a damaged line `data batch` could not
  read any iteration of the run, so the damage is one error before the run starts."""
  workdir = tmp_path / 'workdir'
  workdir.mkdir()
  history = workdir / 'config_history.jsonl'
  history.write_text('{garbage\n')
  argv = ['--config', TINY, '--workdir', str(workdir)]
  fragment = 'config_history.jsonl is damaged: line 1 is not a job record'
  check(run_main(train.main, argv, capfd, tmp_path), 2, fragment)
  assert history.read_text() == '{garbage\n'
  assert sorted(os.listdir(workdir)) == ['config_history.jsonl']


def _write_run(workdir, history_line):
  """A run's workdir as `data batch` reads it: config.json and one config_history record."""
  from conftest import small_config

  os.makedirs(workdir)
  cfg = small_config(data={'split': '98,2,0'}, model={'vocab_size': 8192})
  (workdir / 'config.json').write_text(cfg.to_json())
  (workdir / 'config_history.jsonl').write_text(history_line + '\n')


def _full_disk(monkeypatch):
  """Every write to a dataset file fails as on a full disk, after some bytes went out."""
  real_open = os.fdopen

  class FullFile:
    def __init__(self, f):
      self.f = f

    def write(self, data):
      raise OSError(errno.ENOSPC, 'No space left on device')

    def __getattr__(self, name):
      return getattr(self.f, name)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

  monkeypatch.setattr(indexed.os, 'fdopen', lambda fd, mode: FullFile(real_open(fd, mode)))


@pytest.mark.parametrize(
  'setup, argv, code, fragment',
  [
    (
      lambda tmp, mp: (tmp / 'latin1.jsonl').write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n'),
      ['preprocess', '--input', '{tmp}/latin1.jsonl'],
      2,
      'latin1.jsonl:2: not UTF-8 text',
    ),
    (
      lambda tmp, mp: (tmp / 'latin1.txt').write_bytes(b'one\ntwo\ncaf\xe9\n'),
      ['preprocess', '--input', '{tmp}/latin1.txt'],
      2,
      'latin1.txt:3: not UTF-8 text',
    ),
    (
      lambda tmp, mp: (tmp / 'empty.jsonl').write_text(''),
      ['preprocess', '--input', '{tmp}/empty.jsonl'],
      2,
      'no text to tokenize (0 document(s)',
    ),
    (
      lambda tmp, mp: (tmp / 'blank.jsonl').write_text('{"text": ""}\n{"text": ""}\n'),
      ['preprocess', '--input', '{tmp}/blank.jsonl'],
      2,
      'no text to tokenize (2 document(s)',
    ),
    (
      lambda tmp, mp: (tmp / 'inputs').mkdir(),
      ['preprocess', '--input', '{tmp}/inputs'],
      2,
      "inputs' is a directory; pass its files (JSON lines or text), e.g. --input ",
    ),
    (
      lambda tmp, mp: (tmp / 'bad.model').write_text('not a model'),
      ['preprocess', '--input', TINY, '--tokenizer_model', '{tmp}/bad.model'],
      2,
      'bad.model is not a SentencePiece model',
    ),
    (
      lambda tmp, mp: _full_disk(mp),
      ['preprocess', '--input', TINY],
      2,
      'no space left on the device of',
    ),
    (
      lambda tmp, mp: _write_run(tmp / 'run', '{"first_iteration": 1, "config": {}}'),
      ['batch', '{tmp}/run', '--iteration', '1'],
      2,
      'config_history.jsonl is damaged: line 1 is not a job record',
    ),
    (
      lambda tmp, mp: _write_run(tmp / 'run', '{garbage'),
      ['batch', '{tmp}/run', '--iteration', '1'],
      2,
      'config_history.jsonl is damaged: line 1 is not a job record',
    ),
    (
      lambda tmp, mp: _write_run(tmp / 'run', '[1, 2]'),
      ['batch', '{tmp}/run', '--iteration', '1'],
      2,
      'config_history.jsonl is damaged: line 1 is not a job record',
    ),
    (
      lambda tmp, mp: (
        _write_run(
          tmp / 'run', '{"first_iteration": 1, "data_seed": 0, "config": {"train": {"steps": 3}}}'
        ),
        (tmp / 'bad.model').write_text('not a model'),
      ),
      ['batch', '{tmp}/run', '--iteration', '1', '--tokenizer_model', '{tmp}/bad.model'],
      2,
      'bad.model is not a SentencePiece model',
    ),
  ],
)
def test_data_cli_refuses(setup, argv, code, fragment, tmp_path, capsys, monkeypatch):
  setup(tmp_path, monkeypatch)
  out_dir = tmp_path / 'out'
  if argv[0] == 'preprocess':
    argv = [*argv, '--output_prefix', str(out_dir / 'data')]
  check(run_main(data_cli.main, argv, capsys, tmp_path), code, fragment)
  # Nothing half-written: no dataset, no temporary file, not even the directory made for them.
  assert not os.path.exists(out_dir)


@pytest.mark.parametrize(
  'prefix, fragment',
  [
    ('{tmp}/a_file/data', 'its directory {tmp}/a_file cannot be created: {tmp}/a_file is a file'),
    ('/sys/kernel/data', 'its directory /sys/kernel is not writable ('),
  ],
)
def test_preprocess_refuses_an_output_it_cannot_write_before_reading(
  prefix, fragment, tmp_path, capsys
):
  (tmp_path / 'a_file').write_text('x')
  argv = ['preprocess', '--input', TINY, '--output_prefix', prefix]
  check(
    run_main(data_cli.main, argv, capsys, tmp_path), 2, fragment.replace('{tmp}', str(tmp_path))
  )


@pytest.mark.parametrize(
  'weights', [[1e308, 1e308], [1.0, 1e-320], [1.0, float('nan')], [1.0, -1.0]]
)
def test_blend_refuses_weights_it_cannot_order(weights):
  with pytest.raises(ValueError, match='blend weights must'):
    blending.Blend(weights)


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """(HF directory, checkpoint root) of a one-layer random BLOOM."""
  tmp = tmp_path_factory.mktemp('imported')
  _, hf_dir = random_bloom(tmp, 2, 64, hidden=16, layers=1)
  root = str(tmp / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, root]) == 0
  return hf_dir, root


def _hf_copy(hf_dir, tmp, edit):
  copy = tmp / 'hf'
  shutil.copytree(hf_dir, copy)
  edit(copy)
  return str(copy)


def _truncate(path, keep):
  data = open(path, 'rb').read()
  open(path, 'wb').write(data[:keep])


def _ckpt_copy(root, tmp, item, content):
  """A copy of the checkpoint whose `item` JSON is replaced by `content`."""
  copy = tmp / 'ckpt'
  shutil.copytree(root, copy)
  with open(copy / '0' / item / 'metadata', 'w') as f:
    f.write(content if isinstance(content, str) else json.dumps(content))
  return str(copy)


GOOD_META = {
  'rng': {'seed': 1, 'iteration': 0},
  'data': {'seed': 1, 'consumed_samples': 0},
  'lr_schedule': {},
  'adam_count_base': {'iteration': 0, 'skipped_iterations': 0},
}


@pytest.mark.parametrize(
  'make, argv, code, fragment',
  [
    (
      lambda hf, root, tmp: _hf_copy(hf, tmp, lambda d: _truncate(d / 'model.safetensors', 3000)),
      ['import-hf', '{src}', '{tmp}/out'],
      2,
      'model.safetensors is not a readable safetensors file',
    ),
    (
      lambda hf, root, tmp: _hf_copy(hf, tmp, lambda d: (d / 'config.json').write_text('{"n_l')),
      ['import-hf', '{src}', '{tmp}/out'],
      2,
      'config.json is not valid JSON',
    ),
    (
      lambda hf, root, tmp: _hf_copy(hf, tmp, lambda d: (d / 'config.json').write_text('[]')),
      ['import-hf', '{src}', '{tmp}/out'],
      2,
      'config.json holds a list, not a JSON object',
    ),
    (
      lambda hf, root, tmp: root,
      ['export-hf', '{src}', '/sys/kernel/hf'],
      2,
      'the Hugging Face directory /sys/kernel/hf is not writable (',
    ),
    (
      lambda hf, root, tmp: ((tmp / 'a_file').write_text('x'), root)[1],
      ['export-hf', '{src}', '{tmp}/a_file/hf'],
      2,
      'a_file/hf cannot be created: ',
    ),
    (
      lambda hf, root, tmp: root,
      ['export-hf', '{src}', '{tmp}/hf', '--tokenizer_model', DEFAULT_MODEL_PATH],
      2,
      'the tokenizer has 8192 tokens, the model 64: pass the tokenizer the',
    ),
    (
      lambda hf, root, tmp: hf,
      ['import-hf', '{src}', '/sys/kernel/ckpt'],
      2,
      'the checkpoint directory /sys/kernel/ckpt is not writable',
    ),
    (
      lambda hf, root, tmp: ((tmp / 'a_file').write_text('x'), hf)[1],
      ['import-hf', '{src}', '{tmp}/a_file'],
      2,
      'a_file is a file; pass a new directory to write the checkpoint to',
    ),
    (
      lambda hf, root, tmp: root,
      ['diff', '{src}', '{src}', '--atol', '-1'],
      2,
      '--atol must be a finite number >= 0',
    ),
    (
      lambda hf, root, tmp: root,
      ['diff', '{src}', '{src}', '--atol', 'nan'],
      2,
      '--atol must be a finite number >= 0',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'meta', [1, 2]),
      ['inspect', '{src}'],
      2,
      '/0 is damaged: its meta item is a list, not a mapping',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'meta', {**GOOD_META, 'rng': {'seed': 1}}),
      ['inspect', '{src}'],
      2,
      'its meta item has no int rng.iteration (got None)',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'meta', {**GOOD_META, 'lr_schedule': 3}),
      ['inspect', '{src}'],
      2,
      "its meta item has no 'lr_schedule' mapping (got 3)",
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'progress', [0]),
      ['inspect', '{src}'],
      2,
      'its progress item is a list, not a mapping of counters',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'progress', {'iteration': 0}),
      ['inspect', '{src}'],
      2,
      'its progress item lacks consumed_samples',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(
        root, tmp, 'progress', {'iteration': '7', 'consumed_samples': -1}
      ),
      ['inspect', '{src}'],
      2,
      "not ints >= 0: iteration='7', consumed_samples=-1",
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'config', 'null'),
      ['inspect', '{src}'],
      2,
      'its config item is null',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'config', [3]),
      ['inspect', '{src}'],
      2,
      'its config item is a list, not a mapping of config sections',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'config', {'model': {'layers': 2}}),
      ['inspect', '{src}'],
      2,
      'its config item is not a t5x_like config (unknown config key(s)',
    ),
    (
      lambda hf, root, tmp: _ckpt_copy(root, tmp, 'config', {'model': {'num_layers': 'two'}}),
      ['inspect', '{src}'],
      2,
      'model.num_layers must be of type int',
    ),
  ],
)
def test_ckpt_refuses(make, argv, code, fragment, imported, tmp_path, capsys):
  src = make(*imported, tmp_path)
  argv = [a.replace('{src}', src) for a in argv]
  check(run_main(ckpt.main, argv, capsys, tmp_path), code, fragment)
  assert not os.path.exists(tmp_path / 'out')


@pytest.mark.parametrize(
  'argv, code, fragment',
  [
    (['--temperature', 'nan'], 2, '--temperature a finite number >= 0'),
    (['--temperature', '-1'], 2, '--temperature a finite number >= 0'),
    (['--temperature', 'inf'], 2, '--temperature a finite number >= 0'),
    (['--top_k', '-1'], 2, '--top_k >= 0; got 64, 1, 0.0 and -1'),
    (['--tokenizer_model', '{tmp}/bad.model'], 2, 'bad.model is not a SentencePiece model'),
  ],
)
def test_generate_refuses(argv, code, fragment, imported, tmp_path, capsys):
  (tmp_path / 'bad.model').write_text('not a model')
  argv = ['--checkpoint', imported[1], '--prompt', 'hello', *argv]
  check(run_main(generate.main, argv, capsys, tmp_path), code, fragment)


def test_evaluate_refuses_rows_longer_than_a_gpt2_models_positions(tmp_path, capsys):
  """Before the restore, as generate and the harness refuse it; it was a shape error after."""
  from conftest import small_config

  from t5x_like.checkpointing import checkpoints
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import make_layout

  cfg = small_config(model=dict(architecture='gpt2', max_position_embeddings=16))
  layout = make_layout(cfg, partitioning.make_mesh(1, 1, 1))
  checkpoints.save_params(str(tmp_path / 'ckpt'), layout.init(0).params, cfg)
  np.save(tmp_path / 'rows.npy', np.zeros((2, 18), np.int32))  # 17 inputs each
  argv = ['--checkpoint', str(tmp_path / 'ckpt'), '--data', str(tmp_path / 'rows.npy')]
  fragment = 'feeds 17 tokens to the model, more than the 16 learned positions of this gpt2 model'
  check(run_main(evaluate.main, argv, capsys, tmp_path), 2, fragment)
  np.save(tmp_path / 'rows.npy', np.zeros((2, 17), np.int32))
  assert evaluate.main(argv) == 0


@pytest.mark.parametrize(
  'data, code, fragment',
  [
    ('{tmp}', 2, 'is a directory; pass TOKENS.npy or a dataset PREFIX'),
    ('{tmp}/tokens.npy', 2, 'tokens.npy is a directory'),
  ],
)
def test_evaluate_refuses(data, code, fragment, imported, tmp_path, capsys):
  os.makedirs(tmp_path / 'tokens.npy')
  check(
    run_main(evaluate.main, ['--checkpoint', imported[1], '--data', data], capsys, tmp_path),
    code,
    fragment,
  )


@pytest.mark.parametrize(
  'argv, code, fragment',
  [
    (['--size', '1000000'], 2, 'need 3725.3 GiB, more than the'),
    (['--cpu_devices', '100000'], 2, 'at most 4096 virtual CPU devices are allowed'),
  ],
)
def test_devices_refuses(argv, code, fragment, tmp_path, capsys):
  check(run_main(devices.main, argv, capsys, tmp_path), code, fragment)


def test_config_validate_gives_every_numeric_key_a_range():
  """Each int or float key of every section, set to NaN (floats) or -1e12 (ints): refused."""
  import dataclasses

  from t5x_like.config import SECTIONS, Config, ConfigError

  base = Config.from_dict({'train': {'steps': 1}})
  base.validate()
  for name, section in SECTIONS.items():
    for f in dataclasses.fields(section):
      value = getattr(section(), f.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      bad = float('nan') if isinstance(value, float) else -(10**12)
      with pytest.raises(ConfigError, match=rf'{name}\.{f.name} must be'):
        base.replace(**{name: {f.name: bad}}).validate()
