"""`python -m t5x_like.generate` against transformers' `generate` on the same imported weights."""

import json

import torch

from t5x_like import ckpt, evaluate, generate
from t5x_like.data.tokenizer import Tokenizer

from conftest import random_bloom, run_cli


def imported(tmp_path, n_head, vocab, hidden):
  """A random BLOOM whose layers outweigh its embedding LayerNorm (their weights x 30): at HF's
  init std the output is the last input token's embedding, and greedy decoding would only
  repeat it, which any model that keeps the residual would match."""
  model, hf_dir = random_bloom(tmp_path, n_head, vocab, hidden=hidden)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'dense' in name and name.endswith('weight'):
        p.mul_(30.0)
  hf_dir += '_x30'
  model.save_pretrained(hf_dir, safe_serialization=True)
  out = str(tmp_path / f'ckpt_{vocab}')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  return model, out


def test_greedy_generation_is_hf_generate_and_sampling_follows_its_seed(tmp_path):
  model, out = imported(tmp_path, 4, 300, hidden=32)
  cfg, params = evaluate.load_for_inference(out, 'float32')
  prompt = [5, 17, 42, 7, 250]
  ours = generate.generate_ids(cfg, params, prompt, 12, eod_id=model.config.eos_token_id)
  with torch.no_grad():
    hf = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                        eos_token_id=model.config.eos_token_id,
                        pad_token_id=model.config.eos_token_id)[0, len(prompt):].tolist()
  assert ours == hf and len(set(ours)) > 3  # a varied continuation, not one token repeated
  # Sampling is a function of the seed; top-k 1 leaves only the greedy token.
  sample = lambda seed, **kw: generate.generate_ids(cfg, params, prompt, 12, temperature=1.5,
                                                    seed=seed, **kw)
  assert sample(3) == sample(3) and sample(3) != sample(4)
  assert sample(3, top_k=1) == generate.generate_ids(cfg, params, prompt, 12)


def test_cli_continues_text_with_the_shipped_tokenizer_and_refuses_a_smaller_model(tmp_path):
  _, out = imported(tmp_path, 4, 8192, hidden=32)
  r = run_cli(['-m', 't5x_like.generate', '--checkpoint', out, '--prompt', 'def f(x):',
               '--max_new_tokens', '5', '--dtype', 'float32'])
  assert r.returncode == 0, r.stderr
  result = json.loads(r.stdout.strip().splitlines()[-1])
  tokenizer = Tokenizer.load_default()
  assert result['prompt_ids'] == tokenizer.encode('def f(x):')
  assert 1 <= len(result['completion_ids']) <= 5
  ids = result['completion_ids']
  text_ids = ids[:-1] if ids[-1] == tokenizer.eod_id else ids
  assert result['completion'] == tokenizer.decode(text_ids)
  assert r.stdout.startswith('def f(x):' + result['completion'])
  # A model whose vocabulary is smaller than the tokenizer's: one message, before the restore.
  _, small = imported(tmp_path, 4, 300, hidden=32)
  r = run_cli(['-m', 't5x_like.generate', '--checkpoint', small, '--prompt', 'x'])
  assert r.returncode == 2 and 'the tokenizer has 8192 tokens' in r.stderr
  assert generate.main(['--checkpoint', small, '--prompt', 'x', '--max_new_tokens', '0']) == 2
