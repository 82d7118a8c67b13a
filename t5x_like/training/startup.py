"""What a command does once at start-up, before anything compiles: the whole config check, the
trainer's start-up report as lines (with the parameter table of `clu.parameter_overview`), and
the run's parts that come from its config alone: data sources, profiler, hang watchdog and
compilation cache.

`check_config` is the one full validation of a config. config.py is a leaf (it imports only
errors.py), so the checks that need the modules owning the mesh (partitioning), the fused
attention kernels (attention), the schedule's arithmetic (schedule) and the data's syntax
(data.sources) live there and run from here, in the order the messages were always given.
"""

from __future__ import annotations

import functools
import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from t5x_like.checkpointing import provenance
from t5x_like.config import Config, ConfigError
from t5x_like.data import sources
from t5x_like.data.indexed import DataError
from t5x_like.data.tokenizer import Tokenizer
from t5x_like.mesh import partitioning
from t5x_like.model import attention
from t5x_like.parallel import pipeline
from t5x_like.parallel.train_state import describe_zero
from t5x_like.training import alerts, profiling, runtime, schedule


def check_config(cfg: Config, device: attention.Device | None = None) -> Config:
  """Every check of `cfg`, before any JAX backend starts; returns it, or raises one ConfigError
  naming the fix (exit code 2 in every command). device: the devices' kind where they are not
  this machine's (`plan --gpu` compiles for GPUs on a CPU)."""
  cfg.check_values()
  if device is None:
    partitioning.check_mesh_size(cfg.mesh.num_devices)
  cfg.validate()
  if cfg.model.attention_impl != 'xla':  # 'auto' included: checked where the device is known
    attention.check_config(cfg.model, device)
  schedule.check(cfg)
  sources.check_config(cfg.data, cfg.eval)
  return cfg


def report_lines(
  cfg: Config,
  layout,
  software: dict,
  device_count: int,
  platform: str,
  device: attention.Device | None = None,
) -> list[str]:
  """The lines the log opens with, before the restore: model and mesh, software, the attention
  implementation that runs on `device` (default: a `platform` device of no known kind) and why,
  ZeRO layout, the pipeline's stages, the curriculum and the programs the ramp-up and curriculum
  compile. `layout` is the run's train_state.Layout."""
  num_params = cfg.model.num_params(cfg.mesh.tensor)
  lines = [
    f'> t5x_like: {cfg.model.architecture} with {num_params / 1e6:.2f}M params '
    f'on mesh data={cfg.mesh.data} pipeline={cfg.mesh.pipeline} '
    f'tensor={cfg.mesh.tensor} ({device_count} {platform} '
    f'devices); {cfg.num_microbatches} micro-batch(es) of '
    f'{cfg.train.micro_batch_size} per data rank',
    f'> software: {provenance.describe(software)}',
    attention.describe(cfg.model, device or attention.Device(platform)),
    describe_zero(layout),
  ]
  return lines


def start_report(cfg: Config, layout, software: dict) -> list[str]:
  """report_lines on this process's devices, then the parameter table: the trainer's log opens
  with them."""
  device = jax.devices()[0]
  report = report_lines(
    cfg, layout, software, jax.device_count(), device.platform, attention.Device.of(device)
  )
  if device.platform == 'cpu' and not partitioning.cpu_only():
    report.append(
      '> devices: an accelerator plugin is installed but found no accelerator, so JAX runs on '
      "the CPU (the plugin's error printed above is harmless; JAX_PLATFORMS=cpu skips it)"
    )
  return report + parameter_table(layout.logical.params)


def parameter_table(params) -> list[str]:
  """Lines of clu's table of `params` (arrays or ShapeDtypeStructs with their shardings): each
  parameter's name, shape, dtype, size and sharding (the mesh axes splitting each dimension),
  then the totals. Reads shapes and shardings only: nothing runs on the devices."""
  from clu import parameter_overview  # only the trainer prints it; the other commands skip clu

  table = parameter_overview.get_parameter_overview(params, include_stats='sharding')
  return [
    '> parameters as the train step holds them (clu.parameter_overview):',
    *table.splitlines(),
  ]


