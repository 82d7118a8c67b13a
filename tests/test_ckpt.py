"""`python -m t5x_like.ckpt import-hf / export-hf` against HF transformers, plus `evaluate`."""

import json
import os
import shutil
import types
import unittest.mock

import numpy as np
import pytest
import torch
import transformers
from conftest import random_bloom, run_cli

from t5x_like.cli import ckpt, evaluate
from t5x_like.data.indexed import IndexedDatasetWriter
from t5x_like.inference import loading as inference


def hf_loss(model, tokens):
  with torch.no_grad():
    out = model(torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long())
  return float(out.loss)


@pytest.mark.parametrize('n_head, vocab', [(6, 333), (4, 1000), (5, 250)])
def test_import_hf_then_evaluate_gives_hf_loss(tmp_path, n_head, vocab):
  model, hf_dir = random_bloom(tmp_path, n_head, vocab, hidden=n_head * 8)
  out = str(tmp_path / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  tokens = np.random.default_rng(0).integers(0, vocab, (5, 17)).astype(np.int32)
  data = str(tmp_path / 'tokens.npy')
  np.save(data, tokens)
  cfg, params = inference.load_for_inference(out, 'float32')
  want = hf_loss(model, tokens)
  # The default chunked loss (here 100 vocabulary rows at a time: several chunks, the padded rows
  # in the last) and the dense one; a padded last batch too.
  chunked = cfg.replace(model={'cross_entropy_chunk': 100})
  for loss_cfg, cross_entropy in ((chunked, 'chunked'), (cfg, 'dense')):
    result = evaluate.evaluate(loss_cfg, params, tokens, batch_size=2, cross_entropy=cross_entropy)
    assert result['tokens'] == 5 * 16
    assert abs(result['loss'] - want) < 1e-5, cross_entropy


def test_evaluate_chunked_never_holds_full_logits(tmp_path):
  _, hf_dir = random_bloom(tmp_path, 4, 1000, hidden=32)
  out = str(tmp_path / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  cfg, params = inference.load_for_inference(out, 'float32')
  cfg = cfg.replace(model={'cross_entropy_chunk': 256})
  batch, valid = np.zeros((2, 17), np.int32), np.ones(2, np.float32)
  full_logits = f'tensor<2x16x{cfg.padded_vocab_size}xf32>'
  for cross_entropy, has_full_logits in (('dense', True), ('chunked', False)):
    hlo = evaluate.batch_loss_sum_fn(cfg, cross_entropy).lower(params, batch, valid).as_text()
    assert (full_logits in hlo) == has_full_logits, cross_entropy


def test_evaluate_on_data_and_tensor_meshes_gives_hf_loss(tmp_path):
  """One checkpoint evaluated on 1x1, 2x2, 1x3 and 2x3 (data x tensor): the weights are really
  split over `tensor`, the saved 256-row padded vocabulary is rounded up to 258 where 3 does not
  divide it, and every mesh gives HF's loss, through the command line too."""
  import jax

  n_head, vocab = 6, 200
  model, hf_dir = random_bloom(tmp_path, n_head, vocab, hidden=48)
  out = str(tmp_path / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  tokens = np.random.default_rng(2).integers(0, vocab, (5, 13)).astype(np.int32)
  want = hf_loss(model, tokens)
  for data, tensor in ((1, 1), (2, 2), (1, 3), (2, 3)):
    cfg, params = inference.load_for_inference(out, 'float32', data=data, tensor=tensor)
    qkv = params['layers']['attn']['qkv_kernel']
    assert qkv.sharding.shard_shape(qkv.shape)[2] == n_head // tensor, (data, tensor)
    emb = params['word_embeddings']
    assert emb.shape[0] == (258 if tensor == 3 else 256)
    assert emb.sharding.shard_shape(emb.shape)[0] == emb.shape[0] // tensor
    assert len(jax.tree.leaves(params)[0].sharding.device_set) == data * tensor
    for cross_entropy in ('chunked', 'dense'):
      result = evaluate.evaluate(
        cfg, params, tokens, batch_size=2 * data, cross_entropy=cross_entropy
      )
      assert abs(result['loss'] - want) < 1e-5, (data, tensor, cross_entropy)
  data_file = str(tmp_path / 'tokens.npy')
  np.save(data_file, tokens)
  r = run_cli(
    [
      '-m',
      't5x_like.evaluate',
      '--checkpoint',
      out,
      '--data',
      data_file,
      '--mesh.data',
      '2',
      '--mesh.tensor',
      '3',
      '--batch_size',
      '4',
    ]
  )
  assert r.returncode == 0, r.stderr
  assert abs(json.loads(r.stdout.strip().splitlines()[-1])['loss'] - want) < 1e-5
  # A mesh the model or the batch cannot use: one message naming the flag, before any restore.
  for flags, message in (
    (['--mesh.tensor', '4'], 'mesh.tensor'),
    (['--mesh.data', '2', '--batch_size', '3'], '--batch_size'),
    (['--mesh.data', '0'], '--mesh.data'),
  ):
    r = run_cli(['-m', 't5x_like.evaluate', '--checkpoint', out, '--data', data_file] + flags)
    assert r.returncode == 2 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr


def test_export_hf_gives_back_the_original_logits(tmp_path):
  model, hf_dir = random_bloom(tmp_path, 6, 333)
  out = str(tmp_path / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  exported = str(tmp_path / 'exported')
  assert ckpt.main(['export-hf', out, exported]) == 0
  again = transformers.BloomForCausalLM.from_pretrained(exported).eval()
  tokens = torch.randint(0, 333, (2, 11))
  with torch.no_grad():
    np.testing.assert_array_equal(again(tokens).logits.numpy(), model(tokens).logits.numpy())


def test_export_hf_names_the_special_tokens_of_the_datas_tokenizer(tmp_path, monkeypatch):
  """Without a tokenizer BLOOM's ids; with the shipped one (pad 0, eos 1, unk 2, bos 3) its
  own, or HF's `generate` would write past the data's end of document. Bare relative output
  names, as a user in the run's directory types them."""
  from t5x_like.data.tokenizer import DEFAULT_MODEL_PATH

  monkeypatch.chdir(tmp_path)
  _, hf_dir = random_bloom(tmp_path, 2, 8192, hidden=16, layers=1)
  assert ckpt.main(['import-hf', hf_dir, 'ckpt']) == 0
  assert ckpt.main(['export-hf', 'ckpt', 'bloom_ids']) == 0
  assert ckpt.main(['export-hf', 'ckpt', 'shipped', '--tokenizer_model', DEFAULT_MODEL_PATH]) == 0

  def ids(directory):
    with open(os.path.join(directory, 'config.json')) as f:
      config = json.load(f)
    return [config[f'{k}_token_id'] for k in ('bos', 'eos', 'pad')]

  assert ids('bloom_ids') == [1, 2, 3] and ids('shipped') == [3, 1, 0]


def test_a_tokenizer_without_bos_or_pad_exports_its_end_of_document_for_them():
  """GPT-2's tokenizer has only <|endoftext|>; a SentencePiece model may have no bos (-1):
  BLOOM's 1 and 3 would be ordinary tokens of theirs."""
  gpt2_like = types.SimpleNamespace(eod_id=50256, bos_id=None, pad_id=None)
  assert ckpt.special_token_ids(gpt2_like) == dict.fromkeys(
    ('bos_token_id', 'eos_token_id', 'pad_token_id'), 50256
  )
  no_bos = types.SimpleNamespace(eod_id=1, bos_id=-1, pad_id=0)
  assert ckpt.special_token_ids(no_bos) == {'bos_token_id': 1, 'eos_token_id': 1, 'pad_token_id': 0}


def test_evaluate_on_a_megatron_dataset_reads_consecutive_samples_of_its_documents(
  tmp_path, capsys
):
  model, hf_dir = random_bloom(tmp_path, 4, 300, hidden=32)
  out = str(tmp_path / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  rng = np.random.default_rng(2)
  documents = [rng.integers(0, 300, n) for n in (30, 7, 41, 12, 25)]
  prefix = str(tmp_path / 'held_out')
  with IndexedDatasetWriter(prefix, np.uint16) as writer:
    for document in documents:
      writer.add_document(document)

  def run(*flags):
    code = evaluate.main(['--checkpoint', out, '--data', prefix, '--dtype', 'float32', *flags])
    captured = capsys.readouterr()
    return code, (json.loads(captured.out.strip().splitlines()[-1]) if code == 0 else captured.err)

  def samples(tokens, seq_len):  # what the docstring promises: stride S, S + 1 tokens each
    count = (len(tokens) - 1) // seq_len
    return np.stack([tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])

  every = np.concatenate(documents).astype(np.int32)
  want = samples(every, 8)
  code, result = run('--seq_len', '8', '--batch_size', '4')
  assert code == 0 and result['tokens'] == want.shape[0] * 8 == 112
  assert abs(result['loss'] - hf_loss(model, want)) < 1e-5
  code, result = run('--seq_len', '8', '--max_samples', '3')
  assert result['tokens'] == 24 and abs(result['loss'] - hf_loss(model, want[:3])) < 1e-5
  # One share of a split: 60,20,20 of 5 documents gives document 3 (12 tokens) to `valid`.
  code, result = run('--seq_len', '5', '--documents', 'valid', '--split', '60,20,20')
  valid = samples(documents[3].astype(np.int32), 5)
  assert code == 0 and result['tokens'] == 10
  assert abs(result['loss'] - hf_loss(model, valid)) < 1e-5
  # Bad input: one message and exit 2 each, before the checkpoint is restored.
  code, err = run('--seq_len', '20', '--documents', 'valid', '--split', '60,20,20')
  assert code == 2 and 'fewer than one sample' in err
  code, err = run('--split', 'a,b')
  assert code == 2 and '--split' in err
  assert evaluate.main(['--checkpoint', out, '--data', str(tmp_path / 'missing')]) == 2
  assert 'neither a .npy file nor a dataset prefix' in capsys.readouterr().err
  np.save(tmp_path / 't.npy', want)
  assert (
    evaluate.main(['--checkpoint', out, '--data', str(tmp_path / 't.npy'), '--seq_len', '8']) == 2
  )
  with IndexedDatasetWriter(str(tmp_path / 'wide'), np.uint16) as writer:
    writer.add_document(np.full(20, 300))
  assert (
    evaluate.main(['--checkpoint', out, '--data', str(tmp_path / 'wide'), '--seq_len', '8']) == 2
  )
  assert 'token id 300' in capsys.readouterr().err


def test_cli_subprocesses_and_bad_inputs(tmp_path):
  model, hf_dir = random_bloom(tmp_path, 4, 300, hidden=32)
  out = str(tmp_path / 'ckpt')
  r = run_cli(['-m', 't5x_like.ckpt', 'import-hf', hf_dir, out])
  assert r.returncode == 0, r.stderr
  tokens = np.random.default_rng(1).integers(0, 300, (3, 9))
  data = str(tmp_path / 't.npy')
  np.save(data, tokens)
  r = run_cli(
    ['-m', 't5x_like.evaluate', '--checkpoint', out, '--data', data, '--dtype', 'float32']
  )
  assert r.returncode == 0, r.stderr
  result = json.loads(r.stdout.strip().splitlines()[-1])
  assert set(result) == {'loss', 'ppl', 'tokens'} and result['tokens'] == 3 * 8
  assert abs(result['loss'] - hf_loss(model, tokens.astype(np.int32))) < 1e-5
  # Bad inputs: one clear message each, exit code 2, nothing half-written.
  assert ckpt.main(['import-hf', hf_dir, out]) == 2  # output not empty
  assert ckpt.main(['import-hf', str(tmp_path / 'nope'), str(tmp_path / 'x')]) == 2
  assert not os.path.exists(tmp_path / 'x') or not os.listdir(tmp_path / 'x')
  np.save(data, np.full((2, 4), 999))
  assert evaluate.main(['--checkpoint', out, '--data', data]) == 2
  assert evaluate.main(['--checkpoint', str(tmp_path / 'none'), '--data', data]) == 2


def one_error(err, *fragments):
  """The one `error:` line of `err`, which holds every fragment; no traceback."""
  errors = [line for line in err.splitlines() if line.startswith('error:')]
  assert len(errors) == 1 and 'Traceback' not in err, err
  assert all(fragment in errors[0] for fragment in fragments), err
  return errors[0]


def test_import_hf_refuses_non_finite_weights_and_writes_nothing(tmp_path, capfd):
  from safetensors.numpy import load_file, save_file

  _, hf_dir = random_bloom(tmp_path, 4, 300, hidden=32)
  weights = os.path.join(hf_dir, 'model.safetensors')
  state = load_file(weights)
  qkv = 'transformer.h.1.self_attention.query_key_value.weight'
  state[qkv][0, :3] = np.nan
  state[qkv][2, 5] = -np.inf
  state['transformer.ln_f.bias'][7] = np.inf
  save_file(state, weights, metadata={'format': 'pt'})
  capfd.readouterr()
  out = tmp_path / 'ckpt'
  assert ckpt.main(['import-hf', hf_dir, str(out)]) == 2
  one_error(
    capfd.readouterr().err,
    'non-finite values in 2 tensor(s)',
    f"'{qkv}' (3 NaN, 1 Inf of 3072 values)",
    "'transformer.ln_f.bias' (1 Inf of 32",
  )
  assert not out.exists()
  # Into an existing empty directory: still empty.
  out.mkdir()
  assert ckpt.main(['import-hf', hf_dir, str(out)]) == 2
  one_error(capfd.readouterr().err, 'non-finite values')
  assert os.listdir(out) == []


def test_export_hf_refuses_a_checkpoint_with_non_finite_params(tmp_path, capfd):
  from t5x_like.checkpointing import checkpoints, hf

  _, hf_dir = random_bloom(tmp_path, 4, 300, hidden=32)
  config, state = hf.load_hf_dir(hf_dir)
  cfg = ckpt.import_hf(hf_dir, str(tmp_path / 'ckpt'))
  params = hf.params_from_hf_state(state, cfg.model, cfg.padded_vocab_size)
  params['layers']['mlp']['wi_kernel'][1, 0, :4] = np.nan  # layer 1
  nan_ckpt = str(tmp_path / 'nan_ckpt')
  checkpoints.save_params(nan_ckpt, params, cfg)  # as a bit flip or another writer could leave
  capfd.readouterr()
  exported = tmp_path / 'exported'
  assert ckpt.main(['export-hf', nan_ckpt, str(exported)]) == 2
  one_error(
    capfd.readouterr().err,
    "'layers/mlp/wi_kernel' (4 NaN of 8192 values; layer(s) 1)",
    'ckpt verify',
  )
  assert not exported.exists()
  assert sorted(os.listdir(tmp_path)) == ['ckpt', 'hf_4_300', 'nan_ckpt']


# ------------------------------------------------- inspect / diff / verify / stats, bad input


def save_fake_run(root, steps, mesh=(2, 1, 2), seed=0, edit=None, count=None, model=None):
  """Checkpoints of a small BLOOM on `mesh` (initial weights of `seed`, Adam moments filled
  with non-zero values), one per step, whose Adam count is consistent unless `count` says."""
  import jax
  import jax.numpy as jnp
  from conftest import small_config

  from t5x_like.checkpointing import checkpoints
  from t5x_like.mesh import partitioning
  from t5x_like.parallel.train_state import Progress, TrainState, make_layout

  cfg = small_config(
    mesh=dict(zip(('data', 'pipeline', 'tensor'), mesh)), model=model or {}
  ).validate()
  layout = make_layout(cfg, partitioning.make_mesh(*mesh))
  state = layout.init(seed)
  adam = state.opt_state[0]
  checkpointer = checkpoints.Checkpointer(root, 1, 10, layout)
  for step in steps:
    params = edit(state.params) if edit else state.params
    moments = jax.tree.map(lambda p: jnp.abs(p) + 1e-3, state.params)
    opt = (
      adam._replace(
        count=jnp.int32(step if count is None else count),
        mu=moments,
        nu=jax.tree.map(jnp.square, moments),
      ),
      *state.opt_state[1:],
    )
    progress = Progress(
      iteration=step, consumed_samples=8 * step, consumed_tokens=8 * step * cfg.train.seq_len
    )
    meta = checkpoints.make_meta(
      cfg, progress, cfg.train.seed, {'iteration': 0, 'skipped_iterations': 0}
    )
    # The Checkpointer never writes non-finite params; a NaN checkpoint made here stands for
    # one that a bit flip, or another writer, left for `verify` to find.
    with unittest.mock.patch.object(checkpoints, 'all_finite', lambda tree: True):
      checkpointer.save(TrainState(params, opt), progress, cfg, meta)
  checkpointer.close()
  return cfg, layout


@pytest.fixture(scope='module')
def fake_run(tmp_path_factory):
  root = str(tmp_path_factory.mktemp('fake') / 'checkpoints')
  save_fake_run(root, steps=(1, 2))
  return root


def run_ckpt(capsys, *argv):
  code = ckpt.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_inspect_shows_step_config_and_tensors_from_metadata_only(fake_run, capsys, monkeypatch):
  from t5x_like.checkpointing import inspection as checkpoint_inspection

  def no_data(*_):
    raise AssertionError('inspect read tensor data')

  monkeypatch.setattr(checkpoint_inspection.CheckpointReader, 'chunks', no_data)
  code, out, _ = run_ckpt(capsys, 'inspect', fake_run, '--step', '1', '--json')
  assert code == 0
  info = json.loads(out)
  assert (info['step'], info['steps_in_root'], info['progress']['iteration']) == (1, [1, 2], 1)
  assert info['saved_mesh'] == {
    'data': 2,
    'pipeline': 1,
    'tensor': 2,
    'zero_stage': 1,
    'zero_group': 0,
  }
  assert info['model']['num_layers'] == 2 and info['meta']['lr_schedule']['lr'] == 1e-3
  tensors = {t['name']: t for t in info['tensors']}
  emb = tensors['params/word_embeddings']
  assert (emb['shape'], emb['dtype'], emb['bytes']) == ([1024, 64], 'float32', 1024 * 64 * 4)
  assert emb['sharding'] == "P('tensor', 'data') on data=2 pipeline=1 tensor=2"
  assert tensors['opt_state/0.count']['dtype'] == 'int32'
  assert {'opt_state/0.mu.word_embeddings', 'opt_state/0.nu.word_embeddings'} <= set(tensors)
  assert info['total_bytes']['opt_state'] == 2 * info['total_bytes']['params'] + 4
  assert 0 < info['disk_bytes']
  code, out, _ = run_ckpt(capsys, 'inspect', os.path.join(fake_run, '2'))  # a step directory
  assert code == 0
  assert 'step 2' in out and 'params/layers.attn.qkv_kernel' in out and 'total: params' in out
  assert 'written by: python ' in out and f'jax {info["meta"]["software"]["jax"]}' in out
  assert 'steps kept past the keep policy: none; temporary (timed saves' in out


def test_diff_reports_each_tensor_and_fails_beyond_atol(fake_run, tmp_path, capsys):
  code, out, _ = run_ckpt(capsys, 'diff', fake_run, os.path.join(fake_run, '1'))
  assert code == 1  # steps 2 and 1 differ in the Adam step count only
  assert 'opt_state/0.count' in out.splitlines()[-1] and 'params/' not in out.splitlines()[-1]
  code, out, _ = run_ckpt(capsys, 'diff', fake_run, fake_run, '--step-b', '2')
  assert code == 0 and 'every tensor is equal within atol=0' in out
  other = str(tmp_path / 'other')
  save_fake_run(
    other,
    steps=(2,),
    mesh=(1, 1, 1),
    edit=lambda p: {**p, 'final_ln': {**p['final_ln'], 'scale': p['final_ln']['scale'] + 1e-3}},
  )
  code, out, _ = run_ckpt(capsys, 'diff', fake_run, other, '--json')
  result = json.loads(out)
  assert code == 1 and result['differ'] == ['params/final_ln.scale']  # saved on another mesh
  row = next(r for r in result['tensors'] if r['name'] == 'params/final_ln.scale')
  assert row['max_abs_diff'] == pytest.approx(1e-3, rel=1e-3)
  assert row['rel_norm_diff'] == pytest.approx(1e-3, rel=1e-3)  # the scale is all ones
  code, _, _ = run_ckpt(capsys, 'diff', fake_run, other, '--atol', '2e-3')
  assert code == 0


def test_verify_passes_a_sound_checkpoint_and_names_each_failure(fake_run, tmp_path, capsys):
  code, out, _ = run_ckpt(capsys, 'verify', fake_run)
  assert code == 0, out
  for check in (
    'finite',
    'adam step count',
    'progress',
    'shapes match the config',
    'restorable',
    'replicas identical',
  ):
    assert f'ok   {check}:' in out
  assert 'identical on all 4 devices of the saved mesh' in out
  # --no-restore: the streamed checks and the shapes, without holding the state in memory.
  code, out, _ = run_ckpt(capsys, 'verify', fake_run, '--no-restore')
  assert code == 0 and 'restorable' not in out and 'replicas identical' not in out
  for check in ('finite', 'adam step count', 'progress', 'shapes match the config'):
    assert f'ok   {check}:' in out
  assert out.strip().endswith('/2: verified (not restored: --no-restore)')
  # The chronicles' step-count bug: a checkpoint whose Adam count restarted at 0.
  lost = str(tmp_path / 'lost_count')
  save_fake_run(lost, steps=(3,), count=0)
  code, out, err = run_ckpt(capsys, 'verify', lost)
  assert code == 1 and 'FAIL adam step count: Adam step count 0, expected 3' in out
  assert 'FAILED (adam step count)' in err
  nan = str(tmp_path / 'nan')
  import jax.numpy as jnp

  save_fake_run(
    nan,
    steps=(1,),
    edit=lambda p: {**p, 'word_embeddings': p['word_embeddings'].at[3, 5].set(jnp.nan)},
  )
  for flags in ((), ('--no-restore',)):
    code, out, _ = run_ckpt(capsys, 'verify', nan, *flags)
    assert code == 1
    assert 'FAIL finite: 1 tensor(s) hold NaN or inf: params/word_embeddings' in out


def test_stats_streams_params_and_both_adam_moments(fake_run, capsys, monkeypatch):
  from t5x_like.checkpointing import inspection as checkpoint_inspection

  monkeypatch.setattr(checkpoint_inspection, 'CHUNK_BYTES', 4096)  # many slices per tensor
  code, out, _ = run_ckpt(capsys, 'stats', fake_run, '--json')
  assert code == 0
  rows = {r['name']: r for r in json.loads(out)}
  assert {r['group'] for r in rows.values()} == {'params', 'adam_mu', 'adam_nu'}
  reader = checkpoint_inspection.CheckpointReader(fake_run)
  for name in (
    'params/word_embeddings',
    'opt_state/0.nu.layers.mlp.wi_kernel',
    'params/final_ln.bias',
  ):
    info = next(t for t in reader.tensors() if t.key == name)
    x = np.concatenate([c.reshape(-1) for c in reader.chunks(info)]).astype(np.float64)
    r = rows[name]
    assert r['norm'] == pytest.approx(np.linalg.norm(x), rel=1e-9)
    assert r['mean'] == pytest.approx(x.mean(), rel=1e-9, abs=1e-15)
    assert r['std'] == pytest.approx(x.std(), rel=1e-9, abs=1e-15)
    assert (r['min'], r['max']) == (x.min(), x.max())
    assert r['zero_fraction'] == pytest.approx(np.mean(x == 0))
  assert rows['params/final_ln.bias']['zero_fraction'] == 1.0  # biases start at 0
  code, out, _ = run_ckpt(capsys, 'stats', fake_run)
  assert code == 0 and 'opt_state/0.mu.word_embeddings' in out


def test_bad_checkpoints_are_one_message_and_a_nonzero_exit(fake_run, tmp_path, capsys):
  def fails(code_wanted, message, *argv):
    code, out, err = run_ckpt(capsys, *argv)
    assert code == code_wanted and message in err, (argv, code, out, err)
    assert len(err.strip().splitlines()) == 1 and 'Traceback' not in err

  fails(2, 'does not exist', 'inspect', str(tmp_path / 'nope'))
  (tmp_path / 'a_file').write_text('x')
  fails(2, 'is a file, not a checkpoint directory', 'inspect', str(tmp_path / 'a_file'))
  os.makedirs(tmp_path / 'empty')
  fails(2, 'holds no complete checkpoint', 'verify', str(tmp_path / 'empty'))
  fails(2, 'step 7 is not in', 'stats', fake_run, '--step', '7')
  fails(
    2, 'is step 2, but step 1 was asked for', 'inspect', os.path.join(fake_run, '2'), '--step', '1'
  )
  truncated, removed = str(tmp_path / 'truncated'), str(tmp_path / 'removed')
  for copy in (truncated, removed):
    shutil.copytree(fake_run, copy)
  data = os.path.join(truncated, '2', 'params', 'ocdbt.process_0', 'd')
  os.truncate(max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize), 10)
  fails(2, 'is damaged', 'stats', truncated)
  # For verify a damaged step is a failed check (exit 1), as docs/checkpoints.md says.
  code, out, err = run_ckpt(capsys, 'verify', truncated)
  assert code == 1 and out.startswith('FAIL readable: ') and 'is damaged' in out, (out, err)
  assert err.strip().endswith('FAILED (readable)')
  fails(2, 'is damaged', 'diff', fake_run, truncated)
  os.remove(os.path.join(removed, '2', 'params', '_METADATA'))
  fails(2, 'is damaged: the metadata of its params item cannot be read', 'inspect', removed)
  # Another model shape: diff lists it; a config that does not match the arrays fails verify.
  wide = str(tmp_path / 'wide')
  save_fake_run(wide, steps=(2,), mesh=(1, 1, 1), model=dict(hidden_size=32, num_heads=4))
  code, out, _ = run_ckpt(capsys, 'diff', fake_run, wide)
  assert code == 1 and 'shapes differ: (1024, 64) vs (1024, 32)' in out
  shutil.rmtree(os.path.join(wide, '2', 'config'))
  shutil.copytree(os.path.join(fake_run, '2', 'config'), os.path.join(wide, '2', 'config'))
  code, out, _ = run_ckpt(capsys, 'verify', wide)
  assert code == 1 and 'FAIL shapes match the config: params/embed_ln.bias (32,)' in out
  assert 'FAIL restorable:' in out


def test_ckpt_tools_from_the_command_line(fake_run):
  r = run_cli(['-m', 't5x_like.ckpt', 'verify', fake_run])
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().endswith('/2: verified') and 'Traceback' not in r.stderr
  r = run_cli(['-m', 't5x_like.ckpt', 'inspect', '/no/such/checkpoints'])
  assert r.returncode == 2 and r.stderr.startswith('error: checkpoint path /no/such')


def test_rollback_makes_a_step_the_latest_and_keeps_the_later_ones_aside(
  fake_run, tmp_path, capsys
):
  """`ckpt rollback CKPT --to N`: the steps after N move to CKPT/.rolled_back/TIME/ (nothing
  deleted; moving them back undoes it), so the next run resumes from N. Never while a trainer
  holds the workdir; a step that is not a complete one, or already the latest, is refused."""
  from t5x_like.checkpointing import checkpoints
  from t5x_like.training import workdir as workdir_lib

  workdir = tmp_path / 'run'
  root = str(workdir / 'checkpoints')
  shutil.copytree(fake_run, root)
  running = workdir_lib.Lock(str(workdir))
  running.acquire()
  running.mark_started()
  code, _, err = run_ckpt(capsys, 'rollback', root, '--to', '1')
  assert code == 2 and 'is in use by another trainer' in err
  assert checkpoints.available_steps(root) == [1, 2]
  running.release()

  code, _, err = run_ckpt(capsys, 'rollback', root, '--to', '3')
  assert code == 2 and 'step 3 is not a complete checkpoint' in err and '[1, 2]' in err
  code, out, _ = run_ckpt(capsys, 'rollback', root, '--to', '1')
  assert code == 0
  assert checkpoints.available_steps(root) == [1]
  (aside,) = os.listdir(os.path.join(root, '.rolled_back'))
  target = os.path.join(root, '.rolled_back', aside)
  assert checkpoints.available_steps(target) == [2]
  assert f'moved step(s) 2 of {root} to {target}' in out
  assert f'the next run in {workdir} resumes from step 1' in out
  assert f'to undo: mv {target}/* {root}/' in out
  assert checkpoints.resolve(root) == (root, 1)
  code, _, err = run_ckpt(capsys, 'rollback', root, '--to', '1')
  assert code == 2 and 'step 1 is already the latest' in err
  assert os.path.exists(workdir / 'trainer.lock')  # the trainer's file, left as it was
