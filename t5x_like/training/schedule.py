"""The run's schedule, as pure functions of the config: the batch-size ramp-up, the sequence-length
curriculum, the shapes the train step runs at, the warm-up's tokens and the learning rate.

Everything here depends on the config alone (never on a device or a checkpoint), so a restarted
job, `plan` and `data batch` compute the same numbers as the job that trained. `check(cfg)` holds
the config checks that need this arithmetic (config.py, a leaf, cannot import it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from t5x_like.config import Config, OptimizerConfig, TrainConfig
from t5x_like.errors import ConfigError

# ----------------------------------------------------------------------------- batch ramp-up


def global_batch_size_at(train: TrainConfig, consumed_samples: int) -> int:
  """Megatron's ramp-up: start + inc * floor(consumed / samples_per_increment), then GBS."""
  if not train.rampup_batch_size:
    return train.global_batch_size
  start, increment, ramp_samples = train.rampup_batch_size
  if consumed_samples > ramp_samples:
    return train.global_batch_size
  steps = (train.global_batch_size - start) // increment
  per_increment = ramp_samples / steps
  return min(train.global_batch_size, start + increment * int(consumed_samples // per_increment))


def total_iterations(train: TrainConfig) -> int:
  """Iterations until `steps` or `train_samples`, following the batch ramp-up.

  Megatron's count (`update_train_iters`), so a run of the same --train-samples logs the same
  "iteration N/TOTAL" (tr11: 115,311): iterations through the ramp-up while the consumed samples
  are <= its sample count, then whole global batches; a last partial batch is not trained."""
  if not train.train_samples:
    return train.steps
  iterations = iterations_after(train, 0)
  return min(train.steps, iterations) if train.steps else iterations


def iterations_after(train: TrainConfig, consumed_samples: int) -> int:
  """The iterations that train.train_samples still holds after `consumed_samples`, counted as
  total_iterations counts them from 0."""
  iterations, consumed = 0, consumed_samples
  if train.rampup_batch_size:
    ramp_samples = train.rampup_batch_size[2]
    while (
      consumed <= ramp_samples
      and consumed + global_batch_size_at(train, consumed) <= train.train_samples
    ):
      consumed += global_batch_size_at(train, consumed)
      iterations += 1
  return iterations + max(0, train.train_samples - consumed) // train.global_batch_size


def check_resumed(saved: Config, cfg: Config, iteration: int, consumed_samples: int) -> None:
  """A resume whose batch schedule differs from its checkpoint's, refused where it would shift
  the run silently:
  - under train.train_samples the iteration count is counted from sample 0 with the new batch
    (Megatron's count), so the run would end short of its samples or past them;
  - under optimizer.decay_tokens the warm-up's end in tokens (global batches and the
    curriculum's lengths) moves, and the decay with it.
  One ConfigError with the keys that keep the run whole."""
  t, s = cfg.train, saved.train
  steps = iteration + iterations_after(t, consumed_samples)
  steps = min(t.steps, steps) if t.steps else steps
  if t.train_samples and total_iterations(t) != steps:
    change = f'train.global_batch_size {s.global_batch_size} -> {t.global_batch_size}'
    if s.rampup_batch_size != t.rampup_batch_size:
      change += f', train.rampup_batch_size {s.rampup_batch_size} -> {t.rampup_batch_size}'
    raise ConfigError(
      f'the batch schedule changes ({change}) in a run of '
      f'train.train_samples={t.train_samples}, whose iteration count would be counted from '
      f'sample 0 with the new batch: set train.steps={steps} and train.train_samples=0 (the '
      f'{iteration} iterations trained and the {steps - iteration} that consume the rest)'
    )
  if cfg.optimizer.decay_tokens and not cfg.checkpoint.override_lr_scheduler:
    before, now = warmup_end_tokens(saved), warmup_end_tokens(cfg)
    if before != now:
      raise ConfigError(
        f'the warm-up would end at {now} tokens with this batch schedule, where the run '
        f'counted {before}: optimizer.decay_tokens counts from there, so the learning rate '
        'would jump. Keep the batch schedule of the warm-up, or set '
        'checkpoint.override_lr_scheduler=True to accept the shift'
      )


def iteration_batch_sizes(train: TrainConfig, iterations: int | None = None) -> Iterator[int]:
  """The global batch size of each of the first `iterations` iterations (default: the run's),
  following the batch ramp-up."""
  consumed = 0
  for _ in range(total_iterations(train) if iterations is None else iterations):
    size = global_batch_size_at(train, consumed)
    yield size
    consumed += size


def consumed_samples_after(train: TrainConfig, iterations: int) -> int:
  """Samples consumed by the first `iterations` iterations, following the batch ramp-up (the
  global index of iteration `iterations + 1`'s first sample)."""
  return sum(iteration_batch_sizes(train, iterations))


def total_samples(train: TrainConfig) -> int:
  """Samples the whole run consumes, following the batch ramp-up."""
  return sum(iteration_batch_sizes(train))


def ramp_batch_sizes(train: TrainConfig) -> list[int]:
  """Every global batch size the run will use."""
  if not train.rampup_batch_size:
    return [train.global_batch_size]
  start, increment, _ = train.rampup_batch_size
  return list(range(start, train.global_batch_size, increment)) + [train.global_batch_size]


def step_microbatches(cfg: Config, global_batch_size: int) -> int:
  """The micro-batches the step runs with for a global batch: Config.microbatches_for, rounded
  up to train.rampup_microbatch_multiple when that is set (at most the full batch's count);
  those past the batch's own are padding."""
  count = cfg.microbatches_for(global_batch_size)
  multiple = cfg.train.rampup_microbatch_multiple
  if not multiple:
    return count
  return min(cfg.num_microbatches, -(-count // multiple) * multiple)


# -------------------------------------------------------------------------------- curriculum


def seq_len_at(cfg: Config, iteration: int) -> int:
  """Tokens per sample that iteration `iteration` (1-based) trains on: DeepSpeed's fixed_linear/
  fixed_root difficulty (Megatron-DeepSpeed asks for `iteration + 1` before each step):
  floor(min + (max - min) * (n / total) ** (1 / degree)), rounded down to a multiple of
  difficulty_step, at most train.seq_len."""
  c, max_seq_len = cfg.curriculum, cfg.train.seq_len
  if not c.enabled:
    return max_seq_len
  degree = 1 if c.schedule == 'fixed_linear' else c.root_degree
  progress = min(1.0, iteration / c.total_iterations) ** (1.0 / degree)
  length = math.floor(progress * (max_seq_len - c.min_seq_len) + c.min_seq_len)
  return min(max_seq_len, length - length % c.difficulty_step)


def padded_seq_len(cfg: Config, seq_len: int) -> int:
  """The length the step runs at to train on seq_len tokens (curriculum.pad_to_multiple)."""
  multiple = cfg.curriculum.pad_to_multiple
  if not multiple:
    return seq_len
  return min(cfg.train.seq_len, -(-seq_len // multiple) * multiple)


def padded_seq_len_at(cfg: Config, iteration: int) -> int:
  """The sequence length iteration `iteration` runs at: seq_len_at(iteration), rounded up to
  curriculum.pad_to_multiple when that is set (the rest padding outside the loss)."""
  return padded_seq_len(cfg, seq_len_at(cfg, iteration))


def seq_lens(cfg: Config) -> list[int]:
  """Every training sequence length of the run, in order."""
  if not cfg.curriculum.enabled:
    return [cfg.train.seq_len]
  last = min(cfg.curriculum.total_iterations, total_iterations(cfg.train))
  return sorted({seq_len_at(cfg, n) for n in range(1, last + 1)})


def step_seq_lens(cfg: Config) -> list[int]:
  """Every length the step runs at, in order: one compiled program each (per batch size)."""
  return sorted({padded_seq_len(cfg, n) for n in seq_lens(cfg)})


def step_shapes(cfg: Config) -> list[tuple[int, int]]:
  """(micro-batches, length the step runs at) of the run's iterations, each once, in order of
  first use: the batch ramp-up and the curriculum each make the train step a new XLA program
  (tr11's ramp: 117 of them; train.rampup_microbatch_multiple and curriculum.pad_to_multiple
  make fewer)."""
  if not cfg.train.rampup_batch_size and not cfg.curriculum.enabled:
    return [(cfg.num_microbatches, cfg.train.seq_len)]
  shapes: dict[tuple[int, int], None] = {}
  for n, gbs in enumerate(iteration_batch_sizes(cfg.train), start=1):
    shapes.setdefault((step_microbatches(cfg, gbs), padded_seq_len_at(cfg, n)), None)
  return list(shapes)


def padding_microbatches(cfg: Config) -> tuple[int, int]:
  """(padding micro-batches, micro-batches the step runs) summed over the run's iterations:
  what train.rampup_microbatch_multiple costs a pipeline, which computes the padding."""
  padding = total = 0
  for gbs in iteration_batch_sizes(cfg.train):
    step = step_microbatches(cfg, gbs)
    padding += step - cfg.microbatches_for(gbs)
    total += step
  return padding, total


# ----------------------------------------------------------------------------- learning rate


def warmup_end_tokens(cfg: Config) -> int:
  """Tokens consumed when the learning-rate warm-up ends: the first iteration boundary at
  which optimizer.warmup_samples samples are consumed. optimizer.decay_tokens counts from here.

  Megatron records this once, only if an iteration ends exactly on warmup_samples; otherwise
  its token decay counts from token 0 and the learning rate drops at the end of the warm-up.
  Here it is a pure function of the config, so it is the same after any restart."""
  samples = tokens = n = 0
  while samples < cfg.optimizer.warmup_samples:
    n += 1
    gbs = global_batch_size_at(cfg.train, samples)
    samples += gbs
    tokens += gbs * seq_len_at(cfg, n)
  return tokens


def learning_rate(
  cfg: OptimizerConfig, consumed_samples: int, consumed_tokens: int = 0, warmup_end_tokens: int = 0
) -> float:
  """Linear warm-up from 0 over warmup_samples, then decay to min_lr at decay_samples, then flat.

  Megatron's AnnealingLR in samples: during warm-up lr = lr * consumed / warmup; after it the decay
  ratio is (consumed - warmup) / (decay - warmup), and lr = min_lr + (lr - min_lr) * coeff with
  coeff = 0.5 * (cos(pi * ratio) + 1) for cosine, 1 - ratio for linear, 1 for constant. With
  decay_tokens (--lr-decay-tokens) the ratio counts tokens instead: (consumed_tokens -
  warmup_end_tokens) / (decay_tokens - warmup_end_tokens), warmup_end_tokens being
  `schedule.warmup_end_tokens(cfg)`.

  The learning rate is a pure function of consumed samples (and tokens), not of the optimizer
  step, so it is the same after any restart, batch-size ramp or skipped iteration. Computed on
  the host in float64 and passed to the step: token counts pass 2^31 (tr11 consumed 450B
  tokens), which an int32 or float32 argument would not hold exactly.
  """
  warmup = cfg.warmup_samples
  if consumed_samples < warmup:
    return cfg.lr * consumed_samples / warmup
  if cfg.decay_style == 'constant':
    return cfg.lr
  if cfg.decay_tokens > 0:
    ratio = (consumed_tokens - warmup_end_tokens) / (cfg.decay_tokens - warmup_end_tokens)
  elif cfg.decay_samples > 0:
    ratio = (consumed_samples - warmup) / (cfg.decay_samples - warmup)
  else:
    return cfg.lr
  ratio = min(1.0, max(0.0, ratio))
  if cfg.decay_style == 'cosine':
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
  else:
    coeff = 1.0 - ratio
  return cfg.min_lr + (cfg.lr - cfg.min_lr) * coeff


# ------------------------------------------------------------------------------------ checks


def check(cfg: Config) -> None:
  """The config checks that follow the schedule (run after Config.validate, which has checked
  each key's range and the ramp-up's format); one ConfigError naming the fix."""
  t, mesh = cfg.train, cfg.mesh
  per_step = t.micro_batch_size * mesh.data
  for gbs in ramp_batch_sizes(t):
    if gbs % per_step:
      raise ConfigError(
        f'train.rampup_batch_size reaches a global batch of {gbs}, which train.'
        f'micro_batch_size x mesh.data ({per_step}) does not divide; pick a start '
        f'and increment that are multiples of {per_step}'
      )
  first_batch = global_batch_size_at(t, 0)
  if t.train_samples and t.train_samples < first_batch:
    raise ConfigError(
      f'train.train_samples ({t.train_samples}) is less than one global batch '
      f'({first_batch}): the run would train no iteration; raise it or set '
      'train.steps'
    )
  p = mesh.pipeline
  if p > 1:
    fewest = min(cfg.microbatches_for(g) for g in ramp_batch_sizes(t))
    if fewest < p:
      raise ConfigError(
        f'{fewest} micro-batch(es) per step is fewer than the {p} pipeline '
        'stages (global batch / (micro_batch_size x mesh.data)); raise train.'
        'global_batch_size (or the ramp-up start) or lower train.micro_batch_size'
      )
  check_microbatch_group(cfg)
  o = cfg.optimizer
  if o.decay_tokens:
    warmup_tokens = warmup_end_tokens(cfg)
    if o.decay_tokens <= warmup_tokens:
      raise ConfigError(
        f'optimizer.decay_tokens ({o.decay_tokens}) must exceed the '
        f'{warmup_tokens} tokens consumed by the end of the warm-up '
        f'(optimizer.warmup_samples={o.warmup_samples})'
      )


def check_microbatch_group(cfg: Config) -> None:
  """pipeline.microbatch_group: at least the stages, and a divisor of every micro-batch count the
  step runs with (the batch ramp-up's, as train.rampup_microbatch_multiple rounds them)."""
  group, stages = cfg.pipeline.microbatch_group, cfg.mesh.pipeline
  if not group:
    return
  if stages == 1:
    raise ConfigError(
      f'pipeline.microbatch_group={group} groups the micro-batches of a pipeline '
      'schedule, and mesh.pipeline is 1; set pipeline.microbatch_group=0 or '
      'mesh.pipeline > 1'
    )
  counts = sorted({step_microbatches(cfg, g) for g in ramp_batch_sizes(cfg.train)})
  common = math.gcd(*counts)
  fits = [g for g in range(stages, common + 1) if common % g == 0]
  fixes = [
    f'groups that fit: {fits}' if fits else f'no group of at least {stages} divides them all'
  ]
  if cfg.train.rampup_batch_size and cfg.num_microbatches % group == 0 and group >= stages:
    fixes.append(f'set train.rampup_microbatch_multiple to a multiple of {group}')
  fixes.append('set pipeline.microbatch_group=0')
  if group < stages:
    raise ConfigError(
      f'pipeline.microbatch_group ({group}) is fewer than the {stages} pipeline '
      f'stages: each group must fill the pipeline; {"; ".join(fixes)}'
    )
  uneven = [c for c in counts if c % group]
  if uneven:
    raise ConfigError(
      f"pipeline.microbatch_group ({group}) does not divide the step's "
      f'micro-batch count(s) {uneven[:5]}{" ..." if len(uneven) > 5 else ""} '
      '(global batch / (micro_batch_size x mesh.data), rounded up to '
      f'train.rampup_microbatch_multiple); {"; ".join(fixes)}'
    )
