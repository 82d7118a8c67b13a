import dataclasses
import math
import os
import typing

import pytest
from conftest import REPO, run_cli

from t5x_like import config as config_lib
from t5x_like.cli.train import parse_args
from t5x_like.config import CommandLineValue, Config, ConfigError, load_config_file, load_gin
from t5x_like.training import accounting, schedule, startup


def cfg_path(name):
  return os.path.join(REPO, 'configs', name)


@pytest.mark.parametrize('name', ['tiny', 'bloom_176b'])
def test_config_file_and_gin_file_give_the_same_config(name):
  from_py = load_config_file(cfg_path(f'{name}.py'))
  from_gin = load_gin([cfg_path(f'{name}.gin')], [])
  assert from_py == from_gin


def test_overrides_on_both_front_ends_agree():
  a, _ = parse_args(
    [
      '--config',
      cfg_path('tiny.py'),
      '--workdir',
      '/tmp/x',
      '--config.train.steps=7',
      '--config.mesh.data',
      '4',
      '--config.mesh.tensor=1',
      '--config.optimizer.lr=3e-4',
    ]
  )
  b, _ = parse_args(
    [
      '--gin_file',
      cfg_path('tiny.gin'),
      '--workdir',
      '/tmp/x',
      '--gin_bindings',
      'train.steps = 7',
      '--gin_bindings',
      'mesh.data = 4',
      '--gin_bindings',
      'mesh.tensor = 1',
      '--gin_bindings',
      'optimizer.lr = 3e-4',
    ]
  )
  assert a == b
  assert (a.train.steps, a.mesh.data, a.optimizer.lr) == (7, 4, 3e-4)


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--config.model.num_layerz=3'], 'model.num_layerz'),
    (['--config.modle.num_layers=3'], 'modle.num_layers'),
    (['--config.model.num_layers=three'], 'model.num_layers must be of type int'),
    (['--config.model.num_heads=6'], 'must be divisible by model.num_heads'),
    (['--config.mesh.tensor=3'], 'divisible by mesh.tensor'),
    (['--config.train.global_batch_size=12'], 'global_batch_size (12) must be divisible'),
    (
      ['--config.mesh.pipeline=2', '--config.mesh.data=1', '--config.train.global_batch_size=4'],
      'fewer than the 2 pipeline stages',
    ),
    (['--config.train.steps=0'], 'set train.steps'),
    (['--config.runtime.replica_check_interval=-1'], 'replica_check_interval must be >= 0'),
    (['--config.model.dtype=float16'], 'needs dynamic loss scaling'),
    (['--config.train.train_samples=8'], 'train.train_samples (8) is less than one global batch'),
    (['--config.checkpoint.init_from=/no/such/ckpt'], 'is not a directory'),
    (['--config.checkpoint.save_interval_mins=-5'], 'save_interval_mins must be >= 0'),
    (
      ['--config.checkpoint.reset_warmup_iterations=100'],
      'set checkpoint.load_optimizer=False with it',
    ),
    (['--config.data.train_path=0.5 /d/a /d/b'], 'weight/prefix pairs'),
    (['--config.data.split=98,x'], "data.split='98,x'"),
    (['--config.data.skip_train_iteration_range=("9-3",)'], "'9-3' is not a range"),
    (['--config.data.skip_train_iteration_range=("1-²",)'], "'1-²' is not a range"),
    (['--config.data.valid_path={"valid": "/d/x"}'], "names a set 'valid'"),
    (['--config.data.valid_path={"en wiki": "/d/x"}'], "set name 'en wiki'"),
    (['--config.data.split=100,0,0'], 'eval.interval=20 but there is no validation set'),
    (['--config.eval.iters=0'], 'eval.iters must be >= 1, got 0'),
    (['--config.runtime.hang_timeout_mins=-1'], 'runtime.hang_timeout_mins must be >= 0'),
    (['--config.runtime.spike_window=0'], 'runtime.spike_window must be >= 1'),
    (
      ['--config.runtime.spike_grad_factor=-2'],
      'runtime.spike_grad_factor must be >= 0 and finite, got -2.0',
    ),
  ],
)
def test_bad_config_is_one_clear_error(argv, message):
  with pytest.raises(ConfigError, match=None) as info:
    parse_args(['--config', cfg_path('tiny.py'), '--workdir', '/tmp/x', *argv])
  assert message in str(info.value)


