"""EleutherAI's lm-evaluation-harness on this trainer's model: `T5xLikeLM`, registered with the
harness as `t5x_like`.

A `TemplateLM`, so the harness's own code splits and tokenizes the requests as it does for its
Hugging Face backend (`hf`): a context and continuation are encoded whole and split at the
context's tokens, an empty context becomes the prefix token. Then, as `hf` does:

* `loglikelihood`: each (context + continuation)[-(max_length + 1):] runs once; the continuation's
  log-likelihood is the sum of the per-token log-softmax of the model's fp32 logits (the padded
  vocabulary rows masked, as in training) at its tokens, and `is_greedy` says whether every one of
  them is the argmax.
* `loglikelihood_rolling`: the text's tokens in the harness's disjoint rolling windows of
  `max_length` (lm_eval.utils), the first one after the prefix token; the windows' sums add up.
* `generate_until`: `inference.decoding.generate` (a KV cache), greedy or sampled as each request's
  `do_sample` / `temperature` / `top_k` say, each row stopping at the end-of-document token, a stop
  sequence of `until` or `max_gen_toks`; the text is cut at the first stop sequence.

Requests are sorted longest first and batched (`batch_size` rows; the harness's Collator), with a
progress bar. Scoring batches are padded to `batch_size` rows and to one of a few bucket lengths
(powers of two from 64 up to max_length), so a run compiles a handful of programs, and the logits
are computed LOGITS_CHUNK positions at a time: never [batch, length, vocabulary] fp32 at once.

`T5xLikeLM(pretrained=CHECKPOINT, ...)` restores a checkpoint (saved from any mesh) onto a 1 x 1 x
`tensor` mesh; `T5xLikeLM.from_params(cfg, params, tokenizer)` wraps a model already in memory (a
training run's live params).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from collections.abc import Sequence
from typing import Any, Protocol

# The harness's own backends, registered (lazily) before this one: its get_model imports them
# only while the registry is empty, so `hf` stays known once `t5x_like` is registered.
import lm_eval.models  # noqa: F401
import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
  Collator,
  handle_stop_sequences,
  normalize_gen_kwargs,
  postprocess_generated_text,
)
from tqdm import tqdm

from t5x_like.config import Config, ConfigError, ModelConfig

# The harness's registry name of T5xLikeLM.
MODEL_NAME = 't5x_like'
# Scoring buckets: rows are padded to the shortest of these lengths (and max_length) that holds
# them, so a run compiles at most this many programs per batch size.
MIN_BUCKET = 64
# Logits are computed this many positions at a time ([batch, LOGITS_CHUNK, vocabulary] fp32).
LOGITS_CHUNK = 256
# As the harness's `hf` backend: the default most tokens a generation request writes.
DEFAULT_MAX_GEN_TOKS = 256
# Generation keywords this backend reads; others are ignored with a warning.
GENERATION_KEYS = frozenset({'until', 'max_gen_toks', 'do_sample', 'temperature', 'top_k'})

logger = logging.getLogger(__name__)


class TextTokenizer(Protocol):
  """What the backend needs of a tokenizer: `data.tokenizer.Tokenizer` (SentencePiece) and
  `data.hf_tokenizer.HFTokenizer` (a Hugging Face tokenizer.json) both are one."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def eod_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...


def special_token_ids(tokenizer: TextTokenizer) -> frozenset[int]:
  """The ids left out of generated text, as the harness's `hf` decodes with
  skip_special_tokens=True: a tokenizer.json's special added tokens, or the end-of-document id
  (SentencePiece leaves its own control tokens out of decode)."""
  from t5x_like.data.hf_tokenizer import HFTokenizer

  if isinstance(tokenizer, HFTokenizer):
    import tokenizers

    added = tokenizers.Tokenizer.from_file(tokenizer.path).get_added_tokens_decoder()
    return frozenset(i for i, token in added.items() if token.special)
  return frozenset({tokenizer.eod_id})


def bucket_length(length: int, max_length: int) -> int:
  """The padded length of a scoring batch whose longest row has `length` tokens."""
  bucket = MIN_BUCKET
  while bucket < length:
    bucket *= 2
  return min(bucket, max_length)


