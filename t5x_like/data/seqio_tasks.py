"""The project's own seqio Tasks and Mixture, and the look-up of `data.mixture_or_task`.

Registered on import, all over the embedded corpus (`corpus.py`, no download) with the shipped
vocabulary (`tokenizer.seqio_vocabulary`), output feature 'targets' ending with EOS (the EOD id):

* `t5x_like_corpus`: the whole corpus, in `corpus.default_documents()` order;
* `t5x_like_corpus_reference`: its Python reference topics (`pydoc_data`);
* `t5x_like_corpus_stdlib`: its standard library prose;
* `t5x_like_corpus_mix`: a Mixture of the last two, rates 1 (reference) : 3 (stdlib).

Each Task has a 'train' and a 'validation' split: every VALIDATION_EVERY-th document of its
part (the last of each run of VALIDATION_EVERY) validates, the others train.

Users register their own Tasks and Mixtures in a module named by `data.mixture_or_task_module`,
which `get_mixture_or_task` imports before it looks the name up (t5x's MIXTURE_OR_TASK_MODULE).
seqio imports TensorFlow: this module hides the GPUs from it first (`tf_runtime.import_tensorflow`),
so seqio's pipeline runs on the host CPU and never takes a GPU from JAX.
"""

from __future__ import annotations

import functools
import importlib
import numbers
from collections.abc import Callable, Sequence

from t5x_like.data import corpus, tf_runtime
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer, seqio_vocabulary

tf = tf_runtime.import_tensorflow()  # before seqio initialises TensorFlow
import seqio  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

CORPUS_TASK = 't5x_like_corpus'
REFERENCE_TASK = 't5x_like_corpus_reference'
STDLIB_TASK = 't5x_like_corpus_stdlib'
CORPUS_MIXTURE = 't5x_like_corpus_mix'
MIXTURE_RATES = {REFERENCE_TASK: 1.0, STDLIB_TASK: 3.0}
SPLITS = ('train', 'validation')
# One document in VALIDATION_EVERY validates: spread over the part, not its alphabetical tail.
VALIDATION_EVERY = 16
TRAIN_SPLIT = 'train'
# Splits that are neither trained on nor evaluated during training.
UNREAD_SPLITS = ('train', 'test')


def split_documents(documents: Sequence[str], split: str) -> list[str]:
  """The documents of `split`: validation takes every VALIDATION_EVERY-th, train the rest."""
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; the corpus Tasks have {SPLITS}')
  held_out = split == 'validation'
  return [
    d for i, d in enumerate(documents) if (i % VALIDATION_EVERY == VALIDATION_EVERY - 1) == held_out
  ]


class CorpusSource(seqio.FunctionDataSource):
  """A FunctionDataSource over a part of the embedded corpus that can fingerprint its content:
  the corpus is the running Python's, so the same Task definition can hold other text."""

  def __init__(self, documents: Callable[[], Sequence[str]]):
    self._documents = documents  # memoized by corpus.py: the standard library is parsed once

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None):
      del shuffle_files, seed  # one file, read in order: the order is part of the data
      texts = split_documents(documents(), split)
      return tf.data.Dataset.from_tensor_slices({'targets': tf.constant(texts, tf.string)})

    # seqio's repr (part of the cache's fingerprint) names the function: name it for its part.
    dataset_fn.__name__ = dataset_fn.__qualname__ = documents.__name__.lstrip('_')
    super().__init__(dataset_fn, splits=SPLITS)

  def content_fingerprint(self) -> str:
    return corpus.corpus_fingerprint(self._documents())


def _corpus_documents() -> list[str]:
  return corpus.default_documents()


def _reference_documents() -> list[str]:
  return corpus.topic_documents()


def _stdlib_documents() -> list[str]:
  # The default corpus is the topics, then the standard library's prose.
  return corpus.default_documents()[len(corpus.topic_documents()) :]


def _output_features() -> dict:
  return {'targets': seqio.Feature(seqio_vocabulary(), add_eos=True, dtype=tf.int32)}


# The text is tokenized whole (no pretokenized copy kept: only the ids are materialised) and ends
# with EOS, the EOD id that separates documents in the token stream.
PREPROCESSORS = (
  functools.partial(seqio.preprocessors.tokenize, copy_pretokenized=False),
  seqio.preprocessors.append_eos,
)