def test_string_keys_take_the_command_line_text_and_mappings_round_trip():
  cfg, _ = parse_args(
    [
      '--config',
      cfg_path('tiny.py'),
      '--workdir',
      '/tmp/x',
      '--config.data.split=98,2,0',
      '--config.data.train_path',
      '0.5 /a 0.5 /b',
      '--config.data.valid_path={"en": "/d/en", "fr": "/d/fr"}',
      '--config.data.skip_train_iteration_range=["5-7", "20-20"]',
    ]
  )
  assert cfg.data.split == '98,2,0' and cfg.data.train_path == '0.5 /a 0.5 /b'
  assert cfg.data.valid_path == (('en', '/d/en'), ('fr', '/d/fr'))
  assert cfg.data.skip_ranges() == [(5, 7), (20, 20)]
  assert [i for i in range(1, 25) if cfg.data.skips(i)] == [5, 6, 7, 20]
  import json

  assert Config.from_dict(json.loads(cfg.to_json())) == cfg  # as config.json stores it
  gin_cfg = load_gin(
    [cfg_path('tiny.gin')],
    [
      'data.split = "98,2,0"',
      'data.train_path = "0.5 /a 0.5 /b"',
      'data.valid_path = {"en": "/d/en", "fr": "/d/fr"}',
      'data.skip_train_iteration_range = ["5-7", "20-20"]',
    ],
  )
  assert gin_cfg == cfg
  # Checkpoints written before data.corpus was retired still load their config.
  assert Config.from_dict({'data': {'corpus': 'embedded'}}) == Config()


def test_unknown_gin_binding_and_missing_files():
  with pytest.raises(ConfigError, match='num_layerz'):
    load_gin([cfg_path('tiny.gin')], ['model.num_layerz = 3'])
  with pytest.raises(ConfigError, match='not found'):
    load_gin(['/no/such.gin'], [])
  with pytest.raises(ConfigError, match='not found'):
    load_config_file('/no/such.py')


def test_from_dict_rejects_unknown_sections_and_keys():
  with pytest.raises(ConfigError, match='unknown config section'):
    Config.from_dict({'trian': {}})
  with pytest.raises(ConfigError, match='unknown config key'):
    Config.from_dict({'train': {'stepz': 1}})


def test_vocab_padding():
  cfg = Config.from_dict({'model': dict(vocab_size=250680), 'mesh': dict(tensor=4)})
  assert cfg.padded_vocab_size == 250880  # multiple of 128 x 4, as Megatron pads tr11
  cfg = Config.from_dict({'model': dict(vocab_size=1000, pad_vocab_size_to=1024)})
  assert cfg.padded_vocab_size == 1024


def test_bloom_176b_is_exactly_tr11():
  cfg = load_config_file(cfg_path('bloom_176b.py'))
  m, t, o, mesh = cfg.model, cfg.train, cfg.optimizer, cfg.mesh
  assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim) == (70, 14336, 112, 128)
  assert (m.vocab_size, cfg.padded_vocab_size) == (250680, 250880)
  assert abs(m.num_params(mesh.tensor) / 1e9 - 176.25) < 0.01
  assert (mesh.tensor, mesh.pipeline, mesh.data) == (4, 12, 8)
  assert (t.micro_batch_size, t.global_batch_size, t.seq_len) == (2, 2048, 2048)
  assert t.train_samples == 220_000_000
  assert (o.lr, o.min_lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.clip_grad) == (
    6e-5,
    6e-6,
    0.9,
    0.95,
    1e-8,
    0.1,
    1.0,
  )
  assert (o.warmup_samples, o.decay_samples, o.decay_style) == (183_105, 200_000_000, 'cosine')
  assert t.rampup_batch_size == (192, 16, 9_765_625)
  assert (m.hidden_dropout, m.attention_dropout, m.dtype) == (0.1, 0.1, 'bfloat16')
  assert abs(m.weight_init_std - 0.0048) < 1e-4
  # The chronicle's log: "iteration 12695/ 115311 | consumed samples: 9841584 | ... global batch
  # size: 2048 | ... elapsed time per iteration (s): 105.22 | ... TFLOPs: 149.02".
  assert schedule.total_iterations(t) == 115_311
  assert schedule.consumed_samples_after(t, 12_695) == 9_841_584
  flops = accounting.megatron_flops_per_iteration(cfg, 2048, 2048)
  assert round(flops / 105.22 / 384 / 1e12, 2) == 149.02


