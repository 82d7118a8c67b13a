"""The training loop: one jitted, explicitly sharded step with donated state, compiled ahead of time.

Per iteration: the global batch (a pure function of seed and consumed samples) is split into
`num_microbatches` micro-batches of `micro_batch_size x data` rows; gradients are accumulated over
them in fp32 in the ZeRO (data-split) layout, clipped at a global norm (the pre-clip norm is
logged), and AdamW updates the fp32 master params with a learning rate computed from the consumed
samples. An iteration whose loss or gradient norm is not finite is skipped (params and Adam state,
including its step count, unchanged) and counted.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from t5x_like import checkpoints, metrics, model as model_lib, optim, partitioning
from t5x_like.config import Config, ConfigError
from t5x_like.data import SampleSource, load_default
from t5x_like.train_state import Progress, StateLayout, TrainState, make_layout


def make_train_step(cfg: Config, layout: StateLayout):
  """The pure step function: (state, batch [M, rows, S+1], consumed, iteration) -> (state, stats)."""
  model, optimizer = layout.model, layout.optimizer
  dtype = jnp.dtype(cfg.model.dtype)
  zero_shardings = layout.shardings.params
  dropout = cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0

  def loss_fn(compute_params, tokens, rng):
    logits = model.apply({'params': compute_params}, tokens[:, :-1], deterministic=not dropout,
                         rngs={'dropout': rng})
    return model_lib.cross_entropy(logits, tokens[:, 1:]).mean()

  def step(state: TrainState, batch, consumed_samples, iteration):
    # Cast once per step and constrain to the rule sharding: this all-gathers the compute-dtype
    # copy of the ZeRO-split master params (DeepSpeed's bf16 weights), not the fp32 ones.
    compute_params = jax.tree.map(
        lambda p, s: jax.lax.with_sharding_constraint(p.astype(dtype), s), state.params,
        layout.compute_param_shardings)
    rng = jax.random.fold_in(jax.random.PRNGKey(cfg.train.seed), iteration)
    num_micro = batch.shape[0]

    def accumulate(carry, xs):
      grads_acc, loss_acc = carry
      tokens, index = xs
      loss, grads = jax.value_and_grad(loss_fn)(compute_params, tokens,
                                                jax.random.fold_in(rng, index))
      grads_acc = jax.tree.map(
          lambda a, g, s: jax.lax.with_sharding_constraint(a + g.astype(jnp.float32), s),
          grads_acc, grads, zero_shardings)
      return (grads_acc, loss_acc + loss), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    (grads, loss_sum), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)),
                                        (batch, jnp.arange(num_micro)))
    grads = jax.tree.map(lambda g: g / num_micro, grads)
    loss = loss_sum / num_micro
    grads, grad_norm = optim.clip_by_global_norm(grads, cfg.optimizer.clip_grad)
    num_zeros = sum(jnp.sum(g == 0) for g in jax.tree.leaves(grads))
    updates, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    lr = optim.learning_rate(cfg.optimizer, consumed_samples)
    new_params = jax.tree.map(lambda p, u: p - lr * u, state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                             TrainState(new_params, new_opt_state), state)
    stats = {'lm_loss': loss, 'grad_norm': grad_norm, 'learning_rate': lr,
             'num_zeros': num_zeros.astype(jnp.float32), 'finite': finite,
             'loss_finite': jnp.isfinite(loss)}
    return new_state, stats

  return step


class Trainer:
  """Owns a run: mesh, state layout, data, checkpoints, metrics; `run()` trains to the end."""

  def __init__(self, cfg: Config, workdir: str):
    self.cfg = cfg.validate()
    self.workdir = os.path.abspath(workdir)
    prepare_workdir(self.workdir)
    self.ckpt_root = os.path.join(self.workdir, 'checkpoints')
    self.resume_step = checkpoints.available_steps(self.ckpt_root)
    if self.resume_step:
      checkpoints.check_compatible(checkpoints.read_config(self.ckpt_root), cfg,
                                   f'the checkpoint in {self.ckpt_root} (this workdir resumes it)')
    elif cfg.checkpoint.init_from:
      checkpoints.check_compatible(checkpoints.read_config(cfg.checkpoint.init_from), cfg,
                                   f'checkpoint.init_from={cfg.checkpoint.init_from}')
    # The mesh comes first: it creates virtual CPU devices before anything starts the backend.
    self.mesh = partitioning.make_mesh(cfg.mesh.data, cfg.mesh.pipeline, cfg.mesh.tensor)
    self.is_writer = jax.process_index() == 0
    self.writer = metrics.MetricsWriter(self.workdir, enabled=self.is_writer)
    if self.is_writer:
      _atomic_write(os.path.join(self.workdir, 'config.json'), cfg.to_json() + '\n')
    self.layout = make_layout(cfg, self.mesh)
    self.tokenizer, self.source = load_default(cfg.train.seq_len, cfg.train.seed)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise ConfigError(f'the tokenizer has {self.tokenizer.vocab_size} tokens but '
                        f'model.vocab_size is {cfg.model.vocab_size}; set model.vocab_size >= '
                        f'{self.tokenizer.vocab_size}')
    rows = cfg.train.micro_batch_size * cfg.mesh.data
    self.batch_sharding = NamedSharding(self.mesh, P(None, 'data', None))
    self.batch_shape = (cfg.num_microbatches, rows, cfg.train.seq_len + 1)
    self.checkpointer = checkpoints.Checkpointer(self.ckpt_root, cfg.checkpoint.save_interval,
                                                 cfg.checkpoint.max_to_keep)

  # ---------------------------------------------------------------------------------- set-up

  def initial_state(self) -> tuple[TrainState, Progress]:
    cfg = self.cfg
    if self.resume_step:
      state, progress = checkpoints.restore(self.ckpt_root, self.layout, cfg)
      self.writer.truncate_after(progress.iteration)
      self.writer.info(f'> resumed from {self.ckpt_root}/{progress.iteration}: '
                       f'{progress.consumed_samples} samples consumed')
      return state, progress
    if cfg.checkpoint.init_from:
      params = checkpoints.restore_params(cfg.checkpoint.init_from, self.layout, cfg)
      self.writer.info(f'> weights from {cfg.checkpoint.init_from}; fresh optimizer state')
      return TrainState(params, self.layout.fresh_opt_state(params)), Progress()
    return self.layout.init(cfg.train.seed), Progress()

  def global_batch(self, consumed_samples: int) -> jax.Array:
    """The global batch as a sharded array; each device reads only the rows it holds."""
    rows_per_micro = self.batch_shape[1]

    def rows_for(index) -> np.ndarray:
      micro_slice, row_slice = index[0], index[1]
      micro = range(*micro_slice.indices(self.batch_shape[0]))
      start, stop, _ = row_slice.indices(rows_per_micro)
      return np.stack([self.source.rows(consumed_samples + m * rows_per_micro + start,
                                        consumed_samples + m * rows_per_micro + stop)
                       for m in micro])[..., index[2]]

    return jax.make_array_from_callback(self.batch_shape, self.batch_sharding, rows_for)

  def compile(self, state: TrainState):
    step = jax.jit(make_train_step(self.cfg, self.layout),
                   in_shardings=(self.layout.shardings, self.batch_sharding, None, None),
                   out_shardings=(self.layout.shardings, None),
                   donate_argnums=(0,))
    start = time.perf_counter()
    batch = jax.ShapeDtypeStruct(self.batch_shape, jnp.int32, sharding=self.batch_sharding)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = step.lower(self.layout.abstract, batch, scalar, scalar).compile()
    self.writer.info(f'> compiled the train step {self.batch_shape} in '
                     f'{time.perf_counter() - start:.1f} s')
    return compiled

  def total_iterations(self) -> int:
    t = self.cfg.train
    by_samples = math.ceil(t.train_samples / t.global_batch_size) if t.train_samples else None
    if t.steps and by_samples:
      return min(t.steps, by_samples)
    return t.steps or by_samples

  # ------------------------------------------------------------------------------------ loop

  def run(self) -> Progress:
    cfg = self.cfg
    num_params = cfg.model.num_params(cfg.mesh.tensor)
    self.writer.info(f'> t5x_like: {cfg.model.architecture} with {num_params / 1e6:.2f}M params '
                     f'on mesh data={cfg.mesh.data} pipeline={cfg.mesh.pipeline} '
                     f'tensor={cfg.mesh.tensor} ({jax.device_count()} {jax.devices()[0].platform} '
                     f'devices); {cfg.num_microbatches} micro-batch(es) of '
                     f'{cfg.train.micro_batch_size} per data rank')
    peak, peak_source = metrics.device_peak_tflops(cfg.model.dtype)
    self.writer.info(f'> MFU reference: {peak:.4f} TFLOP/s per device ({peak_source})')
    state, progress = self.initial_state()
    compiled = self.compile(state)
    total = self.total_iterations()
    gbs, seq = cfg.train.global_batch_size, cfg.train.seq_len
    flops = metrics.megatron_flops_per_iteration(cfg, gbs, seq)
    n_devices = cfg.mesh.num_devices
    while progress.iteration < total:
      start = time.perf_counter()
      batch = self.global_batch(progress.consumed_samples)
      state, stats = compiled(state, batch, jnp.int32(progress.consumed_samples),
                              jnp.int32(progress.iteration))
      stats = jax.device_get(stats)
      elapsed = time.perf_counter() - start
      progress.iteration += 1
      progress.consumed_samples += gbs
      progress.consumed_tokens += gbs * seq
      progress.skipped_iterations += int(not stats['finite'])
      progress.nan_iterations += int(not stats['loss_finite'])
      tflops = flops / (elapsed * n_devices * 1e12)
      record = {
          'iteration': progress.iteration,
          'consumed_samples': progress.consumed_samples,
          'consumed_tokens': progress.consumed_tokens,
          'learning_rate': float(stats['learning_rate']),
          'global_batch_size': gbs,
          'lm_loss': float(stats['lm_loss']),
          'grad_norm': float(stats['grad_norm']),
          'num_zeros': float(stats['num_zeros']),
          'step_time_s': elapsed,
          'samples_per_sec': gbs / elapsed,
          'tokens_per_sec': gbs * seq / elapsed,
          'tflops': tflops,
          'mfu': tflops / peak,
          'skipped_iterations': progress.skipped_iterations,
          'nan_iterations': progress.nan_iterations,
      }
      self.writer.record(record, total)
      if self.checkpointer.should_save(progress.iteration):
        self.checkpointer.save(state, progress, cfg)
    self.checkpointer.save(state, progress, cfg)
    self.checkpointer.close()
    self.writer.info(f'> done: {progress.iteration} iterations, '
                     f'{progress.consumed_samples} samples')
    self.final_state = state
    return progress


def prepare_workdir(workdir: str) -> None:
  """Creates the workdir or checks it is writable, before anything expensive happens."""
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f'.write_probe_{os.getpid()}')
    with open(probe, 'w') as f:
      f.write('ok')
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f'workdir {workdir} is not writable ({e.strerror}); pass a --workdir that '
                      'you can write to') from None


def _atomic_write(path: str, text: str) -> None:
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w') as f:
    f.write(text)
  os.replace(tmp, path)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