def register() -> None:
  """Registers the project's Tasks and Mixture; idempotent (a reloaded module is harmless)."""
  tasks = {
    CORPUS_TASK: _corpus_documents,
    REFERENCE_TASK: _reference_documents,
    STDLIB_TASK: _stdlib_documents,
  }
  for name, documents in tasks.items():
    if name not in seqio.TaskRegistry.names():
      seqio.TaskRegistry.add(
        name,
        source=CorpusSource(documents),
        preprocessors=list(PREPROCESSORS),
        output_features=_output_features(),
      )
  if CORPUS_MIXTURE not in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.add(CORPUS_MIXTURE, list(MIXTURE_RATES.items()))


register()


def registered_names() -> list[str]:
  return sorted({*seqio.TaskRegistry.names(), *seqio.MixtureRegistry.names()})


def import_registry_module(module: str) -> None:
  """Imports the user's registry module; one DataError showing its own error if it fails."""
  if not module:
    return
  try:
    importlib.import_module(module)
  except Exception as error:  # pylint: disable=broad-except  # any error of the user's module
    raise DataError(
      f'data.mixture_or_task_module={module!r} failed to import: '
      f'{type(error).__name__}: {error}; fix that module, or make it importable '
      '(a dotted module name on PYTHONPATH)'
    ) from None


def get_mixture_or_task(name: str, module: str = ''):
  """The registered Task or Mixture `name`, after importing `module`; one DataError (naming the
  registered names, or the Task without 'targets') when it cannot train a decoder-only model."""
  import_registry_module(module)
  names = registered_names()
  if name not in names:
    hint = '' if module else ' (a Task of your own: name its module in data.mixture_or_task_module)'
    raise DataError(
      f'data.mixture_or_task={name!r} is not a registered seqio Task or Mixture'
      f'{hint}; registered: {", ".join(names)}'
    )
  provider = seqio.get_mixture_or_task(name)
  for task in seqio.get_subtasks(provider):
    if 'targets' not in task.output_features:
      raise DataError(
        f'the seqio Task {task.name!r} has no "targets" output feature (it has '
        f'{sorted(task.output_features)}); a decoder-only model trains on the ids '
        'of "targets": name its token feature so'
      )
    check_declared_targets(task)
    if TRAIN_SPLIT not in task.splits:
      raise DataError(
        f'the seqio Task {task.name!r} has no {TRAIN_SPLIT!r} split (it has '
        f'{list(task.splits)}); training reads its "train" split'
      )
  return provider


# What every refusal of a Task's 'targets' ends with: what the trainer needs, and the usual fix.
TOKEN_IDS_FIX = (
  'a decoder-only model trains on integer token ids, one sequence per example: '
  'make "targets" rank-1 int32 ids of its vocabulary, e.g. add '
  'seqio.preprocessors.tokenize to the preprocessors (before append_eos) and '
  "declare output_features={'targets': seqio.Feature(vocabulary)}"
)


def targets_problem(dtype, rank: int | None) -> str | None:
  """Why a 'targets' feature of `dtype` (a tf.DType) and `rank` holds no token id sequences (its
  description, e.g. 'float32 of rank 1'), or None when it does."""
  if dtype.is_integer and rank == 1:
    return None
  return f'{dtype.name} of rank {rank}'


def check_declared_targets(task) -> None:
  """One DataError when `task` declares 'targets' as something other than rank-1 integer ids of
  a vocabulary: found from the declaration alone, before any data is read. (seqio checks that
  what the Task yields matches it.)"""
  feature = task.output_features['targets']
  problem = targets_problem(tf.as_dtype(feature.dtype), feature.rank)
  if problem:
    raise DataError(
      f'the seqio Task {task.name!r} declares its "targets" output feature as '
      f'{problem}; {TOKEN_IDS_FIX}'
    )
  if not isinstance(getattr(feature.vocabulary, 'vocab_size', None), numbers.Integral):
    raise DataError(
      f'the seqio Task {task.name!r} declares its "targets" output feature '
      f'without a vocabulary of known size ({feature.vocabulary!r}); the ids are '
      'checked against it and the cache is keyed on it: declare '
      "output_features={'targets': seqio.Feature(vocabulary)}"
    )