def test_iterations_follow_megatrons_train_samples_count():
  def total(**train):
    return schedule.total_iterations(startup.check_config(Config.from_dict({'train': train})).train)

  # Whole global batches only: Megatron drops a last partial batch, never trains past the count.
  assert total(steps=0, train_samples=100, global_batch_size=8) == 12
  assert total(steps=5, train_samples=100, global_batch_size=8) == 5  # train.steps caps
  assert total(steps=7, global_batch_size=8) == 7
  # Ramp-up 4 -> 8 by 4 over 16 samples: the ramp loop runs while consumed <= 16 (at 0, 4, 8, 12
  # with batches of 4, at 16 with 8), then (60 - 24) // 8 = 4 whole batches; 4 samples unused.
  cfg = Config.from_dict(
    {'train': dict(steps=0, train_samples=60, global_batch_size=8, rampup_batch_size=(4, 4, 16))}
  )
  startup.check_config(cfg)
  t = cfg.train
  sizes, consumed = [], 0
  for _ in range(schedule.total_iterations(t)):
    sizes.append(schedule.global_batch_size_at(t, consumed))
    consumed += sizes[-1]
  assert sizes == [4, 4, 4, 4, 8, 8, 8, 8, 8] and schedule.total_samples(t) == consumed == 56


def test_a_resume_that_would_shift_the_run_through_its_batch_schedule_is_refused():
  """A global batch change at iteration 10 (80 samples) of a 160-sample run: counted from 0 with
  16 a sample, its 10 iterations would end it at once (or 40 iterations of 4 overshoot), so the
  refusal gives the iterations that finish the samples; under optimizer.decay_tokens the warm-up's
  end in tokens would move (the learning rate jumps), unless checkpoint.override_lr_scheduler."""

  def config(**sections):
    train = dict(steps=0, train_samples=160, global_batch_size=8, seq_len=16)
    optimizer = dict(warmup_samples=40, decay_samples=160)
    raw = {'train': train, 'optimizer': optimizer}
    for name, values in sections.items():
      raw[name] = {**raw.get(name, {}), **values}
    return startup.check_config(Config.from_dict(raw))

  saved = config()
  with pytest.raises(ConfigError, match=r'set train.steps=15 and train.train_samples=0 \(the 10 '):
    schedule.check_resumed(saved, config(train=dict(global_batch_size=16)), 10, 80)
  with pytest.raises(ConfigError, match=r'set train.steps=30 and'):
    schedule.check_resumed(saved, config(train=dict(global_batch_size=4)), 10, 80)
  schedule.check_resumed(saved, config(), 10, 80)  # the same schedule
  steps = dict(steps=20, train_samples=0)
  saved = config(train=steps, optimizer=dict(decay_tokens=5120))
  changed = dict(train={**steps, 'global_batch_size': 16}, optimizer=dict(decay_tokens=5120))
  with pytest.raises(ConfigError, match='the warm-up would end at 768 tokens .* counted 640'):
    schedule.check_resumed(saved, config(**changed), 10, 80)
  overridden = config(**changed, checkpoint=dict(override_lr_scheduler=True))
  schedule.check_resumed(saved, overridden, 10, 80)
  schedule.check_resumed(
    config(train=steps), config(train={**steps, 'global_batch_size': 16}), 10, 80
  )


