"""`python -m t5x_like.generate` (KV-cache decoding, t5x_like/inference/decoding.py) against
transformers' `generate` on the same imported weights."""

import json

import pytest
import torch
from conftest import random_bloom, run_cli, small_config

from t5x_like.cli import ckpt, generate
from t5x_like.config import ConfigError
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.inference import decoding
from t5x_like.inference import loading as inference


def imported(tmp_path, n_head, vocab, hidden, swap=None):
  """A random BLOOM whose layers outweigh its embedding LayerNorm (their weights x 30): at HF's
  init std the output is the last input token's embedding, and greedy decoding would only
  repeat it, which any model that keeps the residual would match. `swap`: two token ids whose
  (tied) embedding rows trade places, so the model writes each where it wrote the other while
  neither has been read."""
  model, hf_dir = random_bloom(tmp_path, n_head, vocab, hidden=hidden)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'dense' in name and name.endswith('weight'):
        p.mul_(30.0)
    if swap:
      table = model.transformer.word_embeddings.weight
      table[list(swap)] = table[list(reversed(swap))].clone()
  suffix = '_x30' + (f'_swap{swap[0]}_{swap[1]}' if swap else '')
  hf_dir += suffix
  model.save_pretrained(hf_dir, safe_serialization=True)
  out = str(tmp_path / f'ckpt_{vocab}{suffix}')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  return model, out


def test_greedy_generation_is_hf_generate_and_sampling_follows_its_seed(tmp_path):
  model, out = imported(tmp_path, 4, 300, hidden=32)
  cfg, params = inference.load_for_inference(out, 'float32')
  prompt = [5, 17, 42, 7, 250]
  [ours] = decoding.generate(cfg, params, [prompt], 12, eod_id=model.config.eos_token_id)
  with torch.no_grad():
    hf = model.generate(
      torch.tensor([prompt]),
      max_new_tokens=12,
      do_sample=False,
      eos_token_id=model.config.eos_token_id,
      pad_token_id=model.config.eos_token_id,
    )[0, len(prompt) :].tolist()
  assert ours == hf and len(set(ours)) > 3  # a varied continuation, not one token repeated
  # Sampling is a function of the seed; top-k 1 leaves only the greedy token.
  sample = lambda seed, **kw: decoding.generate(
    cfg, params, [prompt], 12, temperature=1.5, seed=seed, **kw
  )
  assert sample(3) == sample(3) and sample(3) != sample(4)
  assert sample(3, top_k=1) == decoding.generate(cfg, params, [prompt], 12)


def test_cli_continues_text_with_the_shipped_tokenizer_and_refuses_a_smaller_model(tmp_path):
  _, out = imported(tmp_path, 4, 8192, hidden=32)
  r = run_cli(
    [
      '-m',
      't5x_like.generate',
      '--checkpoint',
      out,
      '--prompt',
      'def f(x):',
      '--max_new_tokens',
      '5',
      '--dtype',
      'float32',
    ]
  )
  assert r.returncode == 0, r.stderr
  result = json.loads(r.stdout.strip().splitlines()[-1])
  tokenizer = Tokenizer.load_default()
  assert result['prompt_ids'] == tokenizer.encode('def f(x):')
  assert 1 <= len(result['completion_ids']) <= 5
  ids = result['completion_ids']
  text_ids = ids[:-1] if ids[-1] == tokenizer.eod_id else ids
  assert r.stdout.startswith(tokenizer.decode(result['prompt_ids'] + text_ids))
  assert r.stdout.startswith('def f(x):' + result['completion'])
  # A model whose vocabulary is smaller than the tokenizer's: one message, before the restore.
  _, small = imported(tmp_path, 4, 300, hidden=32)
  r = run_cli(['-m', 't5x_like.generate', '--checkpoint', small, '--prompt', 'x'])
  assert r.returncode == 2 and 'the tokenizer has 8192 tokens' in r.stderr
  assert generate.main(['--checkpoint', small, '--prompt', 'x', '--max_new_tokens', '0']) == 2


def test_the_completion_keeps_the_space_that_begins_it():
  """'The cat' continued by the piece '▁sat' prints 'The cat sat': decoded alone, the piece
  loses its space ('The catsat'). The end of document is left out of the text."""
  tokenizer = Tokenizer.load_default()
  prompt, whole = tokenizer.encode('The cat'), tokenizer.encode('The cat sat on it')
  assert whole[: len(prompt)] == prompt
  new = [*whole[len(prompt) :], tokenizer.eod_id]
  assert generate.completion_text(tokenizer, prompt, new) == ' sat on it'


def generated(capsys, argv):
  """`python -m t5x_like.generate ARGV`'s JSON line (in this process, on its 8 CPU devices)."""
  assert generate.main(argv) == 0
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_stops_at_the_end_of_document_and_runs_tensor_parallel(tmp_path, capsys):
  """The same greedy continuation on --mesh.tensor 2 as on 1. Then a copy of the model whose
  embedding rows of the end-of-document token and the continuation's third token are swapped:
  it writes the first two tokens as before, then the end-of-document token where it wrote the
  third, and the generation stops there (the token is kept in the ids, not in the text)."""
  eod = Tokenizer.load_default().eod_id
  _, out = imported(tmp_path, 4, 8192, hidden=32)
  # (This prompt's continuation varies; at hidden 32 others repeat one token.)
  args = ['--prompt', 'import os', '--max_new_tokens', '6', '--dtype', 'float32']
  one = generated(capsys, ['--checkpoint', out, *args])
  two = generated(capsys, ['--checkpoint', out, *args, '--mesh.tensor', '2'])
  assert two == one
  ids = one['completion_ids']
  assert len(ids) == 6 and len(set(ids)) > 3
  assert eod not in ids and eod not in one['prompt_ids']
  third = ids[2]
  assert third not in ids[:2] + one['prompt_ids']  # the swap changes nothing before it
  _, swapped = imported(tmp_path, 4, 8192, hidden=32, swap=(eod, third))
  stopped = generated(capsys, ['--checkpoint', swapped, *args])
  assert stopped['completion_ids'] == ids[:2] + [eod]
  tokenizer, prompt = Tokenizer.load_default(), stopped['prompt_ids']
  # The two tokens' text as it continues the prompt (its leading space kept), the EOD left out.
  assert (
    stopped['completion'] == tokenizer.decode(prompt + ids[:2])[len(tokenizer.decode(prompt)) :]
  )