def _describe_targets(spec) -> str:
  """What an element_spec holds as 'targets', for a message."""
  if not isinstance(spec, dict) or 'targets' not in spec:
    found = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
    return f'no "targets" (it gives {found})'
  targets = spec['targets']
  text = ' (text, not token ids)' if targets.dtype == tf.string else ''
  return f'"targets" as {targets.dtype.name} of rank {targets.shape.rank}{text}'


def _source_targets(task, split: str) -> str | None:
  """What `task`'s source yields as 'targets' before the preprocessors, or None when it yields
  rank-1 integer ids there (or cannot say: its own failure is then the news)."""
  try:
    spec = task.source.get_dataset(split=split, shuffle=False).element_spec
  except Exception:  # pylint: disable=broad-except  # the Task's own error is reported instead
    return None
  targets = spec.get('targets') if isinstance(spec, dict) else None
  if targets is not None and not targets_problem(targets.dtype, targets.shape.rank):
    return None
  return _describe_targets(spec)


def split_examples(task, split: str):
  """`task`'s `split` as seqio yields it for materialising (whole examples, unshuffled, one
  epoch): a tf.data pipeline built, not read. One DataError, naming the Task and what it gives as
  'targets', when it cannot be built or gives no rank-1 integer ids (seqio's checks of the
  declared features raise in the middle of it)."""
  try:
    data = task.get_dataset(
      sequence_length=None, split=split, use_cached=False, shuffle=False, num_epochs=1
    )
  except Exception as error:  # pylint: disable=broad-except  # any error of the user's Task
    # TensorFlow's errors list the traced frames first: the last line is what went wrong (and
    # may name the error's type itself).
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = lines[-1] if lines else ''
    if not said.startswith(f'{type(error).__name__}:'):
      said = f'{type(error).__name__}: {said}'
    found = _source_targets(task, split)
    fix = (
      f'its source gives {found}: {TOKEN_IDS_FIX}' if found else 'fix its source or preprocessors'
    )
    raise DataError(
      f'the seqio Task {task.name!r} cannot build its split {split!r} ({said}); {fix}'
    ) from None
  found = data.element_spec.get('targets') if isinstance(data.element_spec, dict) else None
  if found is None or targets_problem(found.dtype, found.shape.rank):
    raise DataError(
      f'the seqio Task {task.name!r}, split {split!r}, gives '
      f'{_describe_targets(data.element_spec)}; {TOKEN_IDS_FIX}'
    )
  return data


def targets_decoder(name: str, module: str = '') -> Callable[[Sequence[int]], str]:
  """ids -> text with the 'targets' vocabulary of the Task or Mixture `name` (a Mixture's Tasks
  share it: seqio checks that their features agree)."""
  vocabulary = get_mixture_or_task(name, module).output_features['targets'].vocabulary
  model = getattr(vocabulary, 'sp_model', None)
  if isinstance(model, bytes):  # seqio's decode stops at the first EOS; a sample crosses several
    return Tokenizer(model).decode
  return lambda ids: vocabulary.decode([int(i) for i in ids])


def subtasks(provider) -> list:
  """The Tasks of a Task (itself) or Mixture (all of them, nested ones too, sorted by name)."""
  return list(seqio.get_subtasks(provider))


def training_tasks(provider) -> list[tuple[seqio.Task, float]]:
  """(Task, rate) of each Task a Task or Mixture trains on, in seqio's order (sorted by name);
  a Mixture's rates are the blend weights, and Tasks of rate 0 are left out."""
  if isinstance(provider, seqio.Task):
    return [(provider, 1.0)]
  pairs = [(task, float(provider.get_rate(task))) for task in provider.tasks]
  kept = [(task, rate) for task, rate in pairs if rate > 0]
  if not kept:
    raise DataError(
      f'the seqio Mixture {provider.name!r} gives every Task the rate 0; give at '
      'least one a rate > 0'
    )
  return kept


def validation_splits(task) -> list[str]:
  """The splits of `task` evaluated during training: all but train and test."""
  return [split for split in task.splits if split not in UNREAD_SPLITS]


def validation_set_name(task_name: str, split: str) -> str:
  """The name of a Task's validation split in logs and TensorBoard tags: the Task's name for
  'validation', TASK.SPLIT for any other; characters other than letters, digits, '_', '-' and
  '.' (seqio allows ':') become '_'."""
  name = task_name if split == 'validation' else f'{task_name}.{split}'
  return ''.join(c if c.isalnum() or c in '_-.' else '_' for c in name)