@pytest.mark.parametrize('rampup', [(4, 12, 64), (8, 4, 64)])
def test_a_rampup_batch_that_the_data_ranks_micro_batches_do_not_divide_is_refused(rampup):
  """Every global batch of the ramp-up must be whole micro-batches on every data rank (the
  chronicles' tr8b ramp had to be picked so): a start or an increment that is not a multiple of
  micro_batch_size x data is one error before anything starts; multiples of it pass."""
  base = {'train': dict(steps=10, global_batch_size=64, micro_batch_size=4), 'mesh': {'data': 2}}
  bad = Config.from_dict({**base, 'train': {**base['train'], 'rampup_batch_size': rampup}})
  with pytest.raises(ConfigError) as found:
    startup.check_config(bad)
  assert 'micro_batch_size x mesh.data (8) does not divide' in str(found.value)
  good = Config.from_dict({**base, 'train': {**base['train'], 'rampup_batch_size': (8, 8, 64)}})
  startup.check_config(good)


def test_rampup_microbatch_multiple_rounds_tr11s_ramp_to_fewer_programs():
  cfg = load_config_file(cfg_path('bloom_176b.py'))
  # 192 -> 2048 by 16 with 16 rows per micro-batch (2 x data 8): 12, 13, ..., 128 micro-batches.
  assert [m for m, _ in schedule.step_shapes(cfg)] == list(range(12, 129))
  assert schedule.padding_microbatches(cfg)[0] == 0
  padded = startup.check_config(cfg.replace(train={'rampup_microbatch_multiple': 8}))
  assert [m for m, _ in schedule.step_shapes(padded)] == list(range(16, 129, 8))  # 15 programs
  assert [schedule.step_microbatches(padded, g) for g in (192, 208, 320, 336, 2048)] == [
    16,
    16,
    24,
    24,
    128,
  ]
  assert padded.microbatches_for(208) == 13  # the batch itself, 3 padding micro-batches added
  # Counted over the run: 0.31% of the micro-batches the step runs are padding, all of them in
  # the ramp-up's 12,658 iterations.
  padding, runs = schedule.padding_microbatches(padded)
  assert runs == schedule.padding_microbatches(cfg)[1] + padding
  assert round(100 * padding / runs, 2) == 0.31
  # A multiple of at least the full count: one program for the whole run.
  whole = startup.check_config(cfg.replace(train={'rampup_microbatch_multiple': 200}))
  assert schedule.step_shapes(whole) == [(128, 2048)]


@pytest.mark.parametrize(
  'train, message',
  [
    ({'rampup_microbatch_multiple': 4}, 'there is none'),
    (
      {'rampup_microbatch_multiple': -2, 'rampup_batch_size': (4, 4, 8)},
      'rampup_microbatch_multiple must be >= 0, got -2',
    ),
  ],
)
def test_bad_rampup_microbatch_multiple_is_one_clear_error(train, message):
  with pytest.raises(ConfigError, match=message):
    startup.check_config(Config().replace(train={'global_batch_size': 16, 'steps': 4, **train}))


def test_tr8_104b_and_1b3_sizes():
  cfg = load_config_file(cfg_path('tr8_104b.py'))
  assert cfg.model.architecture == 'gpt2'
  assert round(cfg.model.num_params(cfg.mesh.tensor) / 1e9) == 104
  cfg = load_config_file(cfg_path('bloom_1b3.py'))
  m = cfg.model
  assert (m.num_layers, m.hidden_size, m.num_heads, cfg.padded_vocab_size) == (24, 2048, 16, 250880)
  # BigScience names this size by its non-embedding parameters: 24 x (12h^2 + 13h) = 1.21B.
  assert abs(m.num_layers * (12 * m.hidden_size**2 + 13 * m.hidden_size) / 1e9 - 1.21) < 0.01
  startup.check_config(cfg.replace(mesh={'pipeline': 1}))


