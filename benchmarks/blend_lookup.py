"""What the quota blend order (`t5x_like/data/blending.py`) costs: building its boundary table,
and looking up samples.

    python benchmarks/blend_lookup.py [--samples 220000000] [--lookups 50]

For tr11's 28 weights (configs/bloom_176b.py) and 50 Dirichlet(0.3) weights it times, on one
CPU core: the datasets of the first 10^6 samples from a fresh blend (and the divisor order's
time for the same), the boundary table up to --samples (tr11 trained 220M samples), random
single lookups after it, and one 2048-sample batch (tr11's global batch) at sample 150M.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from t5x_like.config import load_config_file
from t5x_like.data import sources
from t5x_like.data.blending import CHUNK, Blend, DivisorBlend


def tr11_weights() -> list[float]:
  cfg = load_config_file(os.path.join(os.path.dirname(__file__), '..', 'configs', 'bloom_176b.py'))
  [(_, entries)] = sources.weighted_split_groups(cfg.data, 'train')
  return [entry.weight for entry in entries]


def seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--samples', type=int, default=220_000_000)
  parser.add_argument('--lookups', type=int, default=50)
  args = parser.parse_args()
  weight_sets = {
    "tr11's 28": tr11_weights(),
    '50 Dirichlet(0.3)': np.random.default_rng(1).dirichlet(np.full(50, 0.3)),
  }
  for name, weights in weight_sets.items():
    first = seconds(lambda: Blend(weights).assign(0, 1_000_000))
    divisor = seconds(lambda: DivisorBlend(weights).assign(0, 1_000_000))
    blend = Blend(weights)
    build = seconds(lambda: blend.boundary(args.samples // CHUNK))
    table_mb = (args.samples // CHUNK + 1) * len(weights) * 8 / 1e6
    picks = np.random.default_rng(0).integers(0, args.samples - 1, args.lookups)
    single = seconds(lambda: [blend.assign(int(i), int(i) + 1) for i in picks]) / len(picks)
    batch = seconds(lambda: blend.assign(150_000_000, 150_002_048))
    print(
      f'{name}: first 10^6 samples {first:.2f} s (divisor order {divisor:.2f} s); table to '
      f'{args.samples:,} samples {build:.1f} s, {table_mb:.1f} MB; a random single lookup '
      f'{single * 1e3:.1f} ms; a 2048-sample batch at 150M {batch * 1e3:.1f} ms'
    )


if __name__ == '__main__':
  main()
