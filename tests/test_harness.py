"""lm-evaluation-harness on an imported checkpoint (`inference/harness_lm.py`, `python -m
t5x_like.harness`) against the harness's own Hugging Face backend (`hf`) on the same random BLOOM,
on the offline tasks of tests/harness_tasks: multiple choice, rolling perplexity, generation."""

import glob
import json
import os
import unittest.mock

# Nothing is fetched: the tasks' data are local JSON files, the models local directories.
os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
os.environ.setdefault('HF_HUB_OFFLINE', '1')

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import REPO, random_bloom, run_cli  # noqa: E402

from t5x_like.cli import ckpt  # noqa: E402

TASKS_DIR = os.path.join(REPO, 'tests', 'harness_tasks')
TASKS = ['t5x_tiny_mc', 't5x_tiny_ppl', 't5x_tiny_gen']
# Short enough that contexts are cut from the left and texts take several rolling windows.
MAX_LENGTH = 24
BATCH_SIZE = 4
# What holds between two fp32 implementations of one model (each a sum of up to MAX_LENGTH
# per-token log-probabilities; the largest difference seen is 2e-6).
LOGLIKELIHOOD_ATOL = 1e-4
OFFLINE = {'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'}


def task_texts() -> list[str]:
  """Every string of the offline tasks' data: what the test tokenizer is trained on."""
  texts = []
  for path in sorted(glob.glob(os.path.join(TASKS_DIR, '*.jsonl'))):
    with open(path) as f:
      for line in f:
        for value in json.loads(line).values():
          texts += value if isinstance(value, list) else [str(value)]
  return texts


def byte_level_bpe(texts: list[str]):
  """A small byte-level BPE (BLOOM's kind of tokenizer) whose only special token, the
  end-of-document token, is '</s>' (id 0): with no BOS token, `hf` takes it as its prefix token,
  as this backend does."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=['</s>'], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tokenizer.train_from_iterator(texts * 5, trainer)
  return tokenizer


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """(HF directory with the model and its tokenizer, the checkpoint imported from it): a random
  BLOOM whose layers outweigh its embedding LayerNorm (weights x 30, as in test_generate) and
  whose tied embedding gives peaked next-token distributions, so that it neither repeats one
  token nor scores every token alike; its end-of-document id is the tokenizer's, so both backends
  stop generating at the same token."""
  import transformers

  tmp = tmp_path_factory.mktemp('harness')
  tokenizer = byte_level_bpe(task_texts())
  model, hf_dir = random_bloom(tmp, 4, tokenizer.get_vocab_size(), hidden=32)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'dense' in name and name.endswith('weight'):
        p.mul_(30.0)
    # Logits of order 1, not 0.1 (the input side's LayerNorm undoes the scale): log-likelihoods
    # that differ from token to token, and continuations that are sometimes the greedy ones.
    model.transformer.word_embeddings.weight.mul_(10.0)
  eod = tokenizer.token_to_id('</s>')
  for config in (model.config, model.generation_config):
    config.bos_token_id = config.eos_token_id = config.pad_token_id = eod
  model.save_pretrained(hf_dir, safe_serialization=True)
  hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token='</s>')
  hf_tokenizer.save_pretrained(hf_dir)
  out = str(tmp / 'ckpt')
  assert ckpt.main(['import-hf', hf_dir, out]) == 0
  return hf_dir, out


@pytest.fixture(scope='module')
def backends(imported):
  """(this backend on the checkpoint, with the tokenizer directory HF saved; the harness's `hf`
  on the HF directory), both fp32 on the CPU with the same batch size and max length."""
  from lm_eval.models.huggingface import HFLM

  from t5x_like.inference.harness_lm import T5xLikeLM

  hf_dir, out = imported
  ours = T5xLikeLM(
    out, dtype='float32', tokenizer_json=hf_dir, batch_size=BATCH_SIZE, max_length=MAX_LENGTH
  )
  theirs = HFLM(
    pretrained=hf_dir, device='cpu', dtype='float32', batch_size=BATCH_SIZE, max_length=MAX_LENGTH
  )
  return ours, theirs


def evaluate(model, **kwargs):
  """simple_evaluate on the offline tasks, with their per-sample records."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  manager = TaskManager(include_path=TASKS_DIR, include_defaults=False)
  return simple_evaluate(
    model=model, tasks=TASKS, task_manager=manager, bootstrap_iters=0, **kwargs
  )


