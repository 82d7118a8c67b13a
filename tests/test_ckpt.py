"""`python -m t5x_like.ckpt import-hf / export-hf` against HF transformers, plus `evaluate`."""

import json
import os

import numpy as np
import pytest
import torch
import transformers

from t5x_like import ckpt, evaluate

from conftest import run_cli


def random_bloom(tmp_path, n_head, vocab, hidden=48, layers=2, seed=0):
  torch.manual_seed(seed)
  cfg = transformers.BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers,
                                 n_head=n_head, hidden_dropout=0.0, attention_dropout=0.0)
  model = transformers.BloomForCausalLM(cfg).eval()
  with torch.no_grad():  # Non-trivial LayerNorms and biases, so a dropped one shows.
    for name, p in model.named_parameters():
      if 'bias' in name or 'layernorm' in name or 'ln_f' in name:
        p.add_(0.1 * torch.randn_like(p))
  hf_dir = str(tmp_path / f'hf_{n_head}_{vocab}')
  model.save_pretrained(hf_dir, safe_serialization=True)
  return model, hf_dir


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
  cfg, params = evaluate.load_for_inference(out, 'float32')
  result = evaluate.evaluate(cfg, params, tokens, batch_size=2)  # a padded last batch too
  assert result['tokens'] == 5 * 16
  assert abs(result['loss'] - hf_loss(model, tokens)) < 1e-5


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


def test_cli_subprocesses_and_bad_inputs(tmp_path):
  model, hf_dir = random_bloom(tmp_path, 4, 300, hidden=32)
  out = str(tmp_path / 'ckpt')
  r = run_cli(['-m', 't5x_like.ckpt', 'import-hf', hf_dir, out])
  assert r.returncode == 0, r.stderr
  tokens = np.random.default_rng(1).integers(0, 300, (3, 9))
  data = str(tmp_path / 't.npy')
  np.save(data, tokens)
  r = run_cli(['-m', 't5x_like.evaluate', '--checkpoint', out, '--data', data,
               '--dtype', 'float32'])
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