def test_generation_and_export_run_without_the_data_of_the_run():
  """A run on a user's seqio Task: evaluation needs its registry module, generating (and the HF
  export) reads no data, so a module that is gone does not stop them."""
  from t5x_like.config import DataConfig

  inference_config = inference.inference_config
  saved = small_config(
    data=dict(
      mixture_or_task='users_task',
      split='969,30,1',
      mixture_or_task_module='users_tasks_that_are_gone',
    )
  )
  with pytest.raises(ConfigError, match='users_tasks_that_are_gone'):
    inference_config(saved)
  cfg = inference_config(saved, with_data=False)
  assert (
    cfg.data == DataConfig()
    and cfg.model
    == inference_config(
      saved.replace(data={'mixture_or_task': '', 'mixture_or_task_module': ''})
    ).model
  )


def test_a_generation_that_cannot_fit_is_refused_before_the_restore_and_long_ones_show_progress(
  tmp_path, capsys, monkeypatch
):
  """A generation keeps every layer's keys and values of the prompt and the new tokens in its KV
  cache, [layers, 1, length, heads, head_dim] for each (here 512 bytes a position), besides the
  prompt's forward (its attention scores [heads, P, P] float32, P the prompt rounded up to 64).
  10^12 new tokens (512 TB) and a generation beyond a 1 GiB device are refused with the limit,
  before the checkpoint is restored (restoring here fails the test). A generation that runs
  shows its progress on stderr."""
  _, out = imported(tmp_path, 4, 8192, hidden=32)
  capsys.readouterr()  # the export's own progress

  def restore(*args, **kwargs):
    raise AssertionError('the checkpoint was restored before the request was refused')

  monkeypatch.setattr(inference, 'load_for_inference', restore)
  prompt = ['--checkpoint', out, '--prompt', 'def f(x):', '--dtype', 'float32']
  prompt_tokens = len(Tokenizer.load_default().encode('def f(x):'))
  assert generate.main([*prompt, '--max_new_tokens', str(10**12)]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and len(err.splitlines()) == 1, err
  length = -(-(10**12 + prompt_tokens - 1) // 64) * 64  # the cache: all but the last new token
  assert (
    f'a KV cache of {length} positions (keys and values of 2 layers x 4 heads x 8 float32' in err
  )
  assert 'attention scores [4, 64, 64] float32 (6.104e-05 GiB)' in err, err
  # With 1 GiB to a device: 512 bytes a cache position and 4 x 64 x 64 x 4 bytes of scores
  # leave 2^21 - 128 positions for the prompt and every new token but the last.
  monkeypatch.setattr(generate, 'device_memory', lambda tensor: (2**30, "a test device's"))
  assert generate.main([*prompt, '--max_new_tokens', '3000000']) == 2
  err = capsys.readouterr().err
  needs = f'prompt ({prompt_tokens} tokens) + --max_new_tokens (3000000) needs at least 1.431 GiB'
  assert needs in err, err
  most = 2**21 - 128 + 1 - prompt_tokens
  assert f'at most --max_new_tokens {most} fits after this prompt' in err, err
  assert generation_fits(out, prompt_tokens, most) and not generation_fits(
    out, prompt_tokens, most + 1
  )
  monkeypatch.setattr(generate, 'device_memory', lambda tensor: (60000, "a test device's"))
  assert generate.main([*prompt, '--max_new_tokens', '1']) == 2
  assert 'the prompt alone does not fit: shorten it' in capsys.readouterr().err
  # lax.top_k of more than the vocabulary failed in the compile, after the restore.
  assert generate.main([*prompt, '--temperature', '1', '--top_k', '8193']) == 2
  assert capsys.readouterr().err == (
    'error: --top_k 8193 is more than the 8192 tokens of the '
    'model; use at most 8192, or 0 for all of them\n'
  )
  monkeypatch.undo()
  monkeypatch.setattr(decoding, 'PROGRESS_DELAY_S', 0.0)  # a bar from the first token
  assert generate.main([*prompt, '--max_new_tokens', '3']) == 0
  captured = capsys.readouterr()
  assert 1 <= len(json.loads(captured.out.splitlines()[-1])['completion_ids']) <= 3
  assert 'generating:' in captured.err and '/3 ' in captured.err, captured.err


def generation_fits(checkpoint, prompt_tokens, new_tokens):
  """Whether check_request lets the generation run within 1 GiB."""
  from t5x_like.checkpointing.checkpoints import read_config

  saved = read_config(checkpoint)
  try:
    generate.check_request(
      saved,
      Tokenizer.load_default(),
      [1] * prompt_tokens,
      new_tokens,
      dtype='float32',
      memory=(2**30, 'a test device'),
    )
  except ConfigError:
    return False
  return True