def responses(results, task):
  """Per document (in order): its requests' raw responses."""
  samples = sorted(results['samples'][task], key=lambda s: s['doc_id'])
  return [[r[0] for r in s['resps']] for s in samples]


def generation_requests(prompts, **kwargs):
  from lm_eval.api.instance import Instance

  return [Instance('generate_until', {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]


def test_loglikelihoods_accuracies_and_greedy_text_match_the_hf_backend(backends):
  ours, theirs = (evaluate(model) for model in backends)
  # Multiple choice: each choice's log-likelihood and greedy flag, then the accuracies.
  mc, hf_mc = responses(ours, 't5x_tiny_mc'), responses(theirs, 't5x_tiny_mc')
  assert len(mc) == 12 and [len(d) for d in mc] == [len(d) for d in hf_mc]
  for doc, hf_doc in zip(mc, hf_mc):
    for (ll, greedy), (hf_ll, hf_greedy) in zip(doc, hf_doc):
      assert abs(ll - hf_ll) <= LOGLIKELIHOOD_ATOL and greedy == hf_greedy
  scores = [ll for doc in mc for ll, _ in doc]
  assert max(scores) - min(scores) > 5  # choices the model tells apart, not a flat score
  for metric in ('acc,none', 'acc_norm,none'):
    assert ours['results']['t5x_tiny_mc'][metric] == theirs['results']['t5x_tiny_mc'][metric]
  # Rolling perplexity: one log-likelihood per text, each summed over several windows.
  ppl, hf_ppl = responses(ours, 't5x_tiny_ppl'), responses(theirs, 't5x_tiny_ppl')
  assert len(ppl) == 6
  for (ll,), (hf_ll,) in zip(ppl, hf_ppl):
    assert abs(ll - hf_ll) <= LOGLIKELIHOOD_ATOL
  for metric in ('word_perplexity,none', 'byte_perplexity,none', 'bits_per_byte,none'):
    got, want = ours['results']['t5x_tiny_ppl'][metric], theirs['results']['t5x_tiny_ppl'][metric]
    assert got == pytest.approx(want, rel=1e-5)
  # Greedy generation: the same text.
  gen, hf_gen = responses(ours, 't5x_tiny_gen'), responses(theirs, 't5x_tiny_gen')
  assert len(gen) == 10 and gen == hf_gen
  assert len({text for (text,) in gen}) > 3  # varied continuations
  assert (
    ours['results']['t5x_tiny_gen']['exact_match,none']
    == theirs['results']['t5x_tiny_gen']['exact_match,none']
  )


def test_greedy_flags_and_stop_sequences_match_the_hf_backend(backends):
  """A continuation that is the model's own greedy one is greedy on both backends (and one
  token changed is not); generations cut at a stop sequence that the model writes are the
  same text on both."""
  from t5x_like.inference import decoding

  ours, theirs = backends
  context = ours.tok_encode('The opposite of hot is')
  [greedy] = decoding.generate(ours.cfg, ours.params, [context], 4)
  changed = greedy[:-1] + [(greedy[-1] + 1) % ours.cfg.model.vocab_size]
  requests = [(None, context, greedy), (None, context, changed)]
  got, want = ours._loglikelihood_tokens(requests), theirs._loglikelihood_tokens(requests)
  assert [flag for _, flag in got] == [flag for _, flag in want] == [True, False]
  for (ll, _), (hf_ll, _) in zip(got, want):
    assert abs(ll - hf_ll) <= LOGLIKELIHOOD_ATOL

  # The last prompt is cut from the left to max_length - max_gen_toks tokens, as `hf` cuts it.
  long = 'The library opens at nine. Quiet readers fill the long tables until the lights go out'
  assert len(ours.tok_encode(long)) > MAX_LENGTH - 8
  prompts = ['The opposite of hot is', 'Bees make', 'A baby cat is a', 'Two plus two is', long]
  with unittest.mock.patch.object(decoding, 'generate', wraps=decoding.generate) as spy:
    full = ours.generate_until(generation_requests(prompts, until=[], max_gen_toks=8))
  prompts_run = [prompt for call in spy.call_args_list for prompt in call.args[2]]
  assert ours.tok_encode(long)[-(MAX_LENGTH - 8) :] in prompts_run
  assert full == theirs.generate_until(generation_requests(prompts, until=[], max_gen_toks=8))
  stop = full[0][3:5]  # a string the model writes, within its first continuation
  cut = ours.generate_until(generation_requests(prompts, until=[stop], max_gen_toks=8))
  assert cut == theirs.generate_until(generation_requests(prompts, until=[stop], max_gen_toks=8))
  assert cut == [text.split(stop)[0] for text in full] and cut != full


def test_sampled_generation_follows_the_seed_and_live_params_need_no_checkpoint(backends):
  """`from_params` (what a training hook calls) over the restored model: greedy text as the
  checkpoint's backend writes it; sampled text a function of the seed."""
  from t5x_like.inference.harness_lm import T5xLikeLM

  ours, _ = backends
  live = lambda **kw: T5xLikeLM.from_params(
    ours.cfg, ours.params, ours.tokenizer, batch_size=2, max_length=MAX_LENGTH, **kw
  )
  prompts = ['The opposite of hot is', 'Bees make', 'The sun rises in the']
  greedy = dict(until=['\n'], max_gen_toks=6)
  assert live().generate_until(generation_requests(prompts, **greedy)) == ours.generate_until(
    generation_requests(prompts, **greedy)
  )
  sampled = dict(until=['\n'], max_gen_toks=6, do_sample=True, temperature=1.5)
  draw = lambda seed: live(seed=seed).generate_until(generation_requests(prompts, **sampled))
  assert draw(3) == draw(3) and draw(3) != draw(4)


def test_tensor_parallel_backend_scores_and_generates_as_one_device(imported, backends):
  """--mesh.tensor 2: the checkpoint restored with its heads, FFN and vocabulary split over two
  devices gives the one-device log-likelihoods and greedy text."""
  from t5x_like.inference.harness_lm import T5xLikeLM

  hf_dir, out = imported
  one, _ = backends
  two = T5xLikeLM(out, dtype='float32', tensor=2, tokenizer_json=hf_dir, max_length=MAX_LENGTH)
  assert two.cfg.mesh.tensor == 2
  embedding = two.params['word_embeddings']  # its vocabulary rows split over the two devices
  assert embedding.addressable_shards[0].data.shape == (two.cfg.padded_vocab_size // 2, 32)
  context = one.tok_encode('Question: What do bees make?\nAnswer:')
  requests = [
    (None, context, one.tok_encode(' honey')),
    (None, [0], one.tok_encode(task_texts()[0])),
  ]
  for (ll, greedy), (ll_one, greedy_one) in zip(
    two._loglikelihood_tokens(requests), one._loglikelihood_tokens(requests)
  ):
    assert abs(ll - ll_one) <= 1e-5 and greedy == greedy_one
  prompts = ['The opposite of hot is', 'Bees make']
  request = generation_requests(prompts, until=['\n'], max_gen_toks=6)
  assert two.generate_until(request) == one.generate_until(request)


def test_generated_text_leaves_out_special_tokens_as_hf_decodes(tmp_path):
  """The harness's `hf` decodes generations with skip_special_tokens=True; so does this backend,
  for a tokenizer.json's special tokens (SentencePiece's decode leaves its control tokens out)."""
  import transformers
  from tokenizers import AddedToken

  from t5x_like.data.hf_tokenizer import HFTokenizer
  from t5x_like.data.tokenizer import Tokenizer
  from t5x_like.inference.harness_lm import special_token_ids

  tokenizer = byte_level_bpe(task_texts())
  tokenizer.add_special_tokens([AddedToken('<pad>', special=True)])
  tokenizer.add_tokens(['<not_special>'])
  path = str(tmp_path / 'tokenizer.json')
  tokenizer.save(path)
  ours = HFTokenizer(path)
  special = special_token_ids(ours)
  assert special == {tokenizer.token_to_id('</s>'), tokenizer.token_to_id('<pad>')}
  ids = tokenizer.encode('Bees make <pad>honey</s> and <not_special> wax<pad>').ids
  assert len(set(ids) & special) == 2
  hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
  assert ours.decode([i for i in ids if i not in special]) == hf.decode(
    ids, skip_special_tokens=True
  )
  shipped = Tokenizer.load_default()
  assert special_token_ids(shipped) == {shipped.eod_id}


def test_cli_prints_the_table_and_writes_results_and_samples(imported, tmp_path):
  hf_dir, out = imported
  output = tmp_path / 'results'
  r = run_cli(
    [
      '-m',
      't5x_like.harness',
      '--checkpoint',
      out,
      '--tasks',
      't5x_tiny',
      '--include_path',
      TASKS_DIR,
      '--tokenizer_json',
      os.path.join(hf_dir, 'tokenizer.json'),
      '--max_length',
      str(MAX_LENGTH),
      '--limit',
      '3',
      '--batch_size',
      '2',
      '--output_path',
      str(output),
      '--log_samples',
      '--seed',
      '5',
      '--bootstrap_iters',
      '0',
    ],
    env=OFFLINE,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  rows = [line.split('|') for line in r.stdout.splitlines() if line.startswith('|')]
  header = [c.strip() for c in rows[0]][1:-1]
  assert header == ['Tasks', 'Version', 'Filter', 'n-shot', 'Metric', '', 'Value', '', 'Stderr']
  named = {row[1].strip(' -'): row for row in rows}
  metrics = {row[5].strip() for row in rows[2:]}
  assert set(TASKS) <= set(named)
  assert {'acc', 'acc_norm', 'word_perplexity', 'byte_perplexity', 'bits_per_byte'} <= metrics
  assert 'exact_match' in metrics
  [results_file] = glob.glob(str(output / '*' / 'results_*.json'))
  with open(results_file) as f:
    results = json.load(f)
  assert set(TASKS) <= set(results['results'])
  assert results['config']['model_args']['pretrained'] == out
  assert results['config']['random_seed'] == 5 and results['config']['limit'] == 3
  acc = float(named['t5x_tiny_mc'][7])
  assert results['results']['t5x_tiny_mc']['acc,none'] == pytest.approx(acc, abs=1e-4)
  for task in TASKS:
    [samples] = glob.glob(str(output / '*' / f'samples_{task}_*.jsonl'))
    with open(samples) as f:
      assert len(f.readlines()) == 3


def test_bad_input_is_one_message_before_the_restore(imported, tmp_path, capsys):
  from t5x_like.cli import harness

  hf_dir, out = imported
  base = ['--checkpoint', out, '--tasks', 't5x_tiny_mc', '--include_path', TASKS_DIR]
  cases = [
    (['--checkpoint', str(tmp_path / 'missing'), '--tasks', 'x'], 'does not exist'),
    ([*base, '--limit', '0'], '--limit must be > 0'),
    ([*base, '--num_fewshot', '-1'], '--num_fewshot must be >= 0'),
    ([*base, '--batch_size', '0'], '--batch_size and --mesh.tensor must be >= 1'),
    ([*base, '--log_samples'], 'pass --output_path too'),
    ([*base[:4], '--include_path', str(tmp_path / 'nowhere')], 'is not a directory'),
    ([*base, '--tokenizer_json', str(tmp_path)], 'not found'),
    ([*base], 'the tokenizer has 8192 tokens'),  # the shipped tokenizer: larger than the model
    (
      [*base[:2], '--tasks', 't5x_tiny_mc,no_such_task', *base[4:], '--tokenizer_json', hf_dir],
      ('unknown task(s) no_such_task'),
    ),
  ]
  with unittest.mock.patch(
    't5x_like.inference.loading.load_for_inference', side_effect=AssertionError('restored')
  ):
    for argv, message in cases:
      assert harness.main(argv) == 2, argv
      err = capsys.readouterr().err
      assert err.startswith('error: ') and message in err, (argv, err)
      assert len(err.strip().splitlines()) == 1, err