def test_every_shipped_config_validates_with_its_own_mesh():
  for name in sorted(os.listdir(os.path.join(REPO, 'configs'))):
    if name.endswith('.py'):
      startup.check_config(load_config_file(cfg_path(name)))


def test_cluster_configs_guard_against_hangs_and_the_job_time_limit():
  """The chronicles lost hours to silent NCCL hangs, to jobs killed mid-save at SLURM's limit
  and to hardware failures hours after the last save: every multi-node config turns on the hang
  watchdog, the exit before the limit, timed saves of at most an hour, and evaluation."""
  for name in ('bloom_176b.py', 'tr8_104b.py', 'bloom_1b3.py'):
    cfg = load_config_file(cfg_path(name))
    assert cfg.runtime.hang_timeout_mins > 0, name
    assert 0 < cfg.checkpoint.save_interval_mins <= 60, name
    assert 0 < cfg.runtime.exit_duration_mins < 20 * 60, name
    assert cfg.eval.interval > 0 and cfg.runtime.replica_check_interval > 0, name


def test_curriculum_follows_deepspeeds_seqlen_schedules_with_tr8bs_settings():
  """tr8b: min_difficulty 64, max 2048, fixed_linear over 36,000 steps, difficulty_step 8."""
  cfg = Config().replace(
    train={'seq_len': 2048, 'steps': 40_000},
    curriculum={'min_seq_len': 64, 'total_iterations': 36_000},
  )
  startup.check_config(cfg)
  # floor(64 + 1984 * n / 36000), rounded down to a multiple of 8; iteration n is 1-based.
  assert [schedule.seq_len_at(cfg, n) for n in (1, 145, 146, 18_000, 35_999, 36_000, 39_999)] == [
    64,
    64,
    72,
    1056,
    2040,
    2048,
    2048,
  ]
  lengths = [schedule.seq_len_at(cfg, n) for n in range(1, 40_001)]
  assert lengths == sorted(lengths) and all(n % 8 == 0 for n in lengths)
  # 249 lengths: one compiled step each
  assert schedule.seq_lens(cfg) == list(range(64, 2049, 8))
  root = cfg.replace(curriculum={'schedule': 'fixed_root', 'root_degree': 2})
  # sqrt(9000 / 36000) = 0.5: halfway in length at a quarter of the iterations.
  assert [schedule.seq_len_at(root, n) for n in (1, 9000, 36_000)] == [72, 1056, 2048]
  assert schedule.seq_len_at(Config(), 5) == Config().train.seq_len  # no curriculum
  # The step runs at the trained lengths.
  assert schedule.step_seq_lens(cfg) == schedule.seq_lens(cfg)
  # curriculum.pad_to_multiple=256: the step runs at 8 lengths, each iteration's rounded up.
  padded = cfg.replace(curriculum={'pad_to_multiple': 256})
  startup.check_config(padded)
  assert schedule.seq_lens(padded) == schedule.seq_lens(cfg)
  assert schedule.step_seq_lens(padded) == list(range(256, 2049, 256))
  assert [schedule.padded_seq_len_at(padded, n) for n in (1, 145, 3_629, 3_630, 36_000)] == [
    256,
    256,
    256,
    512,
    2048,
  ]
  # The lengths trained on.
  assert [schedule.seq_len_at(padded, n) for n in (1, 3_629, 3_630)] == [64, 256, 264]
  # A multiple above train.seq_len: every iteration at the full length, one program.
  assert schedule.step_seq_lens(cfg.replace(curriculum={'pad_to_multiple': 4096})) == [2048]


