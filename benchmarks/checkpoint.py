"""Checkpoint save and restore throughput against the disk's own sequential speed, same run.

    python benchmarks/checkpoint.py [--dir DIR] [--layers 12] [--hidden 768] [--repeats 3]
                                    [--json OUT]

The state is a `TrainState` of a BLOOM (fp32 params, both Adam moments and the step count; the
defaults give 91.3M params, a 1.10 GB state) on the save mesh, filled with random values as after
some training (zero Adam moments would compress to nothing). Measured:

* disk: a file of the state's size written sequentially in 64 MB blocks and fsynced, then read
  back cold (its pages dropped from the page cache with posix_fadvise(DONTNEED) first);
* save: `Checkpointer.save` + `wait()` (Orbax, asynchronous, TensorStore fsyncs every file), on the
  data=8 mesh the state lives on; also the blocking part (until `save` returns and training could
  go on);
* restore, cold (every checkpoint file dropped from the page cache first), straight into the
  shardings of the target mesh: the same mesh (data=8), and two others (data=2 x tensor=4, and one
  device).

Throughput is state bytes / seconds (GB = 1e9 bytes). Each timing is the median of --repeats.
On a CPU-only machine the meshes run on virtual CPU devices, so "device" memory is host memory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
BLOCK = 64 << 20
SAVE_MESH = (8, 1, 1)
RESTORE_MESHES = {
  'same mesh (data=8)': (8, 1, 1),
  'resharded (data=2 x tensor=4)': (2, 1, 4),
  'resharded (one device)': (1, 1, 1),
}


def drop_from_page_cache(path: str) -> None:
  """Evicts a file's (clean) pages, so the next read comes from the disk."""
  paths = (
    [path]
    if os.path.isfile(path)
    else [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]
  )
  for p in paths:
    fd = os.open(p, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def disk_speed(directory: str, nbytes: int) -> tuple[float, float]:
  """(sequential write GB/s incl. fsync, cold sequential read GB/s) for a file of nbytes."""
  import numpy as np

  path = os.path.join(directory, 'disk_probe.bin')
  block = np.random.default_rng(0).integers(0, 255, BLOCK, np.uint8).tobytes()
  start = time.perf_counter()
  with open(path, 'wb', buffering=0) as f:
    written = 0
    while written < nbytes:
      written += f.write(block[: min(BLOCK, nbytes - written)])
    os.fsync(f.fileno())
  write_s = time.perf_counter() - start
  drop_from_page_cache(path)
  start = time.perf_counter()
  with open(path, 'rb', buffering=0) as f:
    while f.read(BLOCK):
      pass
  read_s = time.perf_counter() - start
  os.remove(path)
  return nbytes / write_s / 1e9, nbytes / read_s / 1e9


def trained_looking_state(layout):
  """Random params and Adam moments: an initial state's zero moments would compress to nothing
  and flatter every number."""
  import jax
  import jax.numpy as jnp

  def fill(rng):
    leaves, tree = jax.tree.flatten(layout.abstract)
    keys = jax.random.split(rng, len(leaves))
    return jax.tree.unflatten(
      tree,
      [
        jnp.full(a.shape, 1000, a.dtype)
        if jnp.issubdtype(a.dtype, jnp.integer)
        else 0.02 * jax.random.normal(k, a.shape, a.dtype)
        for k, a in zip(keys, leaves)
      ],
    )

  return jax.jit(fill, out_shardings=layout.shardings)(jax.random.PRNGKey(0))


def bench_config(layers: int, hidden: int):
  from t5x_like.config import Config

  return Config.from_dict(
    {
      'model': dict(
        num_layers=layers,
        hidden_size=hidden,
        num_heads=hidden // 64,
        vocab_size=8192,
        init_std=0.02,
      ),
      'train': dict(steps=1, global_batch_size=8, micro_batch_size=1, seq_len=128),
    }
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument('--dir', default=None, help='where to write (default: a temporary dir)')
  parser.add_argument('--layers', type=int, default=12)
  parser.add_argument('--hidden', type=int, default=768)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--json', default=None)
  args = parser.parse_args(argv)

  from t5x_like.mesh import partitioning

  partitioning.ensure_devices(8)  # before anything starts the JAX backend
  import jax

  from t5x_like.checkpointing import checkpoints
  from t5x_like.parallel.train_state import Progress, make_layout

  base = bench_config(args.layers, args.hidden)
  work = tempfile.mkdtemp(prefix='ckpt_bench_', dir=args.dir)
  try:
    save_cfg = base.replace(mesh=dict(zip(('data', 'pipeline', 'tensor'), SAVE_MESH))).validate()
    layout = make_layout(save_cfg, partitioning.make_mesh(*SAVE_MESH))
    state = jax.block_until_ready(trained_looking_state(layout))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    params = sum(x.size for x in jax.tree.leaves(state.params))
    write_gbs, read_gbs = disk_speed(work, nbytes)

    save_s, blocking_s, save_cpu_s = [], [], []
    for repeat in range(args.repeats):
      root = os.path.join(work, f'save{repeat}')
      checkpointer = checkpoints.Checkpointer(root, 1, 1, layout)
      progress = Progress(iteration=1)
      meta = checkpoints.make_meta(save_cfg, progress, 0, {'iteration': 0, 'skipped_iterations': 0})
      start, cpu = time.perf_counter(), time.process_time()
      checkpointer.save(state, progress, save_cfg, meta)
      blocking_s.append(time.perf_counter() - start)
      checkpointer.wait()
      save_s.append(time.perf_counter() - start)
      save_cpu_s.append(time.process_time() - cpu)
      checkpointer.close()
    root = os.path.join(work, 'save0')
    on_disk = sum(
      os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files
    )
    for repeat in range(1, args.repeats):
      shutil.rmtree(os.path.join(work, f'save{repeat}'))
    del state

    restore_s, restore_cpu_s = {}, {}
    for name, mesh in RESTORE_MESHES.items():
      cfg = base.replace(mesh=dict(zip(('data', 'pipeline', 'tensor'), mesh))).validate()
      target = make_layout(cfg, partitioning.make_mesh(*mesh))
      times, cpu_times = [], []
      for _ in range(args.repeats):
        drop_from_page_cache(root)
        start, cpu = time.perf_counter(), time.process_time()
        restored, _ = checkpoints.restore(root, target, cfg)
        jax.block_until_ready(restored)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu)
        del restored
      restore_s[name] = statistics.median(times)
      restore_cpu_s[name] = statistics.median(cpu_times)
  finally:
    shutil.rmtree(work, ignore_errors=True)

  result = {
    'date': time.strftime('%Y-%m-%d'),
    'machine': f'{platform.machine()}, {os.cpu_count()} CPUs, {jax.devices()[0].platform} '
    f'x {jax.device_count()} (virtual)'
    if jax.devices()[0].platform == 'cpu'
    else f'{jax.devices()[0].device_kind} x {jax.device_count()}',
    'load_average_1min': os.getloadavg()[0],
    'params': params,
    'state_bytes': nbytes,
    'checkpoint_disk_bytes': on_disk,
    'disk_write_gbs': write_gbs,
    'disk_read_gbs': read_gbs,
    'save_s': statistics.median(save_s),
    'save_blocking_s': statistics.median(blocking_s),
    'save_gbs': nbytes / statistics.median(save_s) / 1e9,
    'save_cpu_s': statistics.median(save_cpu_s),
    'restore_s': restore_s,
    'restore_cpu_s': restore_cpu_s,
    'restore_gbs': {k: nbytes / v / 1e9 for k, v in restore_s.items()},
  }
  print(format_markdown(result))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(result, f, indent=2)
  return 0


def format_markdown(r: dict) -> str:
  lines = [
    f'{r["date"]}, {r["machine"]}, 1-min load average {r["load_average_1min"]:.1f}; state '
    f'{r["params"] / 1e6:.1f}M params = {r["state_bytes"] / 1e9:.2f} GB (fp32 params + Adam), '
    f'{r["checkpoint_disk_bytes"] / 1e9:.2f} GB on disk (Orbax compresses with zstd).',
    '',
    '| operation | seconds | GB/s | vs disk | CPU seconds (all threads) |',
    '|---|---:|---:|---:|---:|',
    f'| disk: sequential write + fsync | {r["state_bytes"] / r["disk_write_gbs"] / 1e9:.2f} | '
    f'{r["disk_write_gbs"]:.2f} | 1.00 | |',
    f'| disk: sequential read, cold | {r["state_bytes"] / r["disk_read_gbs"] / 1e9:.2f} | '
    f'{r["disk_read_gbs"]:.2f} | 1.00 | |',
    f'| save (blocking part: {r["save_blocking_s"]:.2f} s) | {r["save_s"]:.2f} | '
    f'{r["save_gbs"]:.2f} | {r["save_gbs"] / r["disk_write_gbs"]:.2f} of write | '
    f'{r["save_cpu_s"]:.1f} |',
  ]
  for name, seconds in r['restore_s'].items():
    gbs = r['restore_gbs'][name]
    lines.append(
      f'| restore, cold, {name} | {seconds:.2f} | {gbs:.2f} | '
      f'{gbs / r["disk_read_gbs"]:.2f} of read | {r["restore_cpu_s"][name]:.1f} |'
    )
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
