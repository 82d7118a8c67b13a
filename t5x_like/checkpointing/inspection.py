"""Checkpoint inspection: what `python -m t5x_like.ckpt inspect / diff / verify / stats` compute
(the command line is ckpt.py; saving and restoring are checkpoints.py).

`inspect` reads metadata only (the JSON items and Orbax's array metadata). `diff` and `stats` stream
every tensor from disk a slice at a time (at most CHUNK_BYTES in memory per tensor), so they work
on checkpoints larger than memory. `verify` streams too, then restores the whole state onto the mesh
it was saved from (virtual CPU devices) exactly as a resuming run would.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from t5x_like.checkpointing import checkpoints, provenance
from t5x_like.checkpointing.checkpoints import CheckpointError

CHUNK_BYTES = 256 << 20
ARRAY_ITEMS = ('params', 'opt_state')


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  item: str  # 'params' or 'opt_state'
  name: str  # Orbax's dotted name in the item: 'layers.attn.qkv_kernel', '0.mu.final_ln.bias'
  shape: tuple[int, ...]
  dtype: str
  spec: tuple  # the PartitionSpec it was saved with
  mesh: dict[str, int]  # the mesh it was saved from

  @property
  def key(self) -> str:
    return f'{self.item}/{self.name}'

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * np.dtype(self.dtype).itemsize

  @property
  def group(self) -> str:
    """params, adam_mu, adam_nu or adam_count: what `stats` groups by."""
    if self.item == 'params':
      return 'params'
    parts = self.name.split('.')
    return f'adam_{parts[1]}' if len(parts) > 1 and parts[1] in ('mu', 'nu', 'count') else 'opt'

  def sharding_text(self) -> str:
    axes = ', '.join(
      repr(a) if not isinstance(a, (tuple, list)) else f'({", ".join(map(repr, a))})'
      for a in self.spec
    )
    mesh = ' '.join(f'{k}={v}' for k, v in self.mesh.items())
    return f'P({axes}) on {mesh}'


class CheckpointReader:
  """One step of a checkpoint: its JSON items, its tensors' metadata, and tensor slices."""

  def __init__(self, path: str, step: int | None = None):
    self.root, self.step = checkpoints.resolve(path, step)
    self.dir = os.path.join(self.root, str(self.step))
    self.config = checkpoints.read_config(self.root, self.step)
    self.progress = checkpoints.read_progress(self.root, self.step)
    self.meta = checkpoints.read_meta(self.root, self.step)
    self.items = [i for i in ARRAY_ITEMS if os.path.isdir(os.path.join(self.dir, i))]
    self._tensors: list[TensorInfo] | None = None
    self._stores: dict[str, Any] = {}

  def tensors(self) -> list[TensorInfo]:
    if self._tensors is None:
      self._tensors = [t for item in self.items for t in self._item_tensors(item)]
    return self._tensors

  def _item_tensors(self, item: str) -> list[TensorInfo]:
    import jax
    import orbax.checkpoint as ocp
    from orbax.checkpoint._src.metadata.value import ArrayMetadata

    try:
      with ocp.StandardCheckpointer() as reader:
        tree = reader.metadata(os.path.join(self.dir, item)).item_metadata.tree
    except Exception as e:  # a missing or truncated _METADATA, or not an Orbax item at all
      raise CheckpointError(
        f'{self.dir} is damaged: the metadata of its {item} item cannot be '
        f'read ({checkpoints.error_reason(e)})'
      ) from None
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, ArrayMetadata))
    infos = []
    for leaf in leaves:
      sharding = leaf.sharding
      spec = tuple(getattr(sharding, 'partition_spec', ()) or ())
      mesh = (
        dict(zip(sharding.axis_names, (int(n) for n in sharding.shape)))
        if hasattr(sharding, 'axis_names')
        else {}
      )
      infos.append(
        TensorInfo(
          item, leaf.name, tuple(int(n) for n in leaf.shape), np.dtype(leaf.dtype).name, spec, mesh
        )
      )
    return infos

  def disk_bytes(self) -> int:
    return sum(
      os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.dir) for f in files
    )

  def _store(self, info: TensorInfo):
    """The TensorStore of one saved array (how Orbax lays it out: zarr, usually inside OCDBT)."""
    if info.key not in self._stores:
      import tensorstore as ts

      item_dir = os.path.join(self.dir, info.item)
      with open(os.path.join(item_dir, '_METADATA')) as f:
        layout = json.load(f)
      if layout.get('use_ocdbt', True):
        kvstore = {'driver': 'ocdbt', 'base': f'file://{item_dir}', 'path': info.name}
      else:
        kvstore = {'driver': 'file', 'path': os.path.join(item_dir, info.name)}
      spec: dict[str, object] = {
        'driver': 'zarr3' if layout.get('use_zarr3') else 'zarr',
        'kvstore': kvstore,
      }
      if not layout.get('use_zarr3'):
        spec['fill_missing_data_reads'] = False  # a missing chunk is an error, never zeros
      try:
        self._stores[info.key] = ts.open(spec, open=True, read=True).result()
      except Exception as e:
        raise CheckpointError(
          f'{self.dir} is damaged: {info.key} cannot be opened ({checkpoints.error_reason(e)})'
        ) from None
    return self._stores[info.key]

  def chunks(self, info: TensorInfo, step: int | None = None) -> Iterator[np.ndarray]:
    """The tensor as consecutive slices of its first dim, each at most CHUNK_BYTES (or of
    `step` rows)."""
    store = self._store(info)
    rows = info.shape[0] if info.shape else 1
    row_bytes = max(1, info.nbytes // max(rows, 1))
    step = step or max(1, CHUNK_BYTES // row_bytes)
    try:
      if not info.shape:
        yield np.asarray(store.read().result()).reshape(1)
        return
      for start in range(0, rows, step):
        yield np.asarray(store[start : min(rows, start + step)].read().result())
    except Exception as e:
      raise CheckpointError(
        f'{self.dir} is damaged: {info.key} cannot be read ({checkpoints.error_reason(e)})'
      ) from None


def _progress_bar(total_bytes: int, description: str):
  from tqdm import tqdm

  # disable=None: shown on a terminal, silent when the output is a pipe or a file.
  return tqdm(
    total=total_bytes, desc=description, unit='B', unit_scale=True, disable=None, leave=False
  )


# ------------------------------------------------------------------------------------- inspect


def inspect(reader: CheckpointReader) -> dict[str, Any]:
  """Everything about a step that the metadata says, without reading a tensor."""
  cfg, m = reader.config, reader.config.model
  tensors = reader.tensors()
  return {
    'path': reader.dir,
    'step': reader.step,
    'steps_in_root': checkpoints.available_steps(reader.root),
    'model': {
      'architecture': m.architecture,
      'num_layers': m.num_layers,
      'hidden_size': m.hidden_size,
      'num_heads': m.num_heads,
      'vocab_size': m.vocab_size,
      'padded_vocab_size': cfg.padded_vocab_size,
      'num_params': m.num_params(cfg.mesh.tensor),
      'dtype': m.dtype,
    },
    'saved_mesh': dataclasses.asdict(cfg.mesh),
    'train': {
      'global_batch_size': cfg.train.global_batch_size,
      'seq_len': cfg.train.seq_len,
      'micro_batch_size': cfg.train.micro_batch_size,
    },
    'progress': dataclasses.asdict(reader.progress),
    'meta': reader.meta,
    'has_optimizer_state': 'opt_state' in reader.items,
    'tensors': [
      {
        'name': t.key,
        'shape': list(t.shape),
        'dtype': t.dtype,
        'bytes': t.nbytes,
        'sharding': t.sharding_text(),
      }
      for t in tensors
    ],
    'total_bytes': {
      item: sum(t.nbytes for t in tensors if t.item == item) for item in reader.items
    },
    **optimizer_bytes_per_param(tensors),
    'disk_bytes': reader.disk_bytes(),
  }


def param_name_of(info: TensorInfo) -> str | None:
  """The param an Adam moment tensor belongs to ('layers.mlp.wi_kernel' for
  '0.mu.layers.mlp.wi_kernel' and for adamw_8bit's '0.mu.layers.mlp.wi_kernel.codes')."""
  if info.group not in ('adam_mu', 'adam_nu'):
    return None
  name = info.name.split('.', 2)[2]
  for part in ('.codes', '.scales'):
    name = name[: -len(part)] if name.endswith(part) else name
  return name


def optimizer_bytes_per_param(tensors: list[TensorInfo]) -> dict[str, Any]:
  """The Adam moments' bytes per param, overall and per param (8 for fp32 moments, about 2 for
  adamw_8bit's codes and scales); {} for a weights-only checkpoint."""
  sizes = {t.name: math.prod(t.shape) for t in tensors if t.item == 'params'}
  state: dict[str, int] = {}
  for t in tensors:
    name = param_name_of(t)
    if name is not None:
      state[name] = state.get(name, 0) + t.nbytes
  if not state:
    return {}
  return {
    'optimizer_bytes_per_param': sum(state.values()) / sum(sizes[n] for n in state),
    'optimizer_bytes_per_param_by_tensor': {n: b / sizes[n] for n, b in state.items()},
  }


def format_inspect(info: dict[str, Any]) -> str:
  m, p, meta = info['model'], info['progress'], info['meta']
  lines = [
    f'checkpoint {info["path"]} (step {info["step"]}; steps in its root: {info["steps_in_root"]})',
    f'model: {m["architecture"]}, {m["num_layers"]} layers, hidden {m["hidden_size"]}, '
    f'{m["num_heads"]} heads, vocab {m["vocab_size"]} (padded {m["padded_vocab_size"]}), '
    f'{m["num_params"] / 1e6:.2f}M params, compute dtype {m["dtype"]}',
    'saved from mesh: ' + ' '.join(f'{k}={v}' for k, v in info['saved_mesh'].items()),
    f'progress: iteration {p["iteration"]}, consumed samples {p["consumed_samples"]}, '
    f'consumed tokens {p["consumed_tokens"]}, skipped {p["skipped_iterations"]}, '
    f'nan {p["nan_iterations"]}',
    f'rng: dropout seed {meta["rng"]["seed"]} (key of iteration i: '
    f'fold_in(PRNGKey({meta["rng"]["seed"]}), i)); data: seed {meta["data"]["seed"]}, '
    f'position {meta["data"]["consumed_samples"]} samples',
    'lr schedule: ' + ', '.join(f'{k}={v}' for k, v in meta['lr_schedule'].items()),
    f'optimizer state: {"yes" if info["has_optimizer_state"] else "no (weights only)"}; Adam '
    f'step count started from 0 at iteration {meta["adam_count_base"]["iteration"]}'
    + (
      f"; lr 0 through iteration {meta['lr_zero_until']} (the reset's warm-up)"
      if meta.get('lr_zero_until')
      else ''
    ),
    'steps kept past the keep policy: '
    + (', '.join(map(str, meta.get('kept_steps', []))) or 'none')
    + '; temporary (timed saves, deleted at the next save): '
    + (', '.join(map(str, meta.get('temporary_steps', []))) or 'none'),
    'written by: '
    + (
      provenance.describe(meta['software'])
      if meta.get('software')
      else 'not recorded (a checkpoint older than the record)'
    ),
    '',
  ]
  width = max(len(t['name']) for t in info['tensors'])
  lines.append(f'{"tensor":<{width}}  {"shape":<22} {"dtype":<8} {"bytes":>12}  saved sharding')
  for t in info['tensors']:
    lines.append(
      f'{t["name"]:<{width}}  {str(tuple(t["shape"])):<22} {t["dtype"]:<8} '
      f'{t["bytes"]:>12,}  {t["sharding"]}'
    )
  if 'optimizer_bytes_per_param' in info:
    lines.append(f'optimizer state: {info["optimizer_bytes_per_param"]:.3f} bytes per param')
  totals = ', '.join(f'{item} {_human(n)}' for item, n in info['total_bytes'].items())
  lines.append(
    f'total: {totals} ({len(info["tensors"])} tensors); on disk {_human(info["disk_bytes"])}'
  )
  return '\n'.join(lines)


def _human(n: float) -> str:
  for unit in ('B', 'KB', 'MB', 'GB'):
    if n < 1000:
      return f'{n:.1f} {unit}' if unit != 'B' else f'{int(n)} B'
    n /= 1000
  return f'{n:.1f} TB'


# ---------------------------------------------------------------------------------------- stats


@dataclasses.dataclass
class _Moments:
  """Streaming norm/mean/std/min/max/zeros over chunks (Chan's parallel variance)."""

  count: int = 0
  mean: float = 0.0
  m2: float = 0.0
  sumsq: float = 0.0
  min: float = math.inf
  max: float = -math.inf
  zeros: int = 0
  nonfinite: int = 0

  def add(self, chunk: np.ndarray) -> None:
    x = chunk.astype(np.float64).ravel()
    if not x.size:
      return
    finite = np.isfinite(x)
    self.nonfinite += int(x.size - finite.sum())
    self.zeros += int(np.count_nonzero(x == 0))
    self.min, self.max = min(self.min, float(x.min())), max(self.max, float(x.max()))
    n, mean = x.size, float(x.mean())
    m2 = float(((x - mean) ** 2).sum())
    delta, total = mean - self.mean, self.count + n
    self.mean += delta * n / total
    self.m2 += m2 + delta * delta * self.count * n / total
    self.count = total
    self.sumsq += float((x * x).sum())

  def summary(self) -> dict[str, float]:
    return {
      'norm': math.sqrt(self.sumsq),
      'mean': self.mean,
      'std': math.sqrt(self.m2 / self.count) if self.count else 0.0,
      'min': self.min,
      'max': self.max,
      'zero_fraction': self.zeros / self.count if self.count else 0.0,
      'nonfinite': self.nonfinite,
    }


def quantized_pairs(reader: CheckpointReader) -> list[tuple[TensorInfo, TensorInfo]]:
  """(codes, scales) of every 8-bit Adam moment (optimizer.name='adamw_8bit')."""
  by_name = {t.name: t for t in reader.tensors() if t.item == 'opt_state'}
  return [
    (t, by_name[t.name[: -len('codes')] + 'scales'])
    for t in by_name.values()
    if t.name.endswith('.codes') and t.name[: -len('codes')] + 'scales' in by_name
  ]


def dequantized_chunks(
  reader: CheckpointReader, codes: TensorInfo, scales: TensorInfo
) -> Iterator[np.ndarray]:
  """An 8-bit moment as fp32 values [rows, ..., block], a slice of its first dim at a time."""
  from t5x_like.optim import quantized_adam

  code = quantized_adam.code_for(codes.group[len('adam_') :])
  step = max(1, CHUNK_BYTES // max(1, codes.nbytes // max(codes.shape[0], 1)))
  for c, s in zip(reader.chunks(codes, step), reader.chunks(scales, step)):
    yield quantized_adam.dequantize_blocks(c, s, code)


def stats(reader: CheckpointReader) -> list[dict[str, Any]]:
  """Per tensor of params and of both Adam moments: norm, mean, std, min, max, zero fraction.
  An 8-bit moment (codes and scales) is one row of its dequantised values, named without
  '.codes'."""
  pairs = {codes.key: scales for codes, scales in quantized_pairs(reader)}
  paired = {s.key for s in pairs.values()}
  tensors = [
    t
    for t in reader.tensors()
    if t.group in ('params', 'adam_mu', 'adam_nu') and t.key not in paired
  ]
  rows = []
  with _progress_bar(sum(t.nbytes for t in tensors), 'stats') as bar:
    for t in tensors:
      moments = _Moments()
      name = t.key
      if t.key in pairs:
        name = t.key[: -len('.codes')]
        chunks = dequantized_chunks(reader, t, pairs[t.key])
      else:
        chunks = reader.chunks(t)
      for chunk in chunks:
        moments.add(chunk)
        bar.update(chunk.nbytes if t.key not in pairs else chunk.size)
      rows.append({'group': t.group, 'name': name, 'shape': list(t.shape), **moments.summary()})
  return rows


def format_stats(rows: list[dict[str, Any]]) -> str:
  width = max(len(r['name']) for r in rows)
  lines = [
    f'{"tensor":<{width}}  {"norm":>11} {"mean":>11} {"std":>11} {"min":>11} {"max":>11} '
    f'{"zeros":>7}'
  ]
  for r in rows:
    lines.append(
      f'{r["name"]:<{width}}  {r["norm"]:11.4e} {r["mean"]:11.3e} {r["std"]:11.4e} '
      f'{r["min"]:11.3e} {r["max"]:11.3e} {r["zero_fraction"]:7.2%}'
    )
  return '\n'.join(lines)


# ----------------------------------------------------------------------------------------- diff


def diff(a: CheckpointReader, b: CheckpointReader, atol: float) -> dict[str, Any]:
  """Per tensor of both checkpoints: max |a - b| and ||a - b|| / ||a||; which exceed atol."""
  tensors_a = {t.key: t for t in a.tensors()}
  tensors_b = {t.key: t for t in b.tensors()}
  common = [k for k in tensors_a if k in tensors_b]
  rows, differ = [], []
  for key in common:
    if tensors_a[key].shape != tensors_b[key].shape:
      rows.append(
        {
          'name': key,
          'shape_a': list(tensors_a[key].shape),
          'shape_b': list(tensors_b[key].shape),
          'max_abs_diff': math.inf,
          'rel_norm_diff': math.inf,
          'differs': True,
        }
      )
      differ.append(key)
  same_shape = [k for k in common if tensors_a[k].shape == tensors_b[k].shape]
  with _progress_bar(sum(tensors_a[k].nbytes for k in same_shape), 'diff') as bar:
    for key in same_shape:
      max_abs, diff_sq, ref_sq = 0.0, 0.0, 0.0
      for xa, xb in zip(a.chunks(tensors_a[key]), b.chunks(tensors_b[key])):
        xa, xb = xa.astype(np.float64), xb.astype(np.float64)
        d = np.abs(xa - xb)
        same_nan = np.isnan(xa) & np.isnan(xb)  # NaN in both is no difference
        d = np.where(same_nan, 0.0, d)
        max_abs = max(max_abs, float(d.max()) if d.size else 0.0)
        diff_sq += float((d * d).sum())
        ref_sq += float(np.nansum(xa * xa))
        bar.update(xa.size * np.dtype(tensors_a[key].dtype).itemsize)
      rel = math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq else (0.0 if not diff_sq else math.inf)
      exceeds = not max_abs <= atol  # NaN exceeds any tolerance
      rows.append(
        {
          'name': key,
          'shape': list(tensors_a[key].shape),
          'max_abs_diff': max_abs,
          'rel_norm_diff': rel,
          'differs': exceeds,
        }
      )
      if exceeds:
        differ.append(key)
  only_a = sorted(set(tensors_a) - set(tensors_b))
  only_b = sorted(set(tensors_b) - set(tensors_a))
  return {
    'a': a.dir,
    'b': b.dir,
    'iteration_a': a.progress.iteration,
    'iteration_b': b.progress.iteration,
    'atol': atol,
    'tensors': rows,
    'differ': differ,
    'only_in_a': only_a,
    'only_in_b': only_b,
    'same': not differ and not only_a and not only_b,
  }


def format_diff(result: dict[str, Any]) -> str:
  lines = [
    f'A: {result["a"]} (iteration {result["iteration_a"]})',
    f'B: {result["b"]} (iteration {result["iteration_b"]})',
  ]
  width = max([len(r['name']) for r in result['tensors']] + [6])
  lines.append(f'{"tensor":<{width}}  {"max |a-b|":>11} {"|a-b|/|a|":>11}')
  for r in result['tensors']:
    mark = '  DIFFERS' if r['differs'] else ''
    if 'shape_a' in r:
      lines.append(
        f'{r["name"]:<{width}}  shapes differ: {tuple(r["shape_a"])} vs {tuple(r["shape_b"])}{mark}'
      )
    else:
      lines.append(
        f'{r["name"]:<{width}}  {r["max_abs_diff"]:11.3e} {r["rel_norm_diff"]:11.3e}{mark}'
      )
  for side in ('a', 'b'):
    for name in result[f'only_in_{side}']:
      lines.append(f'{name}: only in {side.upper()}')
  if result['same']:
    lines.append(f'every tensor is equal within atol={result["atol"]:g}')
  else:
    names = result['differ'][:10] + (
      [f'... {len(result["differ"]) - 10} more (marked above)']
      if len(result['differ']) > 10
      else []
    )
    lines.append(
      f'{len(result["differ"])} tensor(s) differ beyond atol={result["atol"]:g}: '
      f'{", ".join(names)}'
      + (
        f'; {len(result["only_in_a"]) + len(result["only_in_b"])} in one checkpoint only'
        if result['only_in_a'] or result['only_in_b']
        else ''
      )
    )
  return '\n'.join(lines)


# --------------------------------------------------------------------------------------- verify


def verify(reader: CheckpointReader, restore: bool = True) -> list[dict[str, Any]]:
  """Each check as {check, ok, detail}; the step is sound when every `ok` is True. `restore`
  False (`verify --no-restore`) leaves out the restore and the replica check, which need host
  memory of the checkpoint's size (over 2 TB for BLOOM-176B): the streamed checks remain."""
  results = []

  def report(check: str, ok: bool, detail: str) -> None:
    results.append({'check': check, 'ok': bool(ok), 'detail': detail})

  cfg, progress, meta = reader.config, reader.progress, reader.meta
  # Devices of the saved mesh must exist before anything starts the JAX backend.
  mesh = _saved_mesh_or_none(cfg) if restore else None
  tensors = reader.tensors()
  nonfinite, count = [], None
  with _progress_bar(sum(t.nbytes for t in tensors), 'verify: reading') as bar:
    for t in tensors:
      for chunk in reader.chunks(t):
        if np.issubdtype(chunk.dtype, np.floating) and not np.isfinite(chunk).all():
          nonfinite.append(t.key)
          bar.update(t.nbytes)
          break
        if t.group == 'adam_count':
          count = int(chunk.reshape(-1)[0])
        bar.update(chunk.nbytes)
  report(
    'finite',
    not nonfinite,
    f'{len(nonfinite)} tensor(s) hold NaN or inf: {", ".join(nonfinite)}'
    if nonfinite
    else f'all {len(tensors)} tensors are finite',
  )
  pairs = quantized_pairs(reader)
  if pairs:
    bad = [
      problem
      for codes, scales in pairs
      for problem in [quantized_problem(reader, codes, scales)]
      if problem
    ]
    report(
      '8-bit optimizer state',
      not bad,
      '; '.join(bad)
      if bad
      else f'all {len(pairs)} 8-bit moments have uint8 codes, one finite scale >= 0 per block, '
      'all-zero codes where the scale is 0 and a code of magnitude ~1 (the absmax) '
      'elsewhere',
    )
  if 'opt_state' in reader.items:
    want = checkpoints.expected_adam_count(progress, meta)
    base = meta['adam_count_base']
    report(
      'adam step count',
      count == want,
      f'Adam step count {count}, expected {want} = iterations since the count started at '
      f'iteration {base["iteration"]} ({progress.iteration - base["iteration"]}) minus the '
      f'skipped ones since ({progress.skipped_iterations - base["skipped_iterations"]})',
    )
  consistent = (
    meta['data']['consumed_samples'] == progress.consumed_samples
    and meta['rng']['iteration'] == progress.iteration
    and progress.consumed_tokens == progress.consumed_samples * cfg.train.seq_len
  )
  report(
    'progress',
    consistent,
    f'iteration {progress.iteration}, {progress.consumed_samples} samples, '
    f'{progress.consumed_tokens} tokens; data position {meta["data"]["consumed_samples"]}, '
    f'rng iteration {meta["rng"]["iteration"]}',
  )
  if restore:
    report_restore(reader, mesh, report)
  else:
    one_device, mesh = _one_device_layout(cfg)
    report_shapes(reader, one_device, mesh, report)
  return results


def quantized_problem(
  reader: CheckpointReader, codes: TensorInfo, scales: TensorInfo
) -> str | None:
  """What is wrong with one 8-bit moment, or None: codes uint8 of shape scales.shape + (B,),
  scales finite and >= 0, a block of scale 0 all zero codes, any other block holding its absmax
  (a code of magnitude ~1, as quantisation by absmax always does)."""
  from t5x_like.optim import quantized_adam

  name = codes.key[: -len('.codes')]
  if codes.dtype != 'uint8' or scales.dtype != 'float32':
    return f'{name}: codes {codes.dtype} and scales {scales.dtype}, expected uint8 and float32'
  if codes.shape[:-1] != scales.shape:
    return f'{name}: codes {codes.shape} do not match scales {scales.shape}'
  code = quantized_adam.code_for(codes.group[len('adam_') :])
  zero = int(np.flatnonzero(code == 0)[0])
  magnitude = np.abs(code)[(np.arange(256) + zero) % 256]  # by stored byte
  step = max(1, CHUNK_BYTES // max(1, codes.nbytes // max(codes.shape[0], 1)))
  for c, s in zip(reader.chunks(codes, step), reader.chunks(scales, step)):
    if not (np.isfinite(s).all() and (s >= 0).all()):
      return f'{name}: a scale is negative or not finite'
    largest = magnitude[c].max(axis=-1)
    if (c[s == 0] != 0).any():
      return f'{name}: a block of scale 0 has non-zero codes'
    if (largest[s > 0] < 0.99).any():
      return f'{name}: a block of non-zero scale has no code near 1 (its absmax)'
  return None


def _saved_mesh_or_none(cfg):
  from t5x_like.config import ConfigError
  from t5x_like.mesh import partitioning

  try:
    return partitioning.mesh_of(cfg.mesh)
  except ConfigError:
    return None


def _one_device_layout(cfg):
  """(cfg on one device, keeping its saved vocabulary padding; that device's mesh)."""
  from t5x_like.mesh import partitioning

  one = cfg.replace(
    mesh={'data': 1, 'pipeline': 1, 'tensor': 1},
    model={'pad_vocab_size_to': cfg.padded_vocab_size},
  )
  return one, partitioning.make_mesh(1, 1, 1)


def report_shapes(reader: CheckpointReader, cfg, mesh, report):
  """Reports whether every tensor has the shape `cfg` gives it (abstract shapes: nothing is
  allocated); returns the layout of `cfg` on `mesh`."""
  from t5x_like.parallel.train_state import make_layout

  layout = make_layout(cfg, mesh)
  shapes_wrong = []
  for t in reader.tensors():
    want = _abstract_at(layout.canonical, t)
    if want is not None and tuple(want.shape) != t.shape:
      shapes_wrong.append(f'{t.key} {t.shape} (config says {tuple(want.shape)})')
  report(
    'shapes match the config',
    not shapes_wrong,
    '; '.join(shapes_wrong) if shapes_wrong else 'every tensor has the shape its config gives',
  )
  return layout


def report_restore(reader: CheckpointReader, mesh, report) -> None:
  """Restores like a resuming run; on the saved mesh, checks every replica is identical."""
  import jax

  from t5x_like.mesh import partitioning

  cfg = reader.config
  if mesh is None:
    needed = cfg.mesh.num_devices
    report(
      'replicas identical',
      False,
      f'not checked: the saved mesh needs {needed} devices, {jax.device_count()} present',
    )
    cfg, mesh = _one_device_layout(cfg)
  layout = report_shapes(reader, cfg, mesh, report)
  try:
    state, _ = checkpoints.restore(
      reader.root, layout, cfg, step=reader.step, load_optimizer='opt_state' in reader.items
    )
  except (CheckpointError, ValueError) as e:
    report('restorable', False, str(e))
    return
  where = ' '.join(f'{k}={v}' for k, v in mesh.shape.items())
  report('restorable', True, f'restored onto mesh {where} ({jax.device_count()} devices)')
  if mesh.devices.size == cfg.mesh.num_devices and cfg == reader.config:
    drifted = partitioning.replica_mismatches(state)
    report(
      'replicas identical',
      not drifted,
      f'copies differ between devices: {", ".join(drifted)}'
      if drifted
      else f'every replicated tensor is identical on all {mesh.devices.size} devices of the '
      'saved mesh',
    )


def _abstract_at(abstract_state, info: TensorInfo):
  """The abstract array of the layout at a tensor's Orbax name (None if the name is not there)."""
  node = getattr(abstract_state, info.item)
  for part in info.name.split('.'):
    if isinstance(node, dict) and part in node:
      node = node[part]
    elif isinstance(node, (tuple, list)) and part.isdigit() and int(part) < len(node):
      node = node[int(part)]
    elif hasattr(node, part):
      node = getattr(node, part)
    else:
      return None
  return node if hasattr(node, 'shape') else None