def test_warmup_end_tokens_follow_the_curriculum_and_the_batch_ramp():
  cfg = Config().replace(
    train={
      'seq_len': 32,
      'global_batch_size': 8,
      'micro_batch_size': 2,
      'rampup_batch_size': (4, 4, 8),
      'steps': 6,
    },
    curriculum={'min_seq_len': 8, 'total_iterations': 4},
    optimizer={'warmup_samples': 10},
  )
  # Lengths 8, 16, 24, 32, 32, 32 (iteration n: floor(8 + 24 n / 4) rounded down to 8); global
  # batches 4, 4, 8, 8, ... (the ramp adds 4 after 8 samples).
  assert [schedule.seq_len_at(cfg, n) for n in range(1, 7)] == [8, 16, 24, 32, 32, 32]
  # The warm-up ends at the first iteration boundary at or past 10 samples: after iteration 3
  # (4 + 4 + 8 samples), whose tokens are those of the three lengths.
  assert schedule.warmup_end_tokens(cfg) == 4 * 8 + 4 * 16 + 8 * 24
  assert schedule.warmup_end_tokens(cfg.replace(optimizer={'warmup_samples': 8})) == 4 * 8 + 4 * 16


@pytest.mark.parametrize(
  'sections, message',
  [
    ({'curriculum': {'min_seq_len': 12}}, 'multiples of curriculum.difficulty_step'),
    ({'train': {'seq_len': 60}, 'curriculum': {'min_seq_len': 8}}, 'never reach train.seq_len'),
    ({'curriculum': {'min_seq_len': 64}}, 'must be below train.seq_len'),
    ({'curriculum': {'min_seq_len': 8, 'total_iterations': 0}}, 'total_iterations'),
    ({'curriculum': {'min_seq_len': 8, 'schedule': 'fixed_discrete'}}, "'fixed_linear'"),
    (
      {'optimizer': {'warmup_samples': 16, 'decay_tokens': 100}},
      'must exceed the 1024 tokens consumed by the end of the warm-up',
    ),
    ({'curriculum': {'pad_to_multiple': 16}}, 'there is none'),
    (
      {'curriculum': {'min_seq_len': 8, 'pad_to_multiple': 12}},
      'positive multiple of curriculum.difficulty_step',
    ),
    (
      {'curriculum': {'min_seq_len': 8, 'pad_to_multiple': -8}},
      'curriculum.pad_to_multiple must be >= 0, got -8',
    ),
  ],
)
def test_bad_curriculum_or_token_decay_is_one_clear_error(sections, message):
  base = {'train': {'seq_len': 64, 'steps': 10}, 'curriculum': {'total_iterations': 5}}
  for name, values in sections.items():
    base[name] = {**base.get(name, {}), **values}
  with pytest.raises(ConfigError, match=message):
    startup.check_config(Config().replace(**base))


# --------------------------------------------------------------------- declared allowed values


def _wrong_value(choices):
  """A value outside `choices`: for words the first one upper-cased (the likeliest typo), else
  'bogus'; for numbers the first one missing between them (mesh.zero_stage's 2)."""
  if all(isinstance(c, int) for c in choices):
    return next(n for n in range(min(choices), max(choices) + 2) if n not in choices)
  first = str(choices[0]).upper()
  return first if first not in choices else 'bogus'


def _literal_fields():
  """{'section.key': its allowed values} of every field annotated Literal[...]."""
  return {
    f'{section}.{name}': typing.get_args(hint)
    for section, cls in config_lib.SECTIONS.items()
    for name, hint in typing.get_type_hints(cls).items()
    if typing.get_origin(hint) is typing.Literal
  }


@pytest.mark.parametrize('key', sorted(_literal_fields()))
def test_every_literal_key_refuses_a_value_outside_its_annotation(key):
  """Found by introspection: a new Literal key is covered without a new row."""
  section, _, name = key.partition('.')
  choices = _literal_fields()[key]
  assert choices and len({type(c) for c in choices}) == 1
  assert isinstance(choices[0], (str, int))
  bad = _wrong_value(choices)
  cfg = Config().replace(train={'steps': 1}, **{section: {name: bad}})
  with pytest.raises(ConfigError) as error:
    startup.check_config(cfg)
  message = str(error.value)
  assert message.startswith(f'{key} must be ') and repr(bad) in message, message
  assert all(repr(c) in message for c in choices), message
  # Every allowed value passes the declaration check.
  for choice in choices:
    Config().replace(**{section: {name: choice}}).check_values()