def score_fn(cfg: Config):
  """The jitted (params, inputs [B, L], targets [B, L]) -> (log-probabilities [B, L] fp32 of each
  target under the model's next-token distribution after inputs[:, :t+1], whether each target is
  the argmax [B, L]). Rows split over `data`, the model over `tensor` (cfg.mesh). One function
  per model and mesh, so that backends built again (a training hook's, every evaluation) reuse
  its compiled programs."""
  # Scoring needs no sequence split: the lengths are the buckets', not train.seq_len.
  model_cfg = dataclasses.replace(cfg.model, sequence_parallel=False)
  return _score_fn(model_cfg, cfg.padded_vocab_size, cfg.mesh.data, cfg.mesh.tensor)


@functools.lru_cache(maxsize=8)
def _score_fn(model_cfg: ModelConfig, padded_vocab: int, data: int, tensor: int):
  import jax
  import jax.numpy as jnp

  from t5x_like.mesh import partitioning
  from t5x_like.model import losses
  from t5x_like.model import transformer as model_lib

  mesh = partitioning.make_mesh(data, 1, tensor)
  model = model_lib.Transformer(model_cfg, padded_vocab, mesh)
  ctx = model_lib.Context(model_cfg, mesh)

  @jax.jit
  def score(params, inputs, targets):
    hidden = model.apply({'params': params}, inputs, return_hidden=True)  # [B, L, h]
    embedding = model_lib.gathered_embedding(model, params)
    rows, length, width = hidden.shape
    chunk = min(length, LOGITS_CHUNK)
    chunks = -(-length // chunk)
    pad = chunks * chunk - length  # after the model: padding the hidden states changes nothing
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    labels = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden = hidden.reshape(rows, chunks, chunk, width).swapaxes(0, 1)
    labels = labels.reshape(rows, chunks, chunk).swapaxes(0, 1)

    def one_chunk(args):
      x, y = args  # [B, chunk, h], [B, chunk]
      # fp32 logits, the padded vocabulary rows at the lowest float (never the argmax).
      logits = model_lib.tied_logits(x, embedding, model_cfg.vocab_size, ctx)
      return -losses.cross_entropy(logits, y), jnp.argmax(logits, -1) == y

    logprobs, greedy = jax.lax.map(one_chunk, (hidden, labels))
    unchunk = lambda a: a.swapaxes(0, 1).reshape(rows, chunks * chunk)[:, :length]
    return unchunk(logprobs), unchunk(greedy)

  return score


@register_model(MODEL_NAME)
class T5xLikeLM(TemplateLM):
  """The harness's model interface over a t5x_like model: a checkpoint (`pretrained`) or a
  model in memory (`from_params`)."""

  def __init__(
    self,
    pretrained: str | None = None,
    *,
    step: int | None = None,
    dtype: str | None = None,
    tensor: int = 1,
    tokenizer: TextTokenizer | None = None,
    tokenizer_json: str | None = None,
    tokenizer_model: str | None = None,
    batch_size: int | str | None = 8,
    max_length: int | None = None,
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
    prefix_token_id: int | None = None,
    seed: int = 0,
    cfg: Config | None = None,
    params: Any = None,
    max_batch_size: int | None = None,
    device: str | None = None,
  ):
    """pretrained: a run's WORKDIR/checkpoints (latest step, or `step`) or one step directory,
    restored onto a 1 x 1 x `tensor` mesh in `dtype` (default the checkpoint's). Or, instead,
    `cfg` and `params` as `inference.loading.load_for_inference` returns them (what `from_params`
    passes).

    tokenizer: an object (TextTokenizer), or `tokenizer_json` (a Hugging Face tokenizer.json, or
    the directory it was saved to) or `tokenizer_model` (SentencePiece); default the shipped one.
    batch_size: rows per batch (a positive integer; the harness's 'auto' is not supported).
    max_length: the longest input (default train.seq_len, the length the model trained at).
    max_gen_toks: a generation request's most new tokens when it does not say.
    prefix_token_id: what an empty context and the first rolling window start with (default the
    end-of-document token, which the trainer puts before every document).
    seed: generations that sample draw from it.
    max_batch_size, device: what the harness passes every backend it builds by name; unused (no
    automatic batch size; the mesh decides where the model runs).
    """
    super().__init__()
    if batch_size is None:
      batch_size = 8
    if isinstance(batch_size, str) and not batch_size.isdigit():
      raise ConfigError(f'batch_size must be a positive integer, got {batch_size!r}')
    if int(batch_size) < 1 or tensor < 1 or max_gen_toks < 1:
      raise ConfigError(
        f'batch_size, tensor and max_gen_toks must be >= 1, got {batch_size}, {tensor} and '
        f'{max_gen_toks}'
      )
    if tokenizer is None:
      tokenizer = load_tokenizer(tokenizer_json, tokenizer_model)
    elif tokenizer_json or tokenizer_model:
      raise ConfigError('pass a tokenizer object or tokenizer_json / tokenizer_model, not both')
    self.tokenizer = tokenizer
    self._checkpoint, self._step = pretrained, step
    if pretrained is not None:
      if cfg is not None or params is not None:
        raise ConfigError('pass a checkpoint (pretrained) or cfg and params, not both')
      cfg, params = self._restore(pretrained, step, dtype, tensor, tokenizer, max_length)
    elif cfg is None or params is None:
      raise ConfigError('T5xLikeLM needs a checkpoint (pretrained=DIR) or cfg and params')
    check_model(cfg, tokenizer, max_length)
    self.cfg, self.params = cfg, params
    self._batch_size = -(-int(batch_size) // cfg.mesh.data) * cfg.mesh.data
    self._max_length = max_length or cfg.train.seq_len
    self._max_gen_toks = max_gen_toks
    self._prefix_token_id = tokenizer.eod_id if prefix_token_id is None else prefix_token_id
    self._seed = seed
    self._special_ids = special_token_ids(tokenizer)
    self._score = score_fn(cfg)
    self._generations = 0  # generation batches so far: each samples from its own seed

  @classmethod
  def from_params(
    cls, cfg: Config, params, tokenizer: TextTokenizer, batch_size: int = 8, **kwargs: Any
  ) -> T5xLikeLM:
    """The backend over a model in memory: `cfg` with mesh data x 1 x tensor (one pipeline
    stage) and `params` in that mesh's compute shardings, as `inference.load_for_inference`
    returns them (a training hook: the run's config and its canonical params). kwargs: those of
    the constructor (max_length, max_gen_toks, prefix_token_id, seed)."""
    return cls(cfg=cfg, params=params, tokenizer=tokenizer, batch_size=batch_size, **kwargs)

  @staticmethod
  def _restore(checkpoint, step, dtype, tensor, tokenizer, max_length):
    """(cfg, params) of the checkpoint on a 1 x 1 x tensor mesh, the request checked first."""
    from t5x_like.checkpointing.checkpoints import CheckpointError, read_config
    from t5x_like.inference.loading import load_for_inference
    from t5x_like.mesh import partitioning

    try:
      partitioning.ensure_devices(tensor)
      check_model(read_config(checkpoint, step), tokenizer, max_length)
      return load_for_inference(checkpoint, dtype, step, 1, tensor, with_data=False)
    except CheckpointError as e:
      raise ConfigError(str(e)) from None

  # ------------------------------------------------------------------ what the harness reads

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eod_id

  @property
  def prefix_token_id(self) -> int:
    return self._prefix_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return self._max_gen_toks

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @property
  def tokenizer_name(self) -> str:
    path = getattr(self.tokenizer, 'path', None) or type(self.tokenizer).__name__
    return str(path).replace('/', '__')

  def get_model_info(self) -> dict:
    """What the harness writes into its results' `config`."""
    return {
      'checkpoint': self._checkpoint,
      'step': self._step,
      'architecture': self.cfg.model.architecture,
      'model_num_parameters': self.cfg.model.num_params(),
      'model_dtype': self.cfg.model.dtype,
      'mesh_tensor': self.cfg.mesh.tensor,
      'max_length': self.max_length,
      'tokenizer': self.tokenizer_name,
    }

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    """The text's ids. Neither tokenizer adds special tokens to a text, so the flag changes
    nothing; the harness's other keywords (left_truncate_len) are not used by TemplateLM."""
    return list(self.tokenizer.encode(string))

  def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
    if skip_special_tokens:
      tokens = [t for t in tokens if t not in self._special_ids]
    return self.tokenizer.decode(tokens)

  # ------------------------------------------------------------------ log-likelihoods

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    """(log-likelihood, is_greedy) of each (request, context ids, continuation ids), in order.
    request: (context, continuation) strings, or None for a rolling window (then the sums are
    cached by loglikelihood_rolling)."""

    def longest_first(request):
      tokens = request[1] + request[2]
      return -len(tokens), tuple(tokens)

    collator = Collator(requests, sort_fn=longest_first)
    results: list[tuple[float, bool]] = []
    with tqdm(
      total=len(requests),
      disable=disable_tqdm,
      desc='Running loglikelihood requests',
      file=sys.stderr,
    ) as bar:
      for batch in collator.get_batched(n=self.batch_size):
        rows = []
        for _, context, continuation in batch:
          # As the `hf` backend: the last max_length + 1 tokens, the context cut from the left.
          whole = (context + continuation)[-(self.max_length + 1) :]
          rows.append((whole[:-1], whole[1:]))
        for (request, _, continuation), (logprobs, greedy) in zip(batch, self._score_rows(rows)):
          n = min(len(continuation), len(logprobs))
          answer = (
            (float(logprobs[-n:].sum(dtype=np.float64)), bool(greedy[-n:].all()))
            if n
            else (0.0, True)  # an empty continuation: nothing to predict
          )
          results.append(answer)
          if request is not None:
            self.cache_hook.add_partial('loglikelihood', request, answer)
          bar.update()
    return collator.get_original(results)

  def _score_rows(self, rows: list[tuple[list[int], list[int]]]):
    """Per row (inputs, targets of the same length): (log-probabilities, is-argmax) of its
    targets, one jitted batch padded to batch_size rows and a bucket length."""
    import jax

    length = bucket_length(max(len(inputs) for inputs, _ in rows), self.max_length)
    inputs = np.zeros((self.batch_size, length), np.int32)
    targets = np.zeros((self.batch_size, length), np.int32)
    for row, (x, y) in enumerate(rows):
      inputs[row, : len(x)], targets[row, : len(y)] = x, y
    logprobs, greedy = jax.device_get(self._score(self.params, inputs, targets))
    return [(logprobs[row, : len(x)], greedy[row, : len(x)]) for row, (x, _) in enumerate(rows)]

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's log-likelihood after the prefix token, in the harness's disjoint rolling
    windows of max_length (each token predicted once, with as much context as fits)."""
    texts = [request.args[0] for request in requests]
    windows: list[tuple[None, list[int], list[int]]] = []
    counts = []
    for text in texts:
      pairs = lm_utils.get_rolling_token_windows(
        token_list=self.tok_encode(text),
        prefix_token=self.prefix_token_id,
        max_seq_len=self.max_length,
        context_len=1,
      )
      disjoint = [lm_utils.make_disjoint_window(pair) for pair in pairs]
      windows += [(None, context, continuation) for context, continuation in disjoint]
      counts.append(len(disjoint))
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    totals, start = [], 0
    for text, count in zip(texts, counts):
      total = sum(score for score, _ in scores[start : start + count])
      start += count
      totals.append(total)
      self.cache_hook.add_partial('loglikelihood_rolling', (text,), total)
    return totals

  # ------------------------------------------------------------------ generation

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Each (context, generation keywords) continued until a stop sequence of `until`, the
    end-of-document token or `max_gen_toks` new tokens; the text before the first stop
    sequence. Requests with the same keywords are batched, longest context first."""
    from t5x_like.inference import decoding

    def longest_first(request):
      return -len(self.tok_encode(request[0])), request[0]

    collator = Collator(
      [request.args for request in requests],
      sort_fn=longest_first,
      group_by='gen_kwargs',
      group_fn=lambda request: request[1],
    )
    eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
    results = []
    with tqdm(
      total=len(requests),
      disable=disable_tqdm,
      desc='Running generate_until requests',
      file=sys.stderr,
    ) as bar:
      for batch in collator.get_batched(n=self.batch_size):
        contexts, all_kwargs = zip(*batch)
        settings = generation_settings(all_kwargs[0], self.max_gen_toks)
        until = handle_stop_sequences(settings['until'], eos=eos)
        stops = [s for s in until if s]
        max_new = settings['max_gen_toks']
        most = self.max_length - max_new  # as `hf`: the context leaves room for max_gen_toks
        if most < 1:
          raise ConfigError(
            f'max_gen_toks ({max_new}) must be less than the model max_length ({self.max_length})'
          )
        prompts = [(self.tok_encode(c) or [self.prefix_token_id])[-most:] for c in contexts]

        def stop(row: int, new: list[int]) -> bool:
          text = self.tok_decode(new)
          return any(s in text for s in stops)

        generated = decoding.generate(
          self.cfg,
          self.params,
          prompts,
          max_new,
          temperature=settings['temperature'],
          top_k=settings['top_k'],
          seed=self._seed + self._generations,
          eod_id=self.eot_token_id,
          stop=stop if stops else None,
          vocab_limit=self.tokenizer.vocab_size,
        )
        self._generations += 1
        for context, kwargs, new in zip(contexts, all_kwargs, generated):
          text = postprocess_generated_text(self.tok_decode(new), until, None)
          results.append(text)
          self.cache_hook.add_partial('generate_until', (context, kwargs), text)
          bar.update()
    return collator.get_original(results)


def generation_settings(gen_kwargs: dict, default_max_gen_toks: int) -> dict:
  """until, max_gen_toks, temperature (0: greedy) and top_k (0: all) of a request's keywords,
  normalised as the harness normalises them for every backend (do_sample False or absent with
  temperature 0: greedy)."""
  kwargs = normalize_gen_kwargs(gen_kwargs, default_max_gen_toks)
  ignored = sorted(set(kwargs) - GENERATION_KEYS)
  if ignored:
    lm_utils.warning_once(
      logger,
      f'generation keywords {ignored} are not supported by {MODEL_NAME} and are ignored',
    )
  temperature = float(kwargs.get('temperature') or 0.0) if kwargs.get('do_sample') else 0.0
  return {
    'until': kwargs['until'],
    'max_gen_toks': int(kwargs['max_gen_toks']),
    'temperature': temperature,
    'top_k': int(kwargs.get('top_k') or 0),
  }


def load_tokenizer(tokenizer_json: str | None = None, tokenizer_model: str | None = None):
  """data.tokenizer.load_tokenizer (a tokenizer.json or its directory, a SentencePiece model, or
  the shipped one); a bad path is one ConfigError."""
  from t5x_like.data.indexed import DataError
  from t5x_like.data.tokenizer import load_tokenizer as load

  try:
    return load(tokenizer_json, tokenizer_model)
  except DataError as e:
    raise ConfigError(str(e)) from None


def check_model(cfg: Config, tokenizer: TextTokenizer, max_length: int | None) -> None:
  """One ConfigError for a model the backend cannot run with this tokenizer and length."""
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(
      f"the tokenizer has {tokenizer.vocab_size} tokens but the checkpoint's model has "
      f'{cfg.model.vocab_size}: pass the tokenizer its data was tokenized with '
      '(--tokenizer_model or --tokenizer_json)'
    )
  if cfg.mesh.pipeline != 1:
    raise ConfigError(
      f'the model must be on a data x 1 x tensor mesh (one pipeline stage), got mesh.pipeline '
      f'{cfg.mesh.pipeline}: restore it with inference.loading.load_for_inference'
    )
  if max_length is not None and max_length < 2:
    raise ConfigError(f'--max_length must be >= 2, got {max_length}')
  length = max_length or cfg.train.seq_len
  if cfg.model.architecture == 'gpt2' and length > cfg.model.max_position_embeddings:
    raise ConfigError(
      f'--max_length {length} exceeds the {cfg.model.max_position_embeddings} learned positions '
      'of this gpt2 model'
    )