def schedule_lines(cfg: Config, layout) -> list[str]:
  """The lines on the pipeline's stages, the curriculum and the compiled shapes (logged after the
  MFU reference)."""
  lines = []
  if cfg.mesh.pipeline > 1:
    lines.append(describe_pipeline(cfg, layout))
  elif cfg.mesh.data > 1:
    lines.append(f'> gradients: {describe_grad_sync(cfg, layout)}')
  if cfg.curriculum.enabled:
    lines.append(describe_curriculum(cfg))
  if cfg.curriculum.enabled or cfg.train.rampup_batch_size:
    # Each is an XLA compilation while every device waits: say up front how many there are.
    shapes = schedule.step_shapes(cfg)
    lines.append(
      f'> the train step runs at {len(shapes)} shapes over the run (micro-batches x '
      'length: batch ramp-up, curriculum), each compiled when first reached '
      '(`python -m t5x_like.plan` times one compilation)'
    )
  if cfg.train.rampup_microbatch_multiple:
    padding, runs = schedule.padding_microbatches(cfg)
    cost = 'the pipeline computes them' if cfg.mesh.pipeline > 1 else 'the step skips them'
    lines.append(
      f'> ramp-up: micro-batch counts rounded up to multiples of '
      f"{cfg.train.rampup_microbatch_multiple}, {padding} of the run's {runs} "
      f'micro-batches ({100 * padding / max(runs, 1):.2f}%) padding ({cost})'
    )
  return lines


def describe_pipeline(cfg: Config, layout) -> str:
  """Layer placement, and parameters held per stage (all of a stage's tensor ranks together)."""
  plan, sizes = layout.placement, []
  per_slot, shared = 0, 0
  for path, a in jax.tree_util.tree_flatten_with_path(layout.logical.params)[0]:
    if pipeline.is_layer_leaf(path):
      per_slot += a.size // plan.num_slots
    else:
      axes = [x for ax in a.sharding.spec if ax for x in (ax if isinstance(ax, tuple) else (ax,))]
      shared += a.size // (cfg.mesh.pipeline if 'pipeline' in axes else 1)
  for s in range(plan.stages):
    sizes.append((plan.layers_per_stage()[s] * per_slot + shared) / 1e6)
  per_schedule = cfg.pipeline.microbatch_group or cfg.num_microbatches
  kept = (
    2 * plan.stages - 1
    if cfg.pipeline.schedule == '1f1b'
    else per_schedule * plan.repeats + plan.stages - 1
  )
  sync = describe_grad_sync(cfg, layout)
  return (
    f'> pipeline: {plan.describe()}; {cfg.pipeline.schedule} order, each stage keeps '
    f"{kept} micro-batches' inputs{'; ' + sync if sync else ''}; parameters per stage (M): "
    f'{[round(x, 2) for x in sizes]} (embedding spread over stages: '
    f'{cfg.padded_vocab_size % (cfg.mesh.tensor * plan.stages) == 0})'
  )


def describe_grad_sync(cfg: Config, layout) -> str:
  """When the data ranks' gradients are summed (pipeline.grad_sync, `step.own_gradient_axes`);
  '' with one data rank."""
  if cfg.mesh.data == 1:
    return ''
  copies = layout.mesh.shape.get('replica', 1)
  if layout.mesh.shape['data'] == 1:
    return f"each of the {copies} copies' (mesh.zero_group 1) gradients summed once a step"
  if cfg.grad_sync == 'step':
    return (
      "the data ranks' gradients summed once a step (pipeline.grad_sync 'step', each rank's "
      'whole fp32 gradient kept)'
    )
  if cfg.mesh.pipeline > 1:
    sync = "the data ranks' gradients all-reduced at every tick (pipeline.grad_sync 'tick')"
  else:
    sync = (
      "the data ranks' gradients reduce-scattered into the split accumulator at every "
      "micro-batch (pipeline.grad_sync 'tick')"
    )
  if copies > 1:
    sync += f', within each of the {copies} hybrid copies, whose sums are added once a step'
  return sync


