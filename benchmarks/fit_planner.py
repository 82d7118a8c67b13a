"""Fits the cost model's fitted constants (t5x_like/planning/cost_model.py), each on ONE set of
measurements:

* FITTED, the two efficiency constants of a GPU without measured kernel rates (and of
  Megatron-DeepSpeed), on seed 004's 02-25 "Tweaking TP for the first time from the TP=8 is best
  assumption" table (NLAYERS 72, NHIDDEN 14336, NHEADS 64, 48 nodes of 8 A100 80GB on Jean Zay,
  Megatron-DeepSpeed, full activation recomputation, ZeRO-1), its 9 timed rows, estimated as
  Megatron-DeepSpeed ran them;
* MEASURED_HALF_WORK, the fixed cost per layer pass of t5x_like's step on a GPU with measured
  kernel rates, on the one step this project measured on a GPU: BLOOM-1.3B on one H100 with
  pallas attention (H100_STEP; its cudnn and xla rows are held out).

  python benchmarks/fit_planner.py [--json]

FITTED minimises the squared log error of the estimated seconds per iteration over a grid (coarse,
then fine) of peak_fraction (the kernels' share of the bf16 peak at large micro-batches) and
half_work (the FLOPs of one layer's forward for one micro-batch on one GPU at which they reach
half of it). MEASURED_HALF_WORK is the value (to 1 GFLOP) at which the estimate is the measured
time. It prints the constants to paste into cost_model with the fits' residuals. The validation
rows, which the fits do not see, are in tests/test_cost_model.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, 'benchmarks'))

from gpu_suite import REFERENCE_MODEL

from t5x_like.config import Config, load_config_file
from t5x_like.planning import cost_model

# (DP, TP, PP, MBS, GBS, measured GB or None, sec/it), seed 004, 02-25, "Tweaking TP ...";
# NLAYERS 72, NHIDDEN 14336, NHEADS 64. The two OOM rows (DP32 TP2 PP6) have no time.
FIT_TABLE = [
  (8, 4, 12, 4, 2048, 60, 111.89),
  (8, 4, 12, 2, 2048, 44, 110.48),
  (8, 4, 12, 2, 2048, 38, 113.54),
  (16, 4, 6, 4, 2048, 75, 117.11),
  (16, 4, 6, 2, 2048, 57, 111.71),
  (16, 2, 12, 2, 2048, 63, 112.50),
  (8, 2, 24, 1, 2048, 44, 119.53),
  (8, 2, 24, 2, 2048, 53, 122.75),
  (4, 4, 24, 1, 2048, None, 130.60),
]
FIT_SHAPE = (72, 14336, 64)  # NLAYERS, NHIDDEN, NHEADS
GPU = 'a100-80gb'
FRAMEWORK = 'megatron-deepspeed'  # what the chronicles ran

# The GPU suite's BLOOM-1.3B step on one H100 80GB HBM3 SXM (docs/benchmarks.md, "The GPU suite",
# 2026-11-24, jax 0.11.2; benchmarks/step_throughput.py: configs/bloom_1b3.py on a 1 x 1 x 1 mesh,
# global batch 16 = 4 micro-batches of 4 x 2048 tokens, save_dots, chunked cross-entropy, bf16
# over fp32 master weights; median of 10 steps): (attention_impl, seconds per step, XLA's peak
# GiB, which the allocator's high-water mark matched). That code's save_dots did not keep the
# attention kernels' output and log-sum-exp (every backward ran the forward kernel again), so its
# rows are estimated with H100_STEP_RESIDUALS_KEPT, and their memory with the zero count's fill
# that code held (zero_count_fill_gib).
H100_STEP = [('pallas', 0.951, 46.14), ('cudnn', 0.997, 46.85), ('xla', 1.528, 49.07)]
H100_STEP_RESIDUALS_KEPT = False
# Nor did it add each micro-batch's gradients into the accumulator in place (since 2026-11-28,
# cost_model.adds_gradients_in_place): the layers' gradient came out stacked in bf16, and the
# lookup's fp32 table gradient was zero-filled each micro-batch.
H100_STEP_GRADIENTS_IN_PLACE = False
H100_FIT_IMPL = 'pallas'  # the fit's row; 'auto' runs it on Hopper


def h100_step_config(impl: str) -> Config:
  """The suite's step as the H100 measured it: benchmarks/step_throughput.py's overrides of
  configs/bloom_1b3.py, with the suite's REFERENCE_MODEL (the config's model until 2026-11-28,
  which every H100 measurement ran; the config now sets the fused loss and unrolled layers)."""
  return load_config_file(
    os.path.join(REPO, 'configs', 'bloom_1b3.py'),
    {
      'mesh.data': 1,
      'mesh.pipeline': 1,
      'mesh.tensor': 1,
      'train.global_batch_size': 16,
      'model.attention_impl': impl,
      **REFERENCE_MODEL,
    },
  ).validate()


def zero_count_fill_gib(cfg: Config) -> float:
  """GiB of the fp32 zeros of the state's shape that every peak the H100 measured until
  2026-11-28 held and this code does not: the step's count of zero gradients (`g == 0`, since
  training/step.py's count_zeros) needed them, and XLA kept them live through the micro-batch
  loop. XLA's GPU compiles of that code were within 0.14% of the measured peaks (the dense loss
  aside) and of this code hold exactly this less (docs/benchmarks.md)."""
  stage, embedding = cost_model.local_params(cfg)
  return 4 * (stage + embedding) / 2**30


def fit_measured_half_work(impl: str = H100_FIT_IMPL) -> float:
  """MEASURED_HALF_WORK: the FLOPs (to 1e9) at which the H100 estimate of the suite's step with
  `impl` attention is the measured time (the estimate grows with it: bisection)."""
  cfg = h100_step_config(impl)
  measured = dict((name, sec) for name, sec, _ in H100_STEP)[impl]

  def error(half: float) -> float:
    step = cost_model.estimate(
      cfg,
      'h100-80gb',
      measured_half_work=half,
      residuals_kept=H100_STEP_RESIDUALS_KEPT,
      gradients_in_place=H100_STEP_GRADIENTS_IN_PLACE,
    )['estimated_step_s']
    return step - measured

  low, high = 0.0, 1e13
  if error(low) > 0:
    return 0.0
  for _ in range(60):
    middle = (low + high) / 2
    low, high = (middle, high) if error(middle) < 0 else (low, middle)
  return float(round((low + high) / 2, -9))


def chronicles_config(
  layers: int, hidden: int, heads: int, dp: int, tp: int, pp: int, mbs: int, gbs: int
) -> Config:
  """A chronicles row as t5x_like runs it: configs/bloom_176b.py (BLOOM's vocabulary, seq 2048,
  bf16, full recomputation, 1F1B) at the row's shape and topology, without the ramp-up, with
  pipeline.grad_sync='tick', as `plan` compiled these rows (docs/benchmarks.md)."""
  return load_config_file(
    os.path.join(REPO, 'configs', 'bloom_176b.py'),
    {
      'pipeline.grad_sync': 'tick',
      'model.num_layers': layers,
      'model.hidden_size': hidden,
      'model.num_heads': heads,
      'mesh.data': dp,
      'mesh.tensor': tp,
      'mesh.pipeline': pp,
      'train.micro_batch_size': mbs,
      'train.global_batch_size': gbs,
      'train.rampup_batch_size': (),
    },
  )


def fit_configs() -> list[tuple[Config, float]]:
  return [
    (chronicles_config(*FIT_SHAPE, dp, tp, pp, mbs, gbs), sec)
    for dp, tp, pp, mbs, gbs, _, sec in FIT_TABLE
  ]


def loss(rows: list[tuple[Config, float]], fitted: cost_model.Fitted) -> float:
  return sum(
    math.log(cost_model.estimate(cfg, GPU, fitted, framework=FRAMEWORK)['estimated_step_s'] / sec)
    ** 2
    for cfg, sec in rows
  )


def fit(rows: list[tuple[Config, float]]) -> cost_model.Fitted:
  """The grid's best (peak_fraction, half_work): a coarse grid, then a fine one around it."""
  best = None
  fractions = [0.30 + 0.02 * i for i in range(36)]  # 0.30 .. 1.00
  halves = [2e10 * i for i in range(51)]  # 0 .. 1 TFLOP
  for _ in range(2):
    for fraction in fractions:
      for half in halves:
        candidate = cost_model.Fitted(round(fraction, 4), float(half))
        value = loss(rows, candidate)
        if best is None or value < best[0]:
          best = (value, candidate)
    assert best is not None
    f0, h0 = best[1].peak_fraction, best[1].half_work
    fractions = [f0 + 0.001 * i for i in range(-20, 21) if 0 < f0 + 0.001 * i <= 1]
    halves = [h0 + 1e9 * i for i in range(-20, 21) if h0 + 1e9 * i >= 0]
  assert best is not None
  return best[1]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--json', action='store_true')
  args = parser.parse_args(argv)
  rows = fit_configs()
  fitted = fit(rows)
  residuals = []
  for (cfg, sec), row in zip(rows, FIT_TABLE):
    estimated = cost_model.estimate(cfg, GPU, fitted, framework=FRAMEWORK)['estimated_step_s']
    residuals.append(
      {
        'row': row,
        'measured_s': sec,
        'estimated_s': round(estimated, 2),
        'error': round(estimated / sec - 1, 4),
      }
    )
  rms = math.sqrt(loss(rows, fitted) / len(rows))
  half = fit_measured_half_work()
  h100 = []
  for impl, sec, gib in H100_STEP:
    r = cost_model.estimate(
      h100_step_config(impl),
      'h100-80gb',
      measured_half_work=half,
      residuals_kept=H100_STEP_RESIDUALS_KEPT,
      gradients_in_place=H100_STEP_GRADIENTS_IN_PLACE,
    )
    estimated_gib = r['estimated_memory_gib'] + zero_count_fill_gib(h100_step_config(impl))
    h100.append(
      {
        'attention_impl': impl,
        'fitted_on': impl == H100_FIT_IMPL,
        'measured_s': sec,
        'estimated_s': round(r['estimated_step_s'], 4),
        'error': round(r['estimated_step_s'] / sec - 1, 4),
        'measured_gib': gib,
        'estimated_gib': round(estimated_gib, 2),
        'memory_error': round(estimated_gib / gib - 1, 4),
      }
    )
  if args.json:
    print(
      json.dumps(
        {
          'fitted': vars(fitted),
          'rms_log_error': rms,
          'rows': residuals,
          'measured_half_work': half,
          'h100_step': h100,
        }
      )
    )
    return
  print(
    f'FITTED = Fitted(peak_fraction={fitted.peak_fraction}, '
    f'half_work={fitted.half_work:.4g})  # rms log error {rms:.4f}'
  )
  for r in residuals:
    dp, tp, pp, mbs, gbs, _, _ = r['row']
    print(
      f'DP{dp:<3} TP{tp} PP{pp:<3} MBS{mbs} GBS{gbs}: measured {r["measured_s"]:7.2f} s, '
      f'estimated {r["estimated_s"]:7.2f} s ({100 * r["error"]:+.1f}%)'
    )

  print(
    f'MEASURED_HALF_WORK = {half:.4g}  # {half / 671e12 * 1e3:.3f} ms per layer pass at the '
    'H100 probe'
  )
  for r in h100:
    print(
      f'H100 BLOOM-1.3B {r["attention_impl"]:<6} ({"fit" if r["fitted_on"] else "held out"}): '
      f'measured {1e3 * r["measured_s"]:.0f} ms, estimated {1e3 * r["estimated_s"]:.0f} ms '
      f'({100 * r["error"]:+.1f}%); {r["measured_gib"]:.2f} GiB measured, '
      f'{r["estimated_gib"]:.2f} estimated ({100 * r["memory_error"]:+.1f}%)'
    )


if __name__ == '__main__':
  main()