def test_the_literal_keys_are_the_annotated_ones():
  fields = _literal_fields()
  assert len(fields) >= 8 and {'pipeline.schedule', 'curriculum.schedule'} <= set(fields)
  assert config_lib.literal_keys() == list(fields)
  assert all(config_lib.allowed_values(key) == choices for key, choices in fields.items())
  assert config_lib.allowed_values('pipeline.schedule') == ('gpipe', '1f1b')
  assert config_lib.allowed_values('train.steps') is None


def test_ranges_are_declared_beside_their_fields():
  assert config_lib.numeric_range('train.seed') == (0, 2**32 - 1, '[]')
  assert config_lib.numeric_range('optimizer.eps') == (0, math.inf, '(]')
  assert config_lib.numeric_range('train.steps') == (0, math.inf, '[]')  # undeclared: >= 0


def test_a_value_of_the_wrong_type_is_refused_however_the_config_was_built():
  cfg = Config(train=dataclasses.replace(Config().train, steps=1, rampup_microbatch_multiple=2.5))
  with pytest.raises(ConfigError, match='train.rampup_microbatch_multiple must be of type int'):
    cfg.validate()


def test_train_refuses_a_wrong_pipeline_schedule_before_creating_the_workdir(tmp_path):
  workdir = tmp_path / 'W'
  r = run_cli(
    [
      '-m',
      't5x_like.train',
      '--config',
      cfg_path('tiny.py'),
      '--workdir',
      str(workdir),
      '--config.pipeline.schedule=1F1B',
    ]
  )
  assert r.returncode == 2, r.stdout + r.stderr
  errors = [line for line in r.stderr.splitlines() if 'error:' in line]
  assert len(errors) == 1 and 'Traceback' not in r.stderr, r.stderr
  assert "pipeline.schedule must be 'gpipe' or '1f1b', got '1F1B'" in errors[0], errors[0]
  assert not workdir.exists()


# ------------------------------------------------- data.split applies to the data it splits


@pytest.mark.parametrize(
  'overrides',
  [
    {'data.mixture_or_task': 't5x_like_corpus_mix'},
    {
      'data.train_weighted_split_paths': CommandLineValue('train: 1 0:0.95 /d/en'),
      'data.valid_weighted_split_paths': CommandLineValue('valid: 1 0.95:1 /d/en'),
    },
  ],
)
def test_a_shipped_split_for_the_embedded_corpus_does_not_block_other_sources(overrides):
  cfg = load_config_file(cfg_path('tiny.py'), overrides)
  assert cfg.data.split != Config().data.split  # tiny's split, for the embedded corpus
  startup.check_config(cfg)


@pytest.mark.parametrize(
  'overrides, message',
  [
    (
      {'data.mixture_or_task': 't5x_like_corpus_mix', 'data.train_path': '/d/en'},
      'and data.train_path too; keep one of the two',
    ),
    (
      {'data.train_weighted_split_paths': 'train: 1 0:0.95 /d/en', 'data.train_path': '/d/en'},
      'data.train_path .* cannot be combined with data.\\*_weighted_split_paths',
    ),
  ],
)
def test_data_that_the_split_cuts_still_conflicts_with_other_sources(overrides, message):
  with pytest.raises(ConfigError, match=message):
    startup.check_config(load_config_file(cfg_path('tiny.py'), overrides))


def test_unrolled_layers_under_full_recomputation_are_refused():
  # XLA merges an unrolled layer's recomputed forward into its forward: 'full' would keep what
  # 'save_dots' keeps (XLA's H100 compiles of configs/bloom_1b3.py, docs/benchmarks.md).
  unrolled = Config().replace(
    train={'steps': 1}, model={'unroll_layers': True, 'remat_policy': 'full'}
  )
  with pytest.raises(ConfigError, match="unroll_layers=True under model.remat_policy='full'"):
    unrolled.validate()
  for policy in ('save_dots', 'none'):
    unrolled.replace(model={'remat_policy': policy}).validate()
  unrolled.replace(model={'unroll_layers': False}).validate()