def describe_curriculum(cfg: Config) -> str:
  c, seq = cfg.curriculum, cfg.train.seq_len
  lengths, step_lengths = schedule.seq_lens(cfg), schedule.step_seq_lens(cfg)
  shape = 'linear' if c.schedule == 'fixed_linear' else f'root of degree {c.root_degree}'
  # Each length the step runs at is its own XLA program: many mean many compilations.
  if c.pad_to_multiple:
    compiled = (
      f'run at {len(step_lengths)} lengths padded to multiples of '
      f'{c.pad_to_multiple} (padding outside the loss), the step compiled for each '
      'when first reached'
    )
  else:
    compiled = 'the step compiled for each when first reached' + (
      '; curriculum.pad_to_multiple or a larger curriculum.difficulty_step compiles fewer'
      if len(lengths) > 16
      else ''
    )
  decay = cfg.optimizer.decay_tokens
  return (
    f'> curriculum: sequence length {c.min_seq_len} -> {seq} in multiples of '
    f'{c.difficulty_step} over iterations 1-{c.total_iterations} ({shape}): '
    f'{len(lengths)} lengths, {compiled}; evaluation at {seq}'
    + (
      f'; learning rate decays over {decay} tokens from the '
      f'{schedule.warmup_end_tokens(cfg)} of the warm-up'
      if decay
      else ''
    )
  )


def run_profiler(cfg: Config, workdir: str, writer, is_writer: bool) -> profiling.Profiler:
  """The run's profiler (runtime.profile_*), tracing into the TensorBoard directory."""
  rt = cfg.runtime
  return profiling.Profiler(
    rt.profile_range(),
    os.path.join(workdir, rt.tensorboard_dir),
    rt.profile_process,
    log=writer.info if is_writer else print,
    every_mins=rt.profile_every_mins,
    length=rt.profile_length,
  )


def run_watchdog(cfg: Config, writer, run_alerts: alerts.Alerts, is_writer: bool):
  """The run's hang watchdog (runtime.hang_timeout_mins), armed by Trainer.run(): only the
  process that writes the log appends the stacks of a hang to it; every process prints its own to
  stderr; a hang is alerted ('hang')."""
  return runtime.Watchdog(
    cfg.runtime.hang_timeout_mins * 60.0,
    writer.log_path if is_writer else None,
    functools.partial(run_alerts.send, 'hang'),
  )


def open_data(cfg: Config, data_seed: int) -> sources.DataSources:
  """The run's data sources; a bad path, file or split (or a tokenizer larger than the model's
  vocabulary) is a ConfigError."""
  tokenizer = None
  if sources.uses_embedded_corpus(cfg.data):  # the embedded corpus and its tokenizer
    tokenizer = Tokenizer.load_default()
    if tokenizer.vocab_size > cfg.model.vocab_size:
      raise ConfigError(
        f'the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size '
        f'is {cfg.model.vocab_size}; set model.vocab_size >= '
        f'{tokenizer.vocab_size}'
      )
  try:
    return sources.build(cfg.data, cfg.train.seq_len, data_seed, tokenizer)
  except DataError as e:
    raise ConfigError(str(e)) from None


def use_compilation_cache(workdir: str, cache_dir: str, log) -> str | None:
  """Points JAX's persistent compilation cache at runtime.compilation_cache_dir (relative to the
  workdir) and logs what it holds; returns its absolute path, or None when it is off. Programs
  that compile in under a second are not stored (JAX's default threshold): loading them would
  gain nothing."""
  if not cache_dir:
    return None
  path = os.path.join(workdir, cache_dir)
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ConfigError(
      f'runtime.compilation_cache_dir: cannot create {path} ({e.strerror}); '
      "point it at a writable directory or set it to '' for no cache"
    ) from None
  if jax.config.jax_compilation_cache_dir != path:  # type: ignore[attr-defined]
    jax.config.update('jax_compilation_cache_dir', path)
    # JAX opens its cache once per process, at the first compilation that finds a directory set;
    # a cache opened before this (another Trainer in the same process) would keep its directory.
    compilation_cache.reset_cache()
  log(
    f'> compilation cache: {path} ({len(os.listdir(path))} programs stored; a program found '
    'there is loaded instead of compiled)'
  )
  return path
