"""The topology planner's cost model (t5x_like/planning/cost_model.py) and `plan
--estimate/--search`.

The chronicles' rows below are seed 004's (the chronicles prequel: Megatron-DeepSpeed on 48 nodes
of 8 A100 80GB, Jean Zay, full activation recomputation, ZeRO-1), typed in with their dates and
section titles, and estimated as Megatron-DeepSpeed ran them (`framework='megatron-deepspeed'`).
The two constants were fitted on the TP 2 and 4 rows of the 02-25 table (its "Tweaking TP" half,
benchmarks/fit_planner.py); the held-out tables are the others. The H100's kernel rates and its
one fitted constant come from the one step measured on a GPU (H100_BLOOM_1B3). Figures:
docs/planner.md, "Validation", and docs/benchmarks.md.
"""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from conftest import REPO, run_cli

from t5x_like.cli import plan
from t5x_like.config import ConfigError, load_config_file
from t5x_like.parallel import pipeline
from t5x_like.planning import cost_model
from t5x_like.training import accounting, schedule

sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
import fit_planner  # noqa: E402  (scripts, not package modules)
import gpu_suite  # noqa: E402

MEGATRON = 'megatron-deepspeed'
OOM = 'OOM'  # the chronicles' memory column when the row did not run

# Seed 004's 02-25 table at NLAYERS 72, NHIDDEN 14336, NHEADS 64: "some more configs with lower
# PP" (TP 8, GBS 2016) and "Tweaking TP for the first time" (TP 2 and 4, GBS 2048): 17 rows, 14
# timed, 3 OOM. (DP, TP, PP, MBS, GBS, GB or None or OOM, sec/it, TFLOPs.)
TABLE_0225 = [
  (6, 8, 8, 4, 2016, 52, 113.16, 140.24),
  (12, 8, 4, 2, 2016, 53, 125.52, 126.43),
  (12, 8, 4, 4, 2016, 59, 114.81, 138.22),
  (24, 8, 2, 1, 2016, 65, 145.45, 109.11),
  (24, 8, 2, 2, 2016, 76, 136.13, 116.58),
  (48, 8, 1, 1, 2016, OOM, None, None),
  (8, 4, 12, 4, 2048, 60, 111.89, 144.08),
  (8, 4, 12, 2, 2048, 44, 110.48, 145.92),
  (8, 4, 12, 2, 2048, 38, 113.54, 141.99),
  (16, 4, 6, 4, 2048, 75, 117.11, 137.66),
  (16, 4, 6, 2, 2048, 57, 111.71, 144.31),
  (16, 2, 12, 2, 2048, 63, 112.50, 143.30),
  (32, 2, 6, 2, 2048, OOM, None, None),
  (32, 2, 6, 1, 2048, OOM, None, None),
  (8, 2, 24, 1, 2048, 44, 119.53, 134.88),
  (8, 2, 24, 2, 2048, 53, 122.75, 131.33),
  (4, 4, 24, 1, 2048, None, 130.60, 123.44),
]
SHAPE_0225 = (72, 14336, 64)  # NLAYERS, NHIDDEN, NHEADS

# The held-out tables: {(date, section): ((NLAYERS, NHIDDEN, NHEADS), rows as TABLE_0225's)}.
VALIDATION = {
  ('02-21', '48 node contenders, NHIDDEN=14336 / NLAYERS=72'): (
    (72, 14336, 64),
    [
      (4, 8, 12, 1, 2048, 29, 143.31, 112.49),
      (4, 8, 12, 2, 2048, 37, 134.02, 120.29),
      (4, 8, 12, 4, 2048, 49, 123.69, 130.34),
      (4, 8, 12, 8, 2048, 69, 129.26, 124.72),
      (8, 8, 6, 1, 2048, 38, 139.82, 115.31),
      (8, 8, 6, 2, 2048, 44, 131.02, 123.05),
      (8, 8, 6, 4, 2048, 56, 121.48, 132.71),
    ],
  ),
  ('02-21', 'compare again with another setup, NHIDDEN=13824 / NLAYERS=84'): (
    (84, 13824, 64),
    [
      (4, 8, 12, 2, 2048, 39, 143.89, 121.45),
      (4, 8, 12, 4, 2048, 52, 133.12, 131.27),
      (8, 8, 6, 2, 2048, 65, 141.41, 123.58),
      (8, 8, 6, 4, 2048, 56, 130.31, 134.11),
    ],
  ),
  ('02-25', 'GBS Variations, NLAYERS=72 NHIDDEN=14336 NHEADS=64'): (
    (72, 14336, 64),
    [
      (8, 8, 6, 4, 1568, 56, 113.01, 109.22),
      (8, 8, 6, 4, 2048, 55, 114.11, 141.27),
      (8, 8, 6, 6, 2016, 66, 123.57, 128.43),
      (4, 8, 12, 4, 1568, None, 92.75, 133.08),
      (4, 8, 12, 4, 2048, 49, 117.07, 137.70),
      (4, 8, 12, 2, 1568, None, 99.93, 123.51),
      (4, 8, 12, 2, 2048, None, 128.82, 125.15),
    ],
  ),
  ('02-26', 'Batchsize Warmup, NHIDDEN=13824 / NLAYERS=78'): (
    (78, 13824, 96),
    [
      (8, 4, 12, 2, 512, None, 35.77, 113.52),
      (8, 4, 12, 2, 1024, None, 59.65, 136.15),
      (8, 4, 12, 2, 1536, None, 83.11, 146.59),
      (8, 4, 12, 2, 2048, None, 107.12, 151.64),
    ],
  ),
}
# The floor of each table's Spearman correlation of estimated against measured TFLOP/s. The 02-25
# table: the goal, 0.6 (it was +0.279 with the data-sheet link speeds and the head split over
# the stages, and is +0.684). The held-out tables: no worse than before this model, when they were
# +0.893, +0.800, +0.464 and +1.000 (they are +0.964, +1.000, +0.536, +1.000).
MIN_TFLOPS_SPEARMAN = {
  '02-25 whole table': 0.6,
  '02-21 48 node contenders, NHIDDEN=14336 / NLAYERS=72': 0.89,
  '02-21 compare again with another setup, NHIDDEN=13824 / NLAYERS=84': 0.8,
  '02-25 GBS Variations, NLAYERS=72 NHIDDEN=14336 NHEADS=64': 0.46,
  '02-26 Batchsize Warmup, NHIDDEN=13824 / NLAYERS=78': 0.99,
}
# Seconds per iteration within each held-out table: a Spearman correlation over n rows has a
# p-value below 0.05 (one-sided) from about 0.8 at n=5 and 0.64 at n=7; 0.7 asks each table for
# ranks clearly better than chance while leaving room for the 1-3% run-to-run noise of the
# chronicles' single-iteration timings.
MIN_SPEARMAN = 0.7
# Seed 004's first NHEADS comparison (02-23/24, NHIDDEN 14336, NLAYERS 72, DP8 TP8 PP6 MBS4):
# (NHEADS, sec/it). Only the attention scores' traffic tells the head counts apart.
HEADS_0223 = [(16, 121.03), (32, 124.01), (64, 120.18), (112, 138.72), (128, 124.89), (256, 132.85)]
# XLA's GPU peak per device for the same configs, the 02-25 rows as bloom_176b.py overrides, GiB:
# (row, under pipeline.grad_sync 'tick', under 'step'), each compiled for 384 A100s of 80 GB by
# `plan --gpu a100-80gb` (XLA's GPU compiler without a GPU, jax 0.10.2; docs/benchmarks.md,
# `python benchmarks/plan_topologies.py --grad_sync tick|step --gpu a100-80gb`; every pipelined
# compile in this file again on 2026-11-28, after each layer's backward added its gradient into
# the accumulator in place).
PLAN_PEAK_GIB = [
  ((8, 4, 12, 2, 2048), 21.54, 37.00),
  ((8, 8, 6, 4, 2048), 21.40, 34.58),
  ((4, 8, 12, 4, 2048), 17.38, 23.73),
  ((16, 4, 6, 2, 2048), 28.92, 57.91),
  ((8, 2, 24, 1, 2048), 26.42, 45.68),
  ((16, 2, 12, 2, 2048), 34.42, 67.19),
  ((12, 8, 4, 4, 2016), 24.92, 43.88),
  ((24, 8, 2, 2, 2016), 34.40, 74.55),
]
# tr11's GPU compile, the same way: (at MBS 2 with its ramp-up, at MBS 4) by grad_sync.
GPU_TR11_PEAK_GIB = {'tick': (22.58, 27.84), 'step': (37.76, 42.68)}
# tr8_104b (one layer per stage, one data rank) compiled the same way.
GPU_TR8_104B_PEAK_GIB = 19.46


def spearman(xs, ys) -> float:
  """Spearman's rank correlation: Pearson's correlation of the ranks, ties sharing their mean
  rank (as scipy.stats.spearmanr)."""

  def ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
      j = i
      while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
        j += 1
      for k in range(i, j + 1):
        out[order[k]] = (i + j) / 2 + 1
      i = j + 1
    return out

  rx, ry = ranks(xs), ranks(ys)
  mx, my = statistics.fmean(rx), statistics.fmean(ry)
  cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
  sx = math.sqrt(sum((a - mx) ** 2 for a in rx))
  sy = math.sqrt(sum((b - my) ** 2 for b in ry))
  return cov / (sx * sy) if sx and sy else float('nan')


def _chronicles(shape, row, framework=MEGATRON):
  dp, tp, pp, mbs, gbs = row[:5]
  cfg = fit_planner.chronicles_config(*shape, dp, tp, pp, mbs, gbs)
  return cost_model.estimate(cfg, 'a100-80gb', framework=framework)


def _tables():
  """{name: (shape, rows)}: the whole 02-25 table and the held-out ones."""
  tables = {'02-25 whole table': (SHAPE_0225, TABLE_0225)}
  tables.update({f'{date} {section}': table for (date, section), table in VALIDATION.items()})
  return tables


def test_spearman_ranks_like_the_textbook():
  assert math.isclose(spearman([1, 2, 3, 4], [10, 20, 30, 40]), 1.0)
  assert math.isclose(spearman([1, 2, 3, 4], [4, 3, 2, 1]), -1.0)
  # d = (0, 0, -1, 1): 1 - 6 x 2 / (4 x 15)
  assert math.isclose(spearman([1, 2, 3, 4], [1, 2, 4, 3]), 0.8)
  # Ties take their mean rank: ranks (1.5, 1.5, 3) against (1, 2, 3).
  assert math.isclose(spearman([5, 5, 7], [1, 2, 3]), math.sqrt(3) / 2)
  assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_fitted_constants_are_the_fit_of_the_one_table():
  """The constants are fit_planner's grid fit on the 02-25 table's TP 2 and 4 rows, estimated as
  Megatron-DeepSpeed ran them. t5x_like's step differs on those rows only by the logits its
  chunked cross-entropy recomputes in the backward (no head split over stages, fused softmax,
  A100's all-reduce and ring bus bandwidths equal)."""
  rows = fit_planner.fit_configs()
  assert fit_planner.fit(rows) == cost_model.FITTED
  timed = [r[:7] for r in TABLE_0225 if r[6] is not None and r[1] < 8]
  assert sorted(fit_planner.FIT_TABLE) == sorted(timed) and len(rows) == 9
  held_out = {r[:7] for _, rows in VALIDATION.values() for r in rows}
  assert not set(fit_planner.FIT_TABLE) & held_out
  for cfg, _ in rows:
    # t5x_like summing the data ranks' gradients once a step, as Megatron-DeepSpeed does.
    ours = cost_model.estimate(cfg.replace(pipeline={'grad_sync': 'step'}), 'a100-80gb')
    theirs = cost_model.estimate(cfg, 'a100-80gb', framework=MEGATRON)
    head = 2 * cfg.train.micro_batch_size * 2048 * 14336 * cfg.padded_vocab_size / cfg.mesh.tensor
    extra = ours['recompute_flops_per_gpu'] - theirs['recompute_flops_per_gpu']
    assert math.isclose(extra, cfg.num_microbatches * head), cfg.mesh
    # The recomputed logits in each tick, the bubble's ticks included; nothing else differs.
    tick = (ours['recompute_s'] - theirs['recompute_s']) / cfg.num_microbatches
    bubble_ticks = (cfg.mesh.pipeline - 1) / cfg.pipeline.repeats
    bubble = ours['pipeline_bubble_s'] - theirs['pipeline_bubble_s']
    assert math.isclose(bubble, bubble_ticks * tick), cfg.mesh
    differ = ('recompute_s', 'pipeline_bubble_s', 'recompute_flops_per_gpu', 'estimated_step_s')
    for key in cost_model.TIME_PARTS:
      assert key in differ or math.isclose(ours[key], theirs[key]), (cfg.mesh, key)


def test_rank_correlation_with_the_chronicles_tables():
  """Each table's Spearman correlation of estimated against measured TFLOP/s over its timed rows
  has its recorded floor (MIN_TFLOPS_SPEARMAN); each held-out table's of seconds per iteration is
  at least MIN_SPEARMAN (the 02-25 table mixes global batches of 2016 and 2048: TFLOP/s compares
  its rows)."""
  figures = {}
  for name, (shape, rows) in _tables().items():
    timed = [row for row in rows if row[6] is not None]
    estimates = [_chronicles(shape, row) for row in timed]
    figures[name] = (
      spearman([e['estimated_tflops_per_gpu'] for e in estimates], [row[7] for row in timed]),
      spearman([e['estimated_step_s'] for e in estimates], [row[6] for row in timed]),
      statistics.median(
        abs(e['estimated_step_s'] / row[6] - 1) for e, row in zip(estimates, timed)
      ),
    )
  for name, (rho_tflops, rho_s, error) in figures.items():
    print(
      f'{name}: Spearman TFLOP/s {rho_tflops:+.3f}, s/it {rho_s:+.3f}, median |error| {error:.1%}'
    )
  assert sum(len(rows) for _, rows in VALIDATION.values()) >= 12 and len(figures) == 5
  assert all(figures[name][0] >= floor for name, floor in MIN_TFLOPS_SPEARMAN.items()), figures
  held_out = [rho_s for name, (_, rho_s, _) in figures.items() if name != '02-25 whole table']
  assert len(held_out) == 4 and min(held_out) >= MIN_SPEARMAN, figures


def test_the_chronicles_out_of_memory_rows_do_not_fit_and_the_timed_ones_do():
  """As Megatron-DeepSpeed ran them (half-precision weights and gradients whole on every rank):
  the 02-25 table's 3 OOM rows exceed the A100's 80 GiB, its 14 timed rows fit."""
  verdicts = {row[:5]: _chronicles(SHAPE_0225, row) for row in TABLE_0225}
  oom = [row[:5] for row in TABLE_0225 if row[5] == OOM]
  assert len(oom) == 3 and not any(verdicts[key]['fits'] for key in oom), verdicts
  assert all(verdicts[row[:5]]['fits'] for row in TABLE_0225 if row[6] is not None), verdicts
  assert 'exceeds the 80.0 GiB Megatron-DeepSpeed may use' in verdicts[oom[0]]['why_not']


def test_memory_error_against_the_chronicles_measured_memory():
  """t5x_like's step holds less than Megatron-DeepSpeed's (XLA's GPU compiles of the 02-25 rows
  under grad_sync='tick', which these rows use: 35-62% below, docs/benchmarks.md): every
  t5x_like estimate is below the measured figure, and not by more than 70% (a dropped category,
  such as the Adam moments or the weight copies, would go below; the most, -67%, is the 02-21
  row that measured 65 GB at MBS 2 against 56 at MBS 4). The Megatron-DeepSpeed estimate of the
  same rows is within -40% and +20% of it (the allocator's cache is not counted; that 02-21 row
  is -36%), with a median within 15%."""
  ours, theirs = [], []
  for shape, rows in _tables().values():
    for row in rows:
      if isinstance(row[5], int):
        measured = row[5] * 1e9
        ours.append(
          _chronicles(shape, row, 't5x_like')['estimated_memory_gib'] * 2**30 / measured - 1
        )
        theirs.append(_chronicles(shape, row)['estimated_memory_gib'] * 2**30 / measured - 1)
  for name, errors in (('t5x_like', ours), ('megatron-deepspeed', theirs)):
    print(
      f'{name} memory vs measured, {len(errors)} rows: median {statistics.median(errors):+.1%}, '
      f'range {min(errors):+.1%} .. {max(errors):+.1%}'
    )
  assert len(ours) >= 20 and all(-0.70 < e < 0 for e in ours), ours
  assert all(-0.4 < e < 0.2 for e in theirs) and abs(statistics.median(theirs)) < 0.15, theirs


def test_head_count_effect_ranks_the_chronicles_head_counts():
  """At a fixed hidden size the FLOPs do not change with the head count; the scores' HBM traffic
  (b x heads/TP x s^2 per layer) does. Seed 004's 02-23/24 head counts rank with a Spearman
  correlation of at least 0.6 (+0.66: 112 heads' 138.7 s stays unexplained); without the traffic
  every estimate would be equal."""
  estimates = [
    _chronicles((72, 14336, heads), (8, 8, 6, 4, 2048))['estimated_step_s']
    for heads, _ in HEADS_0223
  ]
  rho = spearman(estimates, [sec for _, sec in HEADS_0223])
  print(f'02-23/24 NHEADS: Spearman {rho:+.3f}, estimates {[round(e, 1) for e in estimates]}')
  assert rho >= 0.6 and estimates == sorted(estimates)


def test_attention_score_traffic_counts_the_materialised_scores():
  """Per layer and micro-batch: the forward's 13 bytes per score element twice (recomputation)
  and the backward's 19, at HBM bandwidth; none for the kernels that keep scores on chip."""
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  r = cost_model.estimate(cfg, 'a100-80gb')
  scores = 2 * (112 // 4) * 2048 * 2048  # MBS 2 x heads per tensor rank x seq^2
  assert math.isclose(r['attention_score_bytes_per_gpu'], 128 * 6 * scores * (2 * 13 + 19))
  assert math.isclose(r['attention_scores_s'], r['attention_score_bytes_per_gpu'] / 2039e9)
  flash = cost_model.estimate(cfg.replace(model={'attention_impl': 'pallas'}), 'a100-80gb')
  assert flash['attention_scores_s'] == 0 and flash['estimated_step_s'] < r['estimated_step_s']


def test_megatron_unfused_softmax_where_the_chronicles_name_its_constraint():
  """(heads / TP) x MBS not divisible by 4 sends Megatron's softmax to PyTorch's unfused fp32
  path: 33 more bytes per score element forward and 35 backward; t5x_like's own step is not
  affected."""
  fused = fit_planner.chronicles_config(72, 14336, 112, 8, 8, 6, 4, 2048)  # 14 x 4 = 56
  unfused = fused.replace(train={'micro_batch_size': 1})  # 14 x 1 = 14
  assert cost_model.fused_softmax_available(fused)
  assert not cost_model.fused_softmax_available(unfused)
  assert cost_model.score_traffic_bytes(fused, MEGATRON) == (13, 19)
  assert cost_model.score_traffic_bytes(unfused, MEGATRON) == (13 + 33, 19 + 35)
  assert cost_model.score_traffic_bytes(unfused, 't5x_like') == (13, 19)
  # 4 heads per tensor rank at MBS 1: 4 is divisible by 4.
  assert cost_model.fused_softmax_available(unfused.replace(model={'num_heads': 32}))
  slower = [cost_model.estimate(c, 'a100-80gb', framework=MEGATRON) for c in (fused, unfused)]
  # M x MBS is the same, so the score elements are too: only the bytes per element differ.
  assert math.isclose(
    slower[1]['attention_scores_s'] / slower[0]['attention_scores_s'],
    (2 * 46 + 54) / (2 * 13 + 19),
  )


def test_tensor_parallel_collectives_at_measured_bus_bandwidths():
  """Two all-reduces of a micro-batch's hidden states per layer and pass at nccl-tests' busbw for
  the payload: A100's 235 GB/s; on H100 sequence parallelism's all-gathers and reduce-scatters run
  at the ring's 370 GB/s, Megatron's all-reduces at NVLink SHARP's 480."""
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  size = 2 * 2048 * 14336 * 2  # MBS 2, bf16
  ramp = size / (size + cost_model.HALF_BANDWIDTH_BYTES)
  per_layer_pass = 2 * 2 * 3 / 4 * size
  for gpu, framework, bus in (
    ('a100-80gb', 't5x_like', 235e9),
    ('h100-80gb', 't5x_like', 370e9),
    ('h100-80gb', MEGATRON, 480e9),
  ):
    r = cost_model.estimate(cfg, gpu, framework=framework)
    expected = 128 * 6 * 3 * per_layer_pass / (bus * ramp)
    assert math.isclose(r['tensor_parallel_s'], expected), (gpu, framework)
    assert math.isclose(r['tensor_parallel_bytes_per_gpu'], 128 * 6 * 3 * per_layer_pass)


def chronicles_and_tr11_cases(grad_sync: str):
  """(config, XLA's A100 peak GiB) under `grad_sync`: the chronicles' eight topologies, then tr11
  at MBS 2 with its ramp-up and at MBS 4."""
  sync = {'pipeline': {'grad_sync': grad_sync}}
  column = ('tick', 'step').index(grad_sync)
  cases = [
    (fit_planner.chronicles_config(72, 14336, 64, *row).replace(**sync), peaks[column])
    for row, *peaks in PLAN_PEAK_GIB
  ]
  tr11 = load_config_file(
    os.path.join(REPO, 'configs', 'bloom_176b.py'), {'pipeline.grad_sync': grad_sync}
  )
  mbs4 = tr11.replace(train={'micro_batch_size': 4, 'rampup_batch_size': ()})
  return cases + list(zip((tr11, mbs4), GPU_TR11_PEAK_GIB[grad_sync]))


def tr8_104b_case():
  return load_config_file(os.path.join(REPO, 'configs', 'tr8_104b.py')), GPU_TR8_104B_PEAK_GIB


def test_memory_under_grad_sync_tick_is_consistent_with_xlas_gpu_compiles():
  """The data ranks sharing one schedule, the accumulator split over them (grad_sync='tick'):
  within -2% to +3% of XLA's GPU compiles of the chronicles' eight topologies and tr11 (at MBS 2
  and 4), and tr8_104b (one layer per stage, one data rank: the stage's whole accumulator, as
  under 'step') within -5%. Each term is a buffer of those compiles' peaks: the saved matmul
  outputs of every layer of the stage, the accumulator once (each layer's backward adds into it
  in place; until 2026-11-28 XLA held the layers' twice and a tick's gradient of the stage
  beside it), no fp32 gather of the embedding, and where the vocabulary per tensor rank is large
  (tensor 2) the head's whole gradient of the token table, the peak there."""
  for cfg, xla in [*chronicles_and_tr11_cases('tick'), tr8_104b_case()]:
    estimated = cost_model.estimate(cfg, 'a100-80gb')['estimated_memory_gib']
    low = -0.05 if cfg.mesh.data == 1 else -0.02
    assert low < estimated / xla - 1 < 0.03, (cfg.mesh, estimated, xla)


def test_memory_under_grad_sync_step_is_consistent_with_xlas_gpu_compiles():
  """Each data rank holding its stage's whole fp32 gradient (grad_sync='step', what
  bloom_176b.py ships): within -2% to +3% of XLA's GPU compiles of tr11 (at MBS 2 with the
  ramp-up and at MBS 4) and the chronicles' eight topologies. Counted as those peaks hold them:
  the accumulator and nothing of the stage's size beside it (each layer's backward adds its
  gradient in place; until 2026-11-28 a tick's gradient of the stage in bf16 was there too), a
  layer's MLP gradients in bf16 and fp32 where they outweigh its activations (tensor 2), the
  saved matmul outputs of every layer of the stage (the projections' split over tensor by
  sequence parallelism), and no whole-table gradient of the embedding (1F1B scatters each
  tick's rows into its accumulator)."""
  assert load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py')).grad_sync == 'step'
  for cfg, xla in chronicles_and_tr11_cases('step'):
    estimated = cost_model.estimate(cfg, 'a100-80gb')['estimated_memory_gib']
    assert -0.02 < estimated / xla - 1 < 0.03, (
      cfg.mesh,
      cfg.train.micro_batch_size,
      estimated,
      xla,
    )


# XLA's GPU peak per device (GiB) of pipelines beyond the tables above, compiled the same way
# (`plan --gpu KIND`, jax 0.10.2, 2026-11-28): (bloom_176b.py's overrides, GPU kind, peak).
NO_RAMP = {'train.global_batch_size': 2048, 'train.rampup_batch_size': ()}
SHAPE_13B = {'model.num_layers': 40, 'model.hidden_size': 5120, 'model.num_heads': 40, **NO_RAMP}
SHAPE_70B = {'model.num_layers': 80, 'model.hidden_size': 8192, 'model.num_heads': 64, **NO_RAMP}
ROW_0225 = {'model.num_layers': 72, 'model.num_heads': 64, **NO_RAMP}
ZERO3 = {'mesh.zero_stage': 3, 'pipeline.grad_sync': 'tick'}


def mesh(data: int, pipeline: int, tensor: int, micro_batch: int) -> dict:
  return {
    'mesh.data': data,
    'mesh.pipeline': pipeline,
    'mesh.tensor': tensor,
    'train.micro_batch_size': micro_batch,
  }


GPU_PIPELINE_PEAK_GIB = [
  ({'mesh.zero_group': 4, 'pipeline.grad_sync': 'tick'}, 'a100-80gb', 33.20),
  ({'mesh.zero_group': 4, 'pipeline.grad_sync': 'step'}, 'a100-80gb', 44.19),
  (mesh(16, 3, 8, 1), 'a100-80gb', 52.09),
  ({**mesh(32, 2, 1, 1), **SHAPE_13B}, 'h100-80gb', 47.79),
  ({**mesh(4, 16, 1, 2), **SHAPE_70B}, 'h100-80gb', 48.71),
  ({**mesh(8, 8, 1, 1), **SHAPE_70B}, 'h100-80gb', 66.60),
]


def test_pipeline_memory_under_hybrid_sharding_and_unfitted_topologies_is_xlas():
  """Within -6% to +5% of XLA's GPU compiles: tr11 under hybrid ZeRO-1 (G 4) with both
  grad_syncs (-5.3% under 'tick', where XLA's allocation holds 1.1 GiB more than its live
  buffers), and four topologies the terms were not fitted on: BLOOM-176B at DP 16 PP 3 TP 8
  (65.5 GiB until 2026-11-28, over the 60 GiB JAX takes of an A100; 52.1 since each layer adds
  its gradient in place), 13B at DP 32 PP 2 and 70B at DP 4 PP 16 and DP 8 PP 8 on H100s; each
  fits exactly when its compile does."""
  assert_estimates_within(GPU_PIPELINE_PEAK_GIB, -0.06, 0.05)


def assert_estimates_within(peaks, low: float, high: float):
  """Each (bloom_176b.py overrides, GPU kind, XLA's peak GiB) of `peaks` estimated within
  low..high of the peak, and fitting exactly when the peak fits."""
  for overrides, gpu, xla in peaks:
    cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'), overrides)
    estimated = cost_model.estimate(cfg, gpu)
    assert low < estimated['estimated_memory_gib'] / xla - 1 < high, (overrides, estimated, xla)
    assert estimated['fits'] == (xla < estimated['usable_gib']), (overrides, xla)


# XLA's GPU compiles under ZeRO-3 and 1F1B (grad_sync 'tick'), compiled the same way
# (2026-11-28, after each layer's backward added its gradient into the accumulator in place):
# tr11, DP 8 TP 8 PP 6, BLOOM-176B at DP 16 PP 3 TP 8, 13B and 70B on H100s.
GPU_ZERO3_1F1B_PEAK_GIB = [
  (ZERO3, 'a100-80gb', 15.45),
  ({**ZERO3, **mesh(8, 6, 8, 4), **ROW_0225}, 'a100-80gb', 14.83),
  ({**ZERO3, **mesh(16, 3, 8, 1)}, 'a100-80gb', 10.72),
  ({**ZERO3, **mesh(32, 2, 1, 1), **SHAPE_13B}, 'h100-80gb', 10.16),
  ({**ZERO3, **mesh(4, 16, 1, 2), **SHAPE_70B}, 'h100-80gb', 31.36),
  ({**ZERO3, **mesh(8, 8, 1, 1), **SHAPE_70B}, 'h100-80gb', 25.86),
]


def test_zero3_one_f_one_b_memory_is_xlas():
  """Within -3% to +6% of XLA's GPU compiles under ZeRO-3's 1F1B ticks, each fitting exactly
  when its compile does. The model counts the split bf16 copy, the split accumulator once and
  one layer's MLP weights gathered: the peaks of the three with tensor 1 hold them (their
  recomputed forward's attention is the peak), those with tensor 4 or 8 a smaller gathered
  weight, so the model errs over there (tr11 +4.5%), not under."""
  assert_estimates_within(GPU_ZERO3_1F1B_PEAK_GIB, -0.03, 0.06)


# XLA's H100 peak per device (GiB) of bloom_1b3.py's model in the GPipe order, compiled the same
# way (`plan --gpu h100-80gb`, jax 0.10.2, 2026-11-28; pallas attention, micro-batches of 4, the
# chunked loss): (overrides of configs/bloom_1b3.py, peak). The first is the config as shipped
# until then: data 8 x pipeline 2, 16 micro-batches, save_dots. Every compile of this file ran
# the config's model as it was until 2026-11-28 (gpu_suite.REFERENCE_MODEL: the chunked loss,
# the layers scanned).
MEASURED_1B3 = gpu_suite.REFERENCE_MODEL
GPIPE_1B3 = {
  'mesh.data': 8,
  'mesh.pipeline': 2,
  'model.attention_impl': 'pallas',
  **MEASURED_1B3,
}
GPU_GPIPE_PEAK_GIB = [
  ({**GPIPE_1B3}, 77.51),
  ({**GPIPE_1B3, 'train.global_batch_size': 64}, 25.42),
  ({**GPIPE_1B3, 'train.global_batch_size': 128, 'model.attention_impl': 'xla'}, 33.17),
  ({**GPIPE_1B3, 'pipeline.microbatch_group': 4}, 36.21),
  ({**GPIPE_1B3, 'pipeline.microbatch_group': 4, 'pipeline.grad_sync': 'tick'}, 29.64),
  ({**GPIPE_1B3, 'mesh.data': 4, 'mesh.pipeline': 4, 'train.global_batch_size': 128}, 28.94),
  ({**GPIPE_1B3, 'model.remat_policy': 'full'}, 15.08),
]


def test_gpipe_memory_is_xlas():
  """Within -5% to +3% of XLA's GPU compiles of GPipe schedules, each fitting exactly when its
  compile does. GPipe differentiates its whole schedule, so under save_dots every tick in flight
  (M + P - 1, or G + P - 1 with groups) keeps each layer's saved matmul outputs, and the
  backward copies one tick's out of those stacks; with groups each group's fp32 gradient comes
  beside the step's accumulator; under 'full' the head's conditional returns a whole fp32 table
  gradient. Counted as 1F1B's ticks (the kept stage inputs only) until 2026-11-28: 13.5 GiB for
  the first row's 77.5, -48% to -83% under save_dots."""
  for overrides, xla in GPU_GPIPE_PEAK_GIB:
    cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_1b3.py'), overrides)
    estimated = cost_model.estimate(cfg, 'h100-80gb')
    assert -0.05 < estimated['estimated_memory_gib'] / xla - 1 < 0.03, (overrides, estimated, xla)
    assert estimated['fits'] == (xla < estimated['usable_gib']), (overrides, xla)


# XLA's H100 peak per device (GiB) of bloom_1b3.py's model in the 1F1B order, compiled the same
# way (2026-11-29; the config as shipped since 2026-11-28: the fused loss, the layers unrolled,
# grad_sync 'step'), and the same with the layers scanned: (overrides, peak).
ONE_F_ONE_B_1B3 = {'mesh.data': 8, 'mesh.pipeline': 2, 'pipeline.schedule': '1f1b'}
CHUNKED = {'model.cross_entropy_impl': 'chunked'}
SCANNED = {'model.unroll_layers': False}
GPU_1F1B_1B3_PEAK_GIB = [
  ({**ONE_F_ONE_B_1B3}, 15.10),
  ({**ONE_F_ONE_B_1B3, **CHUNKED}, 15.10),
  ({**ONE_F_ONE_B_1B3, **CHUNKED, 'train.micro_batch_size': 2}, 11.06),
  ({**ONE_F_ONE_B_1B3, **CHUNKED, 'mesh.data': 4, 'mesh.pipeline': 4}, 8.39),
  ({**ONE_F_ONE_B_1B3, **CHUNKED, 'mesh.zero_stage': 3, 'pipeline.grad_sync': 'tick'}, 9.30),
  ({**ONE_F_ONE_B_1B3, **SCANNED}, 12.70),  # 14.60 with the fused loss's chunks side by side
  ({**ONE_F_ONE_B_1B3, **CHUNKED, **SCANNED}, 10.51),
  ({**ONE_F_ONE_B_1B3, **CHUNKED, **SCANNED, 'mesh.data': 4, 'mesh.pipeline': 4}, 6.34),
]


def test_one_f_one_b_with_unrolled_layers_memory_is_xlas():
  """Within -5% to +3% of XLA's GPU compiles of 1F1B schedules with the layers unrolled and
  scanned, each fitting exactly when its compile does. Each backward tick recomputes its
  stage's forward, and with the layers unrolled XLA merges their own recomputation into it
  (cost_model.merges_recomputation): the recomputed stage keeps each layer's GeLU products,
  LayerNorm outputs and (ZeRO-1) weight slices, 4.6 GiB more than scanned under the chunked loss
  (15.10 against 10.51), where the model said 10.05 for both until 2026-11-29. Those are live in
  a layer's backward, the fused loss's tiles in the loss: the peak is the larger, so the fused
  loss's unrolled step holds what the chunked one does. With the layers scanned the fused loss's
  peak is the head's, beside the stage's stacked QKV and h -> 4h outputs only (12.70 GiB; 14.60
  when its two token chunks ran side by side). GPipe's ticks, differentiated as a scan, merge
  nothing (78.43 GiB unrolled against 77.51 scanned; the model: 77.76 for both)."""
  for overrides, xla in GPU_1F1B_1B3_PEAK_GIB:
    cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_1b3.py'), overrides)
    estimated = cost_model.estimate(cfg, 'h100-80gb')
    assert -0.05 < estimated['estimated_memory_gib'] / xla - 1 < 0.03, (overrides, estimated, xla)
    assert estimated['fits'] == (xla < estimated['usable_gib']), (overrides, xla)
  gpipe = {**ONE_F_ONE_B_1B3, **CHUNKED, 'pipeline.schedule': 'gpipe'}
  estimates = [
    cost_model.estimate(
      load_config_file(os.path.join(REPO, 'configs', 'bloom_1b3.py'), o), 'h100-80gb'
    )
    for o in (gpipe, {**gpipe, **SCANNED})
  ]
  assert estimates[0]['estimated_memory_gib'] == estimates[1]['estimated_memory_gib']
  assert abs(estimates[0]['estimated_memory_gib'] / 78.43 - 1) < 0.03


# XLA's H100 peak per device (GiB) under remat_policy='none', compiled the same way: (overrides
# of configs/bloom_1b3.py, peak): one GPU with pallas and with xla attention, data 16 under ZeRO-1
# (grad_sync 'step' as shipped; 39.65 under 'tick') and ZeRO-3, and data 8 x pipeline 2 in both
# orders.
NONE = {'model.remat_policy': 'none', 'model.attention_impl': 'pallas', **MEASURED_1B3}
ONE_GPU = {'mesh.data': 1, 'train.global_batch_size': 16}
GPU_NO_RECOMPUTATION_PEAK_GIB = [
  ({**NONE, **ONE_GPU}, 64.16),
  (
    {
      **NONE,
      **ONE_GPU,
      'train.global_batch_size': 8,
      'train.micro_batch_size': 2,
      'model.attention_impl': 'xla',
    },
    66.09,
  ),
  ({**NONE}, 46.11),
  ({**NONE, 'mesh.zero_stage': 3, 'pipeline.grad_sync': 'tick'}, 11.74),
  ({**NONE, **GPIPE_1B3, 'train.global_batch_size': 64}, 79.56),
  ({**NONE, **GPIPE_1B3, 'pipeline.schedule': '1f1b'}, 24.62),
]


def test_memory_without_recomputation_is_xlas():
  """Within -3% to +3% of XLA's GPU compiles under remat_policy='none': each layer keeps the
  MLP's nine [tokens, ffn] GeLU intermediates, eight hidden-wide tensors and a materialised
  softmax's fp32 scores and bf16 probabilities; GPipe keeps that for every tick in flight with
  the stage's compute-dtype weights, 1F1B for the one tick it recomputes; ZeRO-3 without a
  pipeline keeps what save_dots keeps (its layers gather their weights again). Counted as the
  matmul outputs alone until 2026-11-28 (one GPU: 39.9 GiB for XLA's 65.8; the H100 ran out of
  memory)."""
  for overrides, xla in GPU_NO_RECOMPUTATION_PEAK_GIB:
    cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_1b3.py'), overrides)
    estimated = cost_model.estimate(cfg, 'h100-80gb')['estimated_memory_gib']
    assert -0.03 < estimated / xla - 1 < 0.03, (overrides, estimated, xla)


def test_estimate_adds_up_its_parts():
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  r = cost_model.estimate(cfg, 'a100-80gb')
  parts = cost_model.TIME_PARTS
  assert math.isclose(r['estimated_step_s'], sum(r[p] for p in parts))
  flops = accounting.megatron_flops_per_iteration(cfg, 2048, 2048)
  assert math.isclose(r['estimated_tflops_per_gpu'], flops / r['estimated_step_s'] / 384 / 1e12)
  assert math.isclose(r['bubble_fraction'], pipeline.placement_for(cfg).bubble_fraction(128))
  assert math.isclose(r['estimated_memory_gib'], sum(r['memory_gib_by_category'].values()))
  assert r['fits'] and r['mesh'] == [8, 12, 4] and (r['zero_stage'], r['zero_group']) == (1, 8)
  # ZeRO-1 over all of data: no ZeRO-3 gathers, no copies to all-reduce across.
  assert r['zero3_gather_s'] == r['replica_allreduce_s'] == 0
  # An A100 has no measured kernel rates: its memory-bound kernels are in the fitted curve.
  assert r['memory_bound_s'] == 0 and r['attention_impl'] == 'xla'  # 'auto' with dropout
  zeros = ('zero3_gather_s', 'replica_allreduce_s', 'memory_bound_s')
  assert all(r[p] > 0 for p in parts if p not in zeros)
  # Full recomputation: one more forward of the stage's 6 layer slots per micro-batch (MBS 2),
  # and of the logits (whole on each stage: 4 x 12 does not divide the vocabulary), which the
  # chunked cross-entropy recomputes.
  h, tokens = 14336, 2 * 2048
  forward = 6 * (24 * tokens * h * h + 4 * tokens * 2048 * h) / 4
  head = 2 * tokens * h * 250880 / 4
  assert math.isclose(r['recompute_flops_per_gpu'], 128 * (forward + head))
  assert math.isclose(r['attention_flops_per_gpu'], 128 * 3 * 6 * 4 * tokens * 2048 * h / 4)
  # ZeRO-1 with a pipeline: fp32 gradients reduce-scattered and bf16 weights all-gathered once
  # per step, 7/8 of each.
  stage, embedding = cost_model.local_params(cfg)
  assert math.isclose(r['data_parallel_bytes_per_gpu'], 7 / 8 * (stage + embedding) * 6)
  # Without ZeRO's split over data the state alone is 12 bytes x 4.6e9 params per GPU.
  whole = cost_model.estimate(cfg.replace(mesh={'data': 1}), 'a100-40gb')
  assert (
    not whole['fits'] and 'exceeds the 30.0 GiB JAX may use of one a100-40gb' in whole['why_not']
  )


def test_fits_in_what_jax_may_allocate_not_the_whole_memory(monkeypatch):
  """JAX takes 0.75 of a GPU unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise: tr11 under
  hybrid ZeRO-1 over groups of 4 with grad_sync='tick', ~32 GiB per GPU (XLA's GPU compile:
  33.20), fits a 40 GB A100 only with a larger share."""
  overrides, _, xla = GPU_PIPELINE_PEAK_GIB[0]
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'), overrides)
  assert cfg.mesh.zero_group == 4 and xla > 30.0
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  default = cost_model.estimate(cfg, 'a100-40gb')
  assert 30.0 < default['estimated_memory_gib'] < 36.0
  assert not default['fits'] and default['usable_gib'] == 30.0
  assert 'XLA_PYTHON_CLIENT_MEM_FRACTION raises it' in default['why_not']
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '0.9')
  assert cost_model.estimate(cfg, 'a100-40gb')['fits']
  monkeypatch.setenv('XLA_PYTHON_CLIENT_MEM_FRACTION', '1.5')
  with pytest.raises(ConfigError, match=r'XLA_PYTHON_CLIENT_MEM_FRACTION=1.5 is not in \(0, 1\]'):
    cost_model.estimate(cfg, 'a100-40gb')


def test_search_finds_exactly_the_valid_topologies():
  """Every (data, pipeline, tensor, micro-batch) that the config checks accept, with tensor within
  a node, for 64 GPUs at BLOOM-176B's shape and ramp-up; fitting ones first, by time."""
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  found = cost_model.search(cfg, 64, 'h200')
  expected = set()
  for t in (1, 2, 4, 8):
    for p in range(1, 65):
      for micro in range(1, 17):
        if 64 % (t * p):
          continue
        try:
          candidate = cfg.replace(
            mesh={'data': 64 // (t * p), 'pipeline': p, 'tensor': t},
            train={'micro_batch_size': micro},
          ).validate()
          schedule.check(candidate)
        except ConfigError:
          continue
        expected.add((64 // (t * p), p, t, micro))
  assert {(*r['mesh'], r['micro_batch_size']) for r in found} == expected and expected
  order = [(not r['fits'], r['estimated_step_s']) for r in found]
  assert order == sorted(order)
  assert any(not r['fits'] and 'exceeds' in r['why_not'] for r in found)
  tr11 = cost_model.search(cfg, 384, 'a100-80gb')
  assert any(r['mesh'] == [8, 12, 4] and r['micro_batch_size'] == 2 for r in tr11)


@pytest.mark.parametrize(
  'args, message',
  [
    (['--estimate', '--gpu', 'v100'], 'known kinds: a100-80gb, a100-40gb, h100-80gb, h200'),
    (['--search', '--gpus', '100', '--gpu', 'a100-80gb'], 'not a multiple of 8'),
    (
      ['--estimate', '--gpu', 'a100-80gb', '--config.mesh.tensor=16', '--config.mesh.pipeline=6'],
      'mesh.tensor=16 must divide the 8 GPUs of a node',
    ),
    (['--search', '--gpu', 'h200'], '--search needs --gpus'),
    # 0 once meant the kind's 8 and listed topologies; what is not a count is refused.
    (
      ['--search', '--gpus', '384', '--gpu', 'h200', '--nodes-of', '0'],
      '--nodes-of must be a number of GPUs per node >= 1, got 0',
    ),
    (
      ['--estimate', '--gpu', 'h200', '--nodes-of', '-8'],
      '--nodes-of must be a number of GPUs per node >= 1, got -8',
    ),
    (['--search', '--gpus', '0', '--gpu', 'h200'], '--gpus must be >= 1, got 0'),
    (['--search', '--gpus', '-384', '--gpu', 'h200'], '--gpus must be >= 1, got -384'),
    (['--search', '--gpus', '384', '--gpu', 'h200', '--top', '0'], '--top must be >= 1, got 0'),
    # BLOOM-176B: tensor at most 8 (a node; it divides the 112 heads), data x pipeline at most
    # the ramp-up's first batch of 192 (one sample per micro-batch, no stage without one).
    (
      ['--search', '--gpus', '1544', '--gpu', 'h200'],
      '--gpus 1544 is more than any topology of this model and batch can use: at most 1536',
    ),
  ],
)
def test_cli_bad_input_is_one_message_and_exit_2(args, message, capsys):
  assert plan.main(['--config', os.path.join(REPO, 'configs', 'bloom_176b.py'), *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and message in err and len(err.splitlines()) == 1, err


def test_search_refuses_an_impossible_gpu_count_at_once():
  """10^12 GPUs, even on nodes as large: refused before any enumeration (which was linear in
  the count: no answer after minutes). In a process of its own, so that a search that runs
  fails the test at the timeout instead of hanging the suite. On nodes of 10^12 tensor may be
  16, which divides 112 and 10^12."""
  for nodes_of, limit in (('8', 1536), ('1000000000000', 16 * 192)):
    args = [
      '-m',
      't5x_like.plan',
      '--config',
      'configs/bloom_176b.py',
      '--search',
      '--gpus',
      '1000000000000',
      '--gpu',
      'h200',
      '--nodes-of',
      nodes_of,
    ]
    try:
      r = run_cli(args, timeout=90)
    except subprocess.TimeoutExpired:
      pytest.fail(f'plan {" ".join(args[2:])} was still searching after 90 s')
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith('error: --gpus 1000000000000 is more than any topology'), r.stderr
    assert f'at most {limit} (' in r.stderr and 'Traceback' not in r.stderr
  # The bound is reached: 1536 GPUs run as tensor 8 x data x pipeline 192, one sample per
  # micro-batch.
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  largest = cost_model.search(cfg, 1536, 'h200')
  assert largest and {
    (r['mesh'][2], r['mesh'][0] * r['mesh'][1], r['micro_batch_size']) for r in largest
  } == {(8, 192, 1)}


def test_cli_estimate_and_search_json(capsys):
  bloom = os.path.join(REPO, 'configs', 'bloom_176b.py')
  assert plan.main(['--config', bloom, '--estimate', '--gpu', 'a100-80gb', '--json']) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['mesh'] == [8, 12, 4] and report['fits']
  assert (
    plan.main(
      ['--config', bloom, '--search', '--gpus', '384', '--gpu', 'a100-80gb', '--top', '3', '--json']
    )
    == 0
  )
  ranked = json.loads(capsys.readouterr().out)
  assert [r['estimated_step_s'] for r in ranked] == sorted(r['estimated_step_s'] for r in ranked)
  assert len(ranked) == 3 and all(math.prod(r['mesh']) == 384 for r in ranked)
  # --aot compiles the top K for the GPUs of --gpu (XLA's GPU compiler, no GPU here).
  r = run_cli(
    [
      '-m',
      't5x_like.plan',
      '--config',
      'configs/tiny.py',
      '--search',
      '--gpus',
      '8',
      '--gpu',
      'h100-80gb',
      '--top',
      '1',
      '--aot',
      '--json',
    ]
  )
  assert r.returncode == 0, r.stderr[-3000:]
  [best] = json.loads(r.stdout.strip().splitlines()[-1])
  assert math.prod(best['mesh']) == 8 and best['micro_batch_size'] >= 1
  assert best['aot_peak_gib'] > 0 and best['aot_fits'] and 'estimated_step_s' in best
  # The figure is the GPU compile's: the same config compiled for H100s here says the same.
  data, pipeline, tensor = best['mesh']
  cfg = load_config_file(
    os.path.join(REPO, 'configs', 'tiny.py'),
    {
      'mesh.data': data,
      'mesh.pipeline': pipeline,
      'mesh.tensor': tensor,
      'mesh.zero_stage': best['zero_stage'],
      'mesh.zero_group': 0 if best['zero_group'] == data else best['zero_group'],
      'train.micro_batch_size': best['micro_batch_size'],
    },
  )
  if best['grad_sync']:
    cfg = cfg.replace(pipeline={'grad_sync': best['grad_sync']})
  assert plan.plan(cfg, 'h100-80gb')['peak_gib'] == best['aot_peak_gib']


def test_estimate_and_search_start_no_jax_backend():
  code = (
    'from t5x_like.config import load_config_file\n'
    'from t5x_like.planning import cost_model; from t5x_like.mesh import partitioning\n'
    "cfg = load_config_file('configs/bloom_176b.py')\n"
    "cost_model.estimate(cfg, 'h200')\n"
    "cost_model.search(cfg, 384, 'h200')\n"
    'print(partitioning.backends_started())\n'
  )
  r = run_cli(['-c', code])
  assert r.returncode == 0 and r.stdout.strip() == 'False', r.stderr[-2000:]


def _bloom(
  layers, hidden, heads, data, pipeline=1, tensor=1, micro=1, stage=1, group=0, sync='auto'
):
  """A BLOOM-shaped model (bloom_176b.py's vocabulary, seq 2048, bf16, full recomputation) at
  global batch 2048 on a mesh and ZeRO layout (and pipeline.grad_sync)."""
  return load_config_file(
    os.path.join(REPO, 'configs', 'bloom_176b.py'),
    {
      'model.num_layers': layers,
      'model.hidden_size': hidden,
      'model.num_heads': heads,
      'mesh.data': data,
      'mesh.pipeline': pipeline,
      'mesh.tensor': tensor,
      'mesh.zero_stage': stage,
      'mesh.zero_group': group,
      'pipeline.grad_sync': sync,
      'train.micro_batch_size': micro,
      'train.global_batch_size': 2048,
      'train.rampup_batch_size': (),
    },
  ).validate()


def _ring_s(kind, size, ranks, bus):
  """A ring collective's seconds at `bus` GB/s for a `size`-byte payload."""
  factor = 2 if kind == 'all-reduce' else 1
  ramp = size / (size + cost_model.HALF_BANDWIDTH_BYTES)
  return factor * (ranks - 1) / ranks * size / (bus * 1e9 * ramp)


def test_zero3_memory_holds_a_gathered_layer_instead_of_the_whole_copy():
  """13B on 64 GPUs (data 64), no pipeline: the fp32 master, the moments and the gradients split
  over the group under both stages; ZeRO-1's whole bf16 copy becomes under ZeRO-3 a 1/64 copy
  and one gathered layer, and the embedding gathered for the logits, where the layers' backward
  does not hold it (XLA's GPU compiles hold no second layer and no layer's whole fp32 gradient
  at their peaks: test_memory_without_a_pipeline_is_xlas). Hybrid G = 8 splits the state 8
  ways, not 64."""
  gib = 2**30
  one, three = (
    cost_model.estimate(_bloom(40, 5120, 40, 64, micro=4, stage=s), 'h100-80gb')[
      'memory_gib_by_category'
    ]
    for s in (1, 3)
  )
  stage, embedding = cost_model.local_params(_bloom(40, 5120, 40, 64))
  state, layer = stage + embedding, cost_model.layer_params(_bloom(40, 5120, 40, 64))
  assert one['master weights (fp32 params)'] == three['master weights (fp32 params)']
  assert math.isclose(three['master weights (fp32 params)'] * gib, 4 * state / 64)
  assert math.isclose(one['weight copies'] * gib, 2 * state)
  assert math.isclose(three['weight copies'] * gib, 2 * (state / 64 + layer))
  assert one['gradient accumulators'] == three['gradient accumulators']
  hybrid = cost_model.estimate(_bloom(40, 5120, 40, 64, micro=4, stage=3, group=8), 'h100-80gb')
  assert hybrid['zero_group'] == 8
  assert math.isclose(hybrid['memory_gib_by_category']['Adam moments'] * gib, 8 * state / 8)
  # The saving lets ZeRO-3 run a 70B on 64 H100s without a pipeline; ZeRO-1's bf16 copy alone
  # is 130 GB (XLA's GPU compile of the ZeRO-3 step at global batch 512: 30.52 GiB).
  big = [cost_model.estimate(_bloom(80, 8192, 64, 64, stage=s), 'h100-80gb') for s in (1, 3)]
  assert [r['fits'] for r in big] == [False, True]


def test_zero3_gathers_every_layer_twice_and_scatters_its_gradient_every_micro_batch():
  """Per micro-batch and layer: the bf16 weights all-gathered for the forward and again for the
  recomputing backward, the gradient reduce-scattered (without a pipeline as the backward
  computes it: a layer's in bf16, the embedding's in bf16 from the logits and in fp32 from the
  lookup, as XLA's GPU compile of 13B on 64 H100s does); the embedding gathered likewise. Over
  NVLink (A100: 235 GB/s) when the group is inside a node, else over the node's network (Jean
  Zay: 135 Gb/s), all of it when the node's 8 GPUs are in the group, 1/8 when each is in
  another."""
  cfg = _bloom(40, 5120, 40, 64, micro=4, stage=3)
  layer = cost_model.layer_params(cfg)
  _, embedding = cost_model.local_params(cfg)
  r = cost_model.estimate(cfg, 'a100-80gb')
  micro = 2048 // (64 * 4)
  per_tick = 40 * (2 * 2 * layer + 2 * layer) + (2 * 2 * embedding + (2 + 4) * embedding)
  assert math.isclose(r['zero3_bytes_per_gpu'], micro * 63 / 64 * per_tick)
  assert r['data_parallel_s'] == 0 and r['replica_allreduce_s'] == 0

  def zero3_s(ranks, bus):
    return micro * sum(
      count
      * (
        2 * _ring_s('all-gather', 2 * size, ranks, bus)
        + _ring_s('reduce-scatter', grad_bytes * size, ranks, bus)
      )
      for size, count, grad_bytes in ((layer, 40, 2), (embedding, 1, 2 + 4))
    )

  network = 135 / 8
  assert math.isclose(r['zero3_gather_s'], zero3_s(64, network))  # 8 nodes, 8 ranks in each
  in_node = cost_model.estimate(_bloom(40, 5120, 40, 64, micro=4, stage=3, group=8), 'a100-80gb')
  assert math.isclose(in_node['zero3_gather_s'], zero3_s(8, 235))
  # Tensor 8: each of a node's GPUs is in another data group.
  tp8 = _bloom(40, 5120, 40, 8, tensor=8, micro=4, stage=3)
  t = cost_model.estimate(tp8, 'a100-80gb')
  per = cost_model.layer_params(tp8) / 8
  emb = cost_model.local_params(tp8)[1]
  expected = (2048 // 32) * sum(
    count
    * (
      2 * _ring_s('all-gather', 2 * size, 8, network / 8)
      + _ring_s('reduce-scatter', grad_bytes * size, 8, network / 8)
    )
    for size, count, grad_bytes in ((per, 40, 2), (emb, 1, 2 + 4))
  )
  assert math.isclose(t['zero3_gather_s'], expected)
  # Not overlapped: the bound if it were hidden behind the compute is reported beside.
  assert r['estimated_step_s_if_zero3_overlapped'] < r['estimated_step_s']


@pytest.mark.parametrize('dropout', [0.1, 0.0], ids=['dropout', 'no_dropout'])
def test_hybrid_sharding_all_reduces_the_gradient_shards_across_the_copies(dropout):
  """G = 8 of data 64 (one node's ranks): ZeRO-1's reduce-scatter and all-gather inside the node,
  then each rank's 1/8 fp32 gradient shard all-reduced across the 8 copies over the network
  (one rank of each node in a copy's ring: 1/8 of the node's network): once a step
  (step.per_rank_loss_and_grads), with dropout (bloom_176b's 0.1) or without."""
  cfg = _bloom(40, 5120, 40, 64, micro=4, group=8)
  cfg = cfg.replace(model={'hidden_dropout': dropout, 'attention_dropout': dropout}).validate()
  stage, embedding = cost_model.local_params(cfg)
  state = stage + embedding
  r = cost_model.estimate(cfg, 'a100-80gb')
  micro = 2048 // (64 * 4)
  shard = 4 * state / 8
  assert math.isclose(r['replica_allreduce_bytes_per_gpu'], 2 * 7 / 8 * shard)
  assert math.isclose(r['replica_allreduce_s'], _ring_s('all-reduce', shard, 8, 135 / 8 / 8))
  # Without a pipeline under grad_sync 'tick' each micro-batch's gradient is reduce-scattered
  # into the split accumulator as the backward computes it: the layers' in bf16, the embedding's
  # in bf16 (from the logits) and fp32 (from the lookup); the bf16 weights all-gathered once.
  assert r['grad_sync'] == 'tick'
  reduced = 2 * stage + (2 + 4) * embedding
  assert math.isclose(r['data_parallel_bytes_per_gpu'], 7 / 8 * (micro * reduced + 2 * state))
  assert math.isclose(
    r['data_parallel_s'],
    micro * _ring_s('reduce-scatter', reduced, 8, 235) + _ring_s('all-gather', 2 * state, 8, 235),
  )


@pytest.mark.parametrize('stage, sync', [(1, 'step'), (1, 'tick'), (3, 'tick')])
def test_hybrid_copies_with_a_pipeline_all_reduce_their_shards_once_a_step(stage, sync):
  """With a pipeline each copy runs its own schedule (step.own_gradient_axes) whatever
  grad_sync: 13B as DP16 PP2 TP2 in groups of 2 (8 copies) all-reduces each rank's 1/2 gradient
  shard across the copies once a step, not at each of the schedule's ticks."""
  cfg = _bloom(40, 5120, 40, 16, pipeline=2, tensor=2, micro=4, stage=stage, group=2, sync=sync)
  stage_params, embedding = cost_model.local_params(cfg)
  shard = 4 * (stage_params + embedding) / 2
  r = cost_model.estimate(cfg, 'a100-80gb')
  assert r['grad_sync'] == sync
  assert math.isclose(r['replica_allreduce_bytes_per_gpu'], 2 * 7 / 8 * shard)


def test_search_ranks_zero_stages_and_groups_with_the_mesh_and_says_why_each_loses():
  """13B on 64 H100s: every (data, pipeline, tensor, micro-batch) comes with ZeRO-1 and ZeRO-3,
  over all of data and over one node's data ranks where that differs (zero_choices); all are
  ranked together; each one but the first says what it loses to the first, each that does not
  fit why. The winners docs/planner.md reports: 13B on H100 is ZeRO-3 over all 64 GPUs without
  a pipeline at micro-batch 16, ZeRO-1 at micro-batch 8 next (XLA's GPU compiles: 59.41 and
  58.31 GiB of the 59.7 usable); on H200 ZeRO-1; 70B on H100 is a pipeline."""
  cfg = _bloom(40, 5120, 40, 1)
  found = cost_model.search(cfg, 64, 'h100-80gb')
  by_mesh = {}
  for r in found:
    key = (*r['mesh'], r['micro_batch_size'])
    group = 0 if r['zero_group'] == r['mesh'][0] else r['zero_group']
    by_mesh.setdefault(key, set()).add((r['zero_stage'], group))
  for (data, pipeline_, tensor, _), choices in by_mesh.items():
    assert choices == set(cost_model.zero_choices(data, pipeline_, tensor, 8)), (data, pipeline_)
  assert {(r['zero_stage'], r['zero_group'] < r['mesh'][0]) for r in found} == {
    (1, False),
    (1, True),
    (3, False),
    (3, True),
  }
  order = [(not r['fits'], r['estimated_step_s']) for r in found]
  assert order == sorted(order) and 'why_behind' not in found[0]
  assert all(r['why_behind'].startswith('+') and 'vs rank 1' in r['why_behind'] for r in found[1:])
  assert all('exceeds' in r['why_not'] for r in found if not r['fits'])
  best, second = found[:2]
  assert (best['zero_stage'], best['mesh'], best['micro_batch_size']) == (3, [64, 1, 1], 16), best
  assert (second['zero_stage'], second['mesh'], second['micro_batch_size']) == (1, [64, 1, 1], 8)
  assert cost_model.search(cfg, 64, 'h200')[0]['zero_stage'] == 1
  best70 = cost_model.search(_bloom(80, 8192, 64, 1), 64, 'h100-80gb')[0]
  assert best70['mesh'][1] > 1 and best70['zero_stage'] == 1, best70


def test_search_ranks_tick_where_a_pipeline_summing_once_a_step_does_not_fit():
  """BLOOM-176B on 384 A100s under grad_sync 'auto' (bloom_176b.py's): the ZeRO-1 pipelines
  whose 'step' (each data rank's whole fp32 gradient) does not fit come again with 'tick', and
  those fit; no other row is repeated (without a pipeline no 'step' fits this model). A config
  that names 'step' is ranked as it is."""
  cfg = load_config_file(os.path.join(REPO, 'configs', 'bloom_176b.py'))
  assert cfg.pipeline.grad_sync == 'auto'
  found = cost_model.search(cfg, 384, 'a100-80gb')
  key = lambda r: (*r['mesh'], r['micro_batch_size'], r['zero_group'])
  pipelined = [r for r in found if r['zero_stage'] == 1 and r['mesh'][1] > 1]
  once = {key(r): r for r in pipelined if r['grad_sync'] == 'step'}
  again = [r for r in pipelined if r['grad_sync'] == 'tick']
  assert {key(r) for r in again} == {k for k, r in once.items() if not r['fits']} != set()
  assert all(r['fits'] for r in again)
  assert {r['grad_sync'] for r in found if r['zero_stage'] == 3 or r['mesh'][1] == 1} == {'tick'}
  named = cost_model.search(cfg.replace(pipeline={'grad_sync': 'step'}), 384, 'a100-80gb')
  assert not any(r['zero_stage'] == 1 and r['grad_sync'] == 'tick' for r in named)
  assert len(named) == len(found) - len(again)


def test_cli_search_prints_the_zero_layout_and_why_each_loses(capsys):
  args = [
    '--config',
    os.path.join(REPO, 'configs', 'bloom_176b.py'),
    '--search',
    '--gpus',
    '64',
    '--gpu',
    'h100-80gb',
    '--top',
    '3',
    '--config.model.num_layers=40',
    '--config.model.hidden_size=5120',
    '--config.model.num_heads=40',
    '--config.train.global_batch_size=2048',
    '--config.train.rampup_batch_size=()',
  ]
  assert plan.main(args) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].split()[:9] == ['rank', 'DP', 'PP', 'TP', 'ZeRO', 'G', 'MBS', 'sync', 's/it']
  assert lines[2].split()[:8] == ['1', '64', '1', '1', '3', '64', '16', 'tick']
  # 57.6 GiB estimated of the 59.7 usable (XLA's GPU compile: 59.41).
  assert lines[2].endswith('yes, near the limit')
  assert all('vs rank 1:' in line for line in lines[3:5]), lines
  assert 'near the limit' not in lines[4]  # ZeRO-3 at MBS 8: 32.3 GiB
  assert lines[5].startswith('near the limit: estimated to fit with less headroom than the memory')


# The one train step this project measured on a GPU: docs/benchmarks.md, "The GPU suite"
# (benchmarks/gpu_suite.py, 2026-11-24, one NVIDIA H100 80GB HBM3 SXM, jax/jaxlib 0.11.2):
# configs/bloom_1b3.py on a 1 x 1 x 1 mesh, global batch 16 = 4 micro-batches of 4 x 2048 tokens,
# remat_policy='save_dots', chunked cross-entropy, bf16 over fp32 master weights; median of 10
# steps. {attention_impl: (ms per step, model TFLOP/s, XLA's peak GiB = the allocator's peak)}.
H100_BLOOM_1B3 = {
  'xla': (1528, 231, 49.07),
  'pallas': (951, 371, 46.14),
  'cudnn': (997, 354, 46.85),
}
# Within these of the measurement (the constants before, the A100 fit's curve for every kernel
# and t5x_like's memory counted as for a pipeline: xla 1022 ms, pallas and cudnn 852 ms, -33%,
# -10% and -15%; 56.3 GiB for all three, +15% to +22%). Now: -4.3%, fitted (0.0%) and +2.8%;
# in memory, with the zero count's fill that code held (fit_planner.zero_count_fill_gib), -0.0%,
# -1.2% and -2.2%.
H100_TIME_ERROR = 0.06
H100_MEMORY_ERROR = 0.05


def _bloom_1b3_step(impl):
  return fit_planner.h100_step_config(impl)


def _as_measured(impl: str) -> dict:
  """The estimate of the suite's step as the measured code ran it (its save_dots recomputed
  every attention forward; its gradients were not added in place)."""
  return cost_model.estimate(
    _bloom_1b3_step(impl),
    'h100-80gb',
    residuals_kept=fit_planner.H100_STEP_RESIDUALS_KEPT,
    gradients_in_place=fit_planner.H100_STEP_GRADIENTS_IN_PLACE,
  )


def _as_run_before_in_place(cfg) -> dict:
  """The estimate of `cfg`'s step as the code of the GPU suite's measurements before 2026-11-28
  ran it: its gradients not added in place (fit_planner.H100_STEP_GRADIENTS_IN_PLACE), and a
  fused loss's two chunks side by side (FUSED_CHUNKS_AT_ONCE_MEASURED)."""
  return cost_model.estimate(
    cfg,
    'h100-80gb',
    gradients_in_place=fit_planner.H100_STEP_GRADIENTS_IN_PLACE,
    fused_chunks_at_once=FUSED_CHUNKS_AT_ONCE_MEASURED,
  )


# Every GPU measurement of the fused loss (2026-11-27 and 28) ran a micro-batch's two token
# chunks side by side (cost_model.fused_loss_bytes); since 2026-11-29 one chunk at a time.
FUSED_CHUNKS_AT_ONCE_MEASURED = 2


def _measured_code_gib(estimate: dict, cfg) -> float:
  """An estimate's memory plus the zero count's fp32 fill, which every peak the H100 measured
  held (fit_planner.zero_count_fill_gib)."""
  return estimate['estimated_memory_gib'] + fit_planner.zero_count_fill_gib(cfg)


def test_h100_estimate_of_the_measured_bloom_1b3_step():
  """Each attention implementation's step time, TFLOP/s and memory within H100_TIME_ERROR and
  H100_MEMORY_ERROR of what the H100 measured (the memory with the zero count's fill that code
  held). The time's one fitted constant (MEASURED_HALF_WORK) comes from the pallas row; xla and
  cudnn are held out; the memory terms were fitted to XLA's GPU compiles, not to these rows."""
  errors = {}
  for impl, (ms, tflops, gib) in H100_BLOOM_1B3.items():
    r = _as_measured(impl)
    memory = _measured_code_gib(r, _bloom_1b3_step(impl))
    errors[impl] = (
      r['estimated_step_s'] * 1e3 / ms - 1,
      r['estimated_tflops_per_gpu'] / tflops - 1,
      memory / gib - 1,
    )
    print(
      f'H100 bloom_1b3 {impl}: {r["estimated_step_s"] * 1e3:.0f} ms ({errors[impl][0]:+.1%}), '
      f'{r["estimated_tflops_per_gpu"]:.0f} TFLOP/s ({errors[impl][1]:+.1%}), '
      f'{memory:.2f} GiB ({errors[impl][2]:+.1%})'
    )
  for impl, (time, tflops, memory) in errors.items():
    assert abs(time) < H100_TIME_ERROR, (impl, errors)
    assert abs(tflops) < H100_TIME_ERROR + 0.01, (impl, errors)  # the measured TFLOP/s rounded
    assert abs(memory) < H100_MEMORY_ERROR, (impl, errors)
  # The implementations rank as measured: pallas, cudnn, xla.
  times = {impl: _as_measured(impl) for impl in errors}
  assert sorted(times, key=lambda i: times[i]['estimated_step_s']) == ['pallas', 'cudnn', 'xla']


# The same step measured again by the GPU suite on 2026-11-27 (one NVIDIA H100 80GB HBM3, jax
# 0.11.2, tokamax 0.0.17; median of 5 steps), with save_dots keeping the pallas and mosaic
# kernels' residuals, and two implementations more: docs/benchmarks.md, "The GPU suite". XLA's
# peak in bytes (= the allocator's, within 3 KB). Measured before 2026-11-28's zero count, which
# took 6.42 GiB (a second fp32 copy of the state, fit_planner.zero_count_fill_gib) off XLA's GPU
# compile of this step.
H100_BLOOM_1B3_KEPT = {
  'xla': (1544, 229, 52_638_993_998),
  'pallas': (943, 374, 50_314_478_414),
  'cudnn': (1009, 350, 50_259_557_710),
  'tokamax': (955, 370, 49_990_597_966),
  'mosaic': (937, 377, 50_311_409_742),
}


def test_h100_estimate_of_the_step_measured_with_residuals_kept():
  """The model as it is (save_dots keeps pallas's and mosaic's residuals) against the second
  H100 measurement: every row held out (the fit's constant came from the first), tokamax and
  mosaic never seen by it. Measured: -5.3%, -2.5%, +1.5%, -0.4%, -1.9% in time; +0.1% to -2.1%
  in memory (with the zero count's fill). 'auto' runs mosaic on Hopper (AUTO_ORDER) and is
  estimated as mosaic."""
  estimates = {impl: _as_run_before_in_place(_bloom_1b3_step(impl)) for impl in H100_BLOOM_1B3_KEPT}
  for impl, (ms, tflops, peak_bytes) in H100_BLOOM_1B3_KEPT.items():
    r = estimates[impl]
    assert r['attention_impl'] == impl
    assert abs(r['estimated_step_s'] * 1e3 / ms - 1) < H100_TIME_ERROR, (impl, r)
    assert abs(r['estimated_tflops_per_gpu'] / tflops - 1) < H100_TIME_ERROR + 0.01, (impl, r)
    memory = _measured_code_gib(r, _bloom_1b3_step(impl))
    assert abs(memory * 2**30 / peak_bytes - 1) < H100_MEMORY_ERROR, (impl, r)
  # Ranked as measured, but for mosaic, priced with pallas's kernel rates (docs/planner.md).
  step_s = {impl: r['estimated_step_s'] for impl, r in estimates.items()}
  assert sorted(step_s, key=step_s.__getitem__)[1:] == ['mosaic', 'tokamax', 'cudnn', 'xla']
  assert step_s['mosaic'] == step_s['pallas']
  auto = _as_run_before_in_place(_bloom_1b3_step('auto'))
  assert auto['attention_impl'] == 'mosaic'
  assert auto['estimated_step_s'] == step_s['mosaic']


# The GPU suite on one NVIDIA H200 (docs/benchmarks.md, "The GPU suite", 2026-11-28, jax 0.11.2):
# H100_BLOOM_1B3's step as this code runs it (no zero count's fill, each micro-batch's gradient
# added in place, save_dots keeping our kernels' residuals), 2 + 5 steps (2 + 3 for the loss and
# tune stages' rows). The H200 has the H100's bf16 peak and 1.43x its HBM bandwidth; the cost
# model prices it with the H100's measured kernel rates. {(attention_impl, cross_entropy_impl,
# unroll_layers): (ms per step, XLA's peak bytes, which the allocator's peak matched)}.
H200_BLOOM_1B3 = {
  ('xla', 'chunked', False): (1346.3, 43_273_504_582),
  ('pallas', 'chunked', False): (867.5, 40_778_423_878),
  ('tokamax', 'chunked', False): (874.7, 40_623_884_358),
  ('mosaic', 'chunked', False): (856.4, 40_903_854_150),
  ('mosaic', 'fused', False): (772.2, 49_513_637_702),
  ('mosaic', 'fused', True): (701.6, 59_949_954_118),
}


def test_h200_estimate_of_the_measured_steps():
  """Each row within H100_TIME_ERROR and H100_MEMORY_ERROR, estimated as this code runs it: time
  +4.8% (xla), -0.1%, +2.7%, +1.3%, +3.0% and -1.2% (the unrolled layers: +11.3% with the
  scanned layers' per-pass fixed cost, cost_model.unrolled_layers); memory +0.2%, -0.9%, -1.2%,
  -1.1%, +3.8% and +3.3% (the unrolled layers: -14.2% without what XLA merges into their forward,
  cost_model.merges_recomputation)."""
  estimates = {}
  for (impl, loss, unroll), (ms, peak_bytes) in H200_BLOOM_1B3.items():
    cfg = _bloom_1b3_step(impl).replace(model={'cross_entropy_impl': loss, 'unroll_layers': unroll})
    estimates[impl, loss, unroll] = r = cost_model.estimate(
      cfg, 'h200', fused_chunks_at_once=FUSED_CHUNKS_AT_ONCE_MEASURED
    )
    time = r['estimated_step_s'] * 1e3 / ms - 1
    memory = r['estimated_memory_gib'] * 2**30 / peak_bytes - 1
    assert abs(time) < H100_TIME_ERROR and abs(memory) < H100_MEMORY_ERROR, (
      (impl, loss, unroll),
      f'{time:+.1%}',
      f'{memory:+.1%}',
    )
  # The measured order of the loss and layer variants, in time and in memory.
  variants = [('mosaic', 'fused', True), ('mosaic', 'fused', False), ('mosaic', 'chunked', False)]
  step_s = [estimates[v]['estimated_step_s'] for v in variants]
  memory_gib = [estimates[v]['estimated_memory_gib'] for v in variants]
  assert step_s == sorted(step_s) and memory_gib == sorted(memory_gib, reverse=True)


def test_an_explicit_fixed_cost_per_layer_pass_applies_to_unrolled_layers_too():
  """By default unrolled layers pay no per-pass fixed cost; a caller's explicit
  measured_half_work is used as given, unrolled or not (the scanned cost on the H200's unrolled
  row is its +11.3%)."""
  cfg = _bloom_1b3_step('mosaic').replace(model={'cross_entropy_impl': 'fused'})
  unrolled = cfg.replace(model={'unroll_layers': True})

  def step_s(c, **kwargs):
    return cost_model.estimate(c, 'h200', **kwargs)['estimated_step_s']

  assert step_s(unrolled) == step_s(unrolled, measured_half_work=0.0)
  fixed = cost_model.MEASURED_HALF_WORK
  assert step_s(unrolled, measured_half_work=fixed) > 1.1 * step_s(unrolled)
  assert step_s(cfg) == step_s(cfg, measured_half_work=fixed)


# The suite's loss stage in the same run: the mosaic step with the other cross-entropies
# ({cross_entropy_impl: (ms per step, XLA's peak bytes)}; chunked is H100_BLOOM_1B3_KEPT's row).
H100_BLOOM_1B3_LOSSES = {'dense': (976, 62_441_841_998), 'fused': (860, 58_457_431_374)}


def test_h100_estimate_of_the_loss_variants():
  """The fused loss's memory: without a pipeline its peak is in the loss, where that code held
  two [token chunk, vocabulary] tiles in fp32 and two in bf16, its two chunks side by side
  (-0.3%, with the zero count's fill; cost_model.fused_loss_bytes), and its time
  (-2.1%). The dense loss's memory: all the fp32 logits and their gradient (+1.6%; XLA's compile
  without a GPU holds one of the two); its time is not within reach (-12.2%: the model's open
  error, docs/benchmarks.md)."""
  estimates = {}
  for impl, (_ms, peak_bytes) in H100_BLOOM_1B3_LOSSES.items():
    cfg = _bloom_1b3_step('mosaic').replace(model={'cross_entropy_impl': impl})
    estimates[impl] = r = _as_run_before_in_place(cfg)
    memory = _measured_code_gib(r, cfg)
    assert abs(memory * 2**30 / peak_bytes - 1) < H100_MEMORY_ERROR, (impl, r)
    if impl == 'fused':
      # Its peak is the loss's forward: counted as a pipeline stage's (one fp32 tile of logits,
      # one of exponentials and the fp32 embedding gradient) it was -3.8%.
      assert abs(memory * 2**30 / peak_bytes - 1) < 0.01, r
  fused_ms = H100_BLOOM_1B3_LOSSES['fused'][0]
  assert abs(estimates['fused']['estimated_step_s'] * 1e3 / fused_ms - 1) < H100_TIME_ERROR
  chunked = _as_run_before_in_place(_bloom_1b3_step('mosaic'))
  # As measured: chunked, fused, dense in memory; fused faster than chunked.
  memory = [chunked, estimates['fused'], estimates['dense']]
  assert sorted(memory, key=lambda r: r['estimated_memory_gib']) == memory
  assert estimates['fused']['estimated_step_s'] < chunked['estimated_step_s']


def test_measured_half_work_is_the_fit_of_the_h100_pallas_step():
  """MEASURED_HALF_WORK is fit_planner's solution on the pallas row (the estimate equals the
  measured 951 ms), and fit_planner's H100 rows are this file's measurements."""
  assert fit_planner.fit_measured_half_work() == cost_model.MEASURED_HALF_WORK
  assert {impl: (round(sec * 1e3), gib) for impl, sec, gib in fit_planner.H100_STEP} == {
    impl: (ms, gib) for impl, (ms, _, gib) in H100_BLOOM_1B3.items()
  }
  r = _as_measured('pallas')
  assert abs(r['estimated_step_s'] - 0.951) < 0.001
  # 0.215 ms per forward-sized layer pass on the H100 (the A100 fit's: 3.5 ms).
  assert math.isclose(cost_model.MEASURED_HALF_WORK / 671e12, 0.215e-3, rel_tol=0.01)


def test_save_dots_spares_our_kernels_a_second_attention_forward():
  """Against the measured code (its save_dots recomputed every attention forward), the pallas
  step is one attention forward faster at the kernel's measured rate and keeps its output and
  log-sum-exp (24 layers of [4, 2048, 16, 128] bf16 and [4, 16, 2048] fp32); cuDNN's kernel, whose
  residuals the policy cannot name, is estimated as before."""
  spec = cost_model.GPUS['h100-80gb']
  forward_tflops, _ = cost_model.measured_attention_tflops(spec.measured, 'pallas', 2048)
  causal_forward = 4 * 24 * 4 * 4 * 2048 * 2048 * 2048 / 2  # micro-batches x layers x 4bs²h / 2
  pallas = _as_run_before_in_place(_bloom_1b3_step('pallas'))
  before = _as_measured('pallas')
  saved_s = before['estimated_step_s'] - pallas['estimated_step_s']
  assert math.isclose(saved_s, causal_forward / (forward_tflops * 1e12), rel_tol=1e-9)
  kept = pallas['estimated_memory_gib'] - before['estimated_memory_gib']
  assert math.isclose(kept * 2**30, 24 * (4 * 2048 * 2048 * 2 + 4 * 16 * 2048 * 4))
  cudnn = _as_run_before_in_place(_bloom_1b3_step('cudnn'))
  assert cudnn == _as_measured('cudnn')


def test_h100_kernels_at_their_measured_rates():
  """On a GPU with measured rates the matmuls run at the GEMM probe's 671 TFLOP/s less the
  per-pass cost, attention at its implementation's measured forward and backward rates (causal
  FLOPs, the backward 2.5 forwards), its forward twice under save_dots, and the logits four
  times under the chunked cross-entropy."""
  spec = cost_model.GPUS['h100-80gb']
  assert spec.measured is cost_model.GPUS['h200'].measured is cost_model.H100_MEASURED
  assert cost_model.GPUS['a100-80gb'].measured is None
  measured = spec.measured
  assert measured.matmul_tflops == 671
  assert cost_model.measured_attention_tflops(measured, 'pallas', 2048) == (210, 230)
  assert cost_model.measured_attention_tflops(measured, 'cudnn', 4096) == (177, 145)
  assert cost_model.measured_attention_tflops(measured, 'xla', 1024) == (36.2, 58.5)
  assert cost_model.measured_attention_tflops(measured, 'xla', 8192) == (40.8, 59.9)
  between = cost_model.measured_attention_tflops(measured, 'pallas', 2896)  # 2^11.5
  assert math.isclose(between[0], (210 + 263) / 2, rel_tol=1e-3)
  for unmeasured in ('tokamax', 'mosaic'):  # the Pallas kernels' rates until measured
    assert cost_model.measured_attention_tflops(measured, unmeasured, 2048) == (210, 230)

  cfg = _bloom_1b3_step('cudnn')
  r = cost_model.estimate(cfg, 'h100-80gb')
  b, s, h, layers, micro = 4, 2048, 2048, 24, 4
  causal = 2 * b * s * s * h  # per layer and micro-batch
  forward, backward = causal / 155e12, 2.5 * causal / 134e12
  assert math.isclose(r['attention_s'], micro * layers * (forward + backward))
  matmul = layers * 2 * b * s * 12 * h * h
  head = 2 * b * s * h * 250880
  rate = 671e12 * (matmul / layers) / (matmul / layers + cost_model.MEASURED_HALF_WORK)
  assert math.isclose(r['matmul_s'], micro * 3 * (matmul + head) / rate)
  assert math.isclose(r['recompute_s'], micro * (head / rate + layers * forward))
  assert math.isclose(r['compute_efficiency'], rate / 989e12)
  assert r['attention_scores_s'] == 0 and r['memory_bound_s'] > 0
  traffic = cost_model.memory_bound_bytes(cfg)
  assert math.isclose(
    r['memory_bound_bytes_per_gpu'],
    micro * (traffic['layers'] + traffic['logits'] + traffic['gradients']) + traffic['step'],
  )
  assert math.isclose(r['memory_bound_s'], r['memory_bound_bytes_per_gpu'] / 3350e9)


def test_save_dots_keeps_the_matmuls_without_batch_dimensions():
  """bloom_1b3's step under save_dots keeps, per layer, QKV, the attention's output projection
  and h -> 4h (dots_with_no_batch_dims_saveable: not the scores or the context, batched over
  heads; not the MLP's output projection, which no backward reads) and the layer's input: 9
  hidden-state tensors of 32 MiB, 6.75 GiB for 24 layers (XLA's GPU compile keeps the same four
  stacks; the estimate said 19.5 GiB with the scores, then 7.5 with the MLP's projection). Only
  'xla' materialises scores: its backward holds three fp32 score-sized buffers more (3 GiB; the H100
  measured 2.93 GiB over pallas) and their bf16 matmul output. Our kernels' ('pallas', 'mosaic')
  output and float32 log-sum-exp are kept too, by name."""
  gib = 2**30
  by_impl = {
    impl: cost_model.estimate(_bloom_1b3_step(impl), 'h100-80gb')['memory_gib_by_category']
    for impl in ('xla', 'pallas', 'cudnn', 'tokamax', 'mosaic')
  }
  hidden = 4 * 2048 * 2048 * 2
  lse = 4 * 16 * 2048 * 4
  for impl, memory in by_impl.items():
    ours = impl in ('pallas', 'mosaic')
    assert math.isclose(memory['kept activations'] * gib, 24 * (9 * hidden + ours * (hidden + lse)))
  scores = 4 * 16 * 2048 * 2048
  extra = by_impl['xla']['backward workspace'] - by_impl['pallas']['backward workspace']
  assert math.isclose(extra * gib, 3 * 4 * scores + 2 * scores)
  # cuDNN's materialised ALiBi bias and its gradient; tokamax's bf16 score gradient.
  cudnn = by_impl['cudnn']['backward workspace'] - by_impl['pallas']['backward workspace']
  assert math.isclose(cudnn * gib, 2 * 2 * 16 * 2048 * 2048)
  tokamax = by_impl['tokamax']['backward workspace'] - by_impl['pallas']['backward workspace']
  assert math.isclose(tokamax * gib, 2 * scores)
  # Full recomputation keeps each layer's input only.
  full = cost_model.estimate(
    _bloom_1b3_step('pallas').replace(model={'remat_policy': 'full'}), 'h100-80gb'
  )
  assert math.isclose(full['memory_gib_by_category']['kept activations'] * gib, 24 * hidden)


def _no_pipeline(layers, hidden, heads, data, tensor, stage, group=0, impl='mosaic', **more):
  """bloom_1b3.py's setup at another shape and mesh, micro-batch 1, full recomputation."""
  overrides = {
    'model.num_layers': layers,
    'model.hidden_size': hidden,
    'model.num_heads': heads,
    'model.remat_policy': 'full',
    'model.attention_impl': impl,
    'train.micro_batch_size': 1,
    'train.global_batch_size': 512 if layers == 80 else 256,
    'mesh.data': data,
    'mesh.pipeline': 1,
    'mesh.tensor': tensor,
    'mesh.zero_stage': stage,
    'mesh.zero_group': group,
    'pipeline.grad_sync': 'auto',  # bloom_1b3.py's 'step' holds the whole gradient per rank
    **MEASURED_1B3,
    **more,
  }
  return load_config_file(os.path.join(REPO, 'configs', 'bloom_1b3.py'), overrides).validate()


STEP = {'pipeline.grad_sync': 'step'}


def _shipped_1b3(**overrides):
  """configs/bloom_1b3.py's topology (data 16, 'step') with its model as compiled here
  (MEASURED_1B3), and `overrides`."""
  return load_config_file(
    os.path.join(REPO, 'configs', 'bloom_1b3.py'), {**MEASURED_1B3, **overrides}
  ).validate()


def _suite_step(impl='mosaic', **model):
  return _bloom_1b3_step(impl).replace(model=model) if model else _bloom_1b3_step(impl)


_7B, _13B, _70B = (30, 4096, 32), (40, 5120, 40), (80, 8192, 64)
# XLA's GPU compiles without a pipeline (plan --gpu h100-80gb on this machine, jax 0.10.2,
# 2026-11-28; docs/benchmarks.md, "No pipeline: memory refitted to XLA's GPU compiles"): (the
# config, XLA's peak GiB). Left out: the steps over 80 GB, where XLA's rematerialisation pass
# rewrites the program (13B in ZeRO-3 groups of 4, 70B in groups of 8; the model is +0.6% to
# +2.3% there), and the dense loss, whose fp32 logits the H100 held twice and this compile once
# (test_h100_estimate_of_the_loss_variants).
GPU_NO_PIPELINE_PEAK_GIB = [
  (lambda: _no_pipeline(*_7B, 8, 1, 1, impl='xla'), 31.84),
  (lambda: _no_pipeline(*_7B, 8, 1, 1), 30.87),
  (lambda: _no_pipeline(*_7B, 8, 1, 3, impl='xla'), 21.56),
  (lambda: _no_pipeline(*_7B, 8, 1, 3), 20.55),
  (lambda: _no_pipeline(*_7B, 8, 1, 3, 4, impl='xla'), 37.34),
  (lambda: _no_pipeline(*_7B, 8, 1, 3, 4), 36.65),
  (lambda: _no_pipeline(*_7B, 8, 1, 1, 4), 45.73),
  (lambda: _no_pipeline(*_7B, 4, 2, 1, 2), 39.45),
  (lambda: _no_pipeline(*_7B, 4, 2, 3, 2), 36.79),
  (lambda: _no_pipeline(*_7B, 8, 1, 3, **{'model.remat_policy': 'save_dots'}), 25.02),
  (lambda: _no_pipeline(*_13B, 8, 1, 1, impl='xla'), 59.95),
  (lambda: _no_pipeline(*_13B, 8, 1, 1), 59.78),
  (lambda: _no_pipeline(*_13B, 8, 1, 3, impl='xla'), 38.54),
  (lambda: _no_pipeline(*_13B, 8, 1, 3), 37.50),
  (lambda: _no_pipeline(*_70B, 64, 1, 3, impl='xla'), 32.61),
  (lambda: _no_pipeline(*_70B, 64, 1, 3), 30.52),
  (lambda: _no_pipeline(*_70B, 8, 8, 1, impl='xla'), 36.60),
  (lambda: _no_pipeline(*_70B, 8, 8, 1), 36.60),
  (lambda: _no_pipeline(*_70B, 8, 8, 3, impl='xla'), 23.00),
  (lambda: _no_pipeline(*_70B, 8, 8, 3), 22.76),
  (lambda: _no_pipeline(*_70B, 8, 8, 3, **{'model.sequence_parallel': True}), 20.46),
  # plan --search --aot's top rows for 13B on 64 H100s (bloom_176b.py's setup, global batch 2048).
  (lambda: _bloom(*_13B, 64, micro=16, stage=3), 59.41),
  (lambda: _bloom(*_13B, 64, micro=8, stage=1), 58.31),
  (lambda: _bloom(*_13B, 64, micro=8, stage=3), 33.08),
  (lambda: _bloom(*_13B, 64, micro=4, stage=1), 45.15),
  # The GPU suite's bloom_1b3 step (one GPU, micro-batch 4, save_dots), and on 8 GPUs as shipped
  # (grad_sync 'step', each rank's whole fp32 gradient: 15.95 under 'tick').
  (lambda: _suite_step('xla'), 40.30),
  (lambda: _suite_step('pallas'), 38.10),
  (lambda: _suite_step('mosaic'), 38.10),
  # The fused loss one token chunk at a time (48.03 when XLA ran the two side by side).
  (lambda: _suite_step(cross_entropy_impl='fused'), 44.21),
  (
    lambda: load_config_file(
      os.path.join(REPO, 'configs', 'bloom_1b3.py'),
      {'model.attention_impl': 'mosaic', 'mesh.pipeline': 1, 'mesh.data': 8, **MEASURED_1B3},
    ).validate(),
    21.25,
  ),
  # grad_sync 'step': each data rank adds its own micro-batches' gradients up, whole, and the
  # ranks' sums are reduce-scattered once a step (step.per_rank_loss_and_grads). bloom_1b3.py
  # as shipped, in hybrid groups of 8, with the fused loss at micro-batch 8 and with xla
  # attention; 7B on 8 GPUs in hybrid groups of 2 and at tensor 4; 13B at data 8 x tensor 8.
  (lambda: _shipped_1b3(), 20.05),
  (lambda: _shipped_1b3(**{'mesh.zero_group': 8}), 21.25),
  (
    lambda: _shipped_1b3(**{'model.cross_entropy_impl': 'fused', 'train.micro_batch_size': 8}),
    33.88,  # 35.78 before the fused loss's first chunk ended before the others began
  ),
  (lambda: _shipped_1b3(**{'model.attention_impl': 'xla'}), 22.26),
  # Hybrid groups of one under 'tick': each rank its own copy, whose loop adds in place.
  (
    lambda: _shipped_1b3(**{'mesh.data': 8, 'mesh.zero_group': 1, 'pipeline.grad_sync': 'tick'}),
    38.10,
  ),
  (lambda: _no_pipeline(*_7B, 4, 2, 1, 2, **STEP), 42.32),
  (lambda: _no_pipeline(*_7B, 2, 4, 1, **STEP), 21.16),
  (lambda: _no_pipeline(*_13B, 8, 8, 1, **STEP), 13.38),
  # The first row of plan --search for 13B on Jean Zay's 64 A100s (docs/planner.md), for H100s.
  (lambda: _bloom(*_13B, 16, tensor=4, micro=32, sync='step'), 48.31),
  # The layers unrolled (model.unroll_layers), where XLA merges their recomputed forward into
  # the forward (cost_model.merges_recomputation): the suite's step, bloom_1b3.py's topology,
  # with the fused loss (the config as shipped since 2026-11-28), and under 'tick'.
  (lambda: _suite_step(unroll_layers=True), 47.41),
  (lambda: _shipped_1b3(**{'model.unroll_layers': True}), 29.37),
  (
    lambda: _shipped_1b3(**{'model.unroll_layers': True, 'model.cross_entropy_impl': 'fused'}),
    35.89,  # 39.70 with the fused loss's two chunks side by side
  ),
  (lambda: _shipped_1b3(**{'model.unroll_layers': True, 'pipeline.grad_sync': 'tick'}), 23.69),
]


def test_unrolled_layers_keep_what_their_backward_would_recompute():
  """Unrolled under save_dots, each layer also keeps the tanh-GeLU's two [tokens, ffn] products
  and both LayerNorms' outputs, and under ZeRO-1 its weights as sliced from the compute copy: XLA's
  GPU compiles of configs/bloom_1b3.py hold 9.3 GiB more than scanned (29.37 GiB against 20.05;
  GPU_NO_PIPELINE_PEAK_GIB's rows are within 1%). Under ZeRO-3 XLA keeps 6.3 GiB more (18.03
  against 11.74): +6.6%, counted without the weights, which ZeRO-3 gathers where it uses them."""
  for sync, stage, xla in (('step', 1, 29.37), ('tick', 3, 18.03)):
    scanned, unrolled = (
      _shipped_1b3(
        **{'mesh.zero_stage': stage, 'pipeline.grad_sync': sync, 'model.unroll_layers': unroll}
      )
      for unroll in (False, True)
    )
    assert cost_model.merges_recomputation(unrolled) and not cost_model.merges_recomputation(
      scanned
    )
    more = [
      cost_model.memory_bytes(unrolled, gpu='h100-80gb')[k]
      - cost_model.memory_bytes(scanned, gpu='h100-80gb')[k]
      for k in ('kept activations', 'weight copies')
    ]
    tokens = 4 * 2048
    assert more[0] == 24 * 2 * tokens * (2 * 8192 + 2 * 2048)
    stage_params, _ = cost_model.local_params(unrolled)
    assert more[1] == (2 * stage_params if stage == 1 else 0)
    estimate = cost_model.estimate(unrolled, 'h100-80gb')['estimated_memory_gib']
    assert abs(estimate / xla - 1) < (0.01 if stage == 1 else 0.07), (stage, estimate)
  # Without 'save_dots', or in GPipe's stages, nothing is merged; in 1F1B's, each backward
  # tick's recomputed stage keeps the same per layer (test_one_f_one_b_with_unrolled_layers_...).
  assert not cost_model.merges_recomputation(
    _shipped_1b3(**{'model.unroll_layers': True, 'model.remat_policy': 'none'})
  )
  piped = {'mesh.data': 8, 'mesh.pipeline': 2, 'model.cross_entropy_impl': 'chunked'}
  gpipe = _shipped_1b3(**{**piped, 'model.unroll_layers': True})
  assert gpipe.pipeline.schedule == 'gpipe' and not cost_model.merges_recomputation(gpipe)
  one_f_one_b = [
    _shipped_1b3(**{**piped, 'pipeline.schedule': '1f1b', 'model.unroll_layers': unroll})
    for unroll in (False, True)
  ]
  assert cost_model.merges_recomputation(one_f_one_b[1])
  workspace = [
    cost_model.memory_bytes(c, gpu='h100-80gb')['recomputation workspace'] for c in one_f_one_b
  ]
  assert workspace[1] - workspace[0] == 12 * 2 * tokens * (2 * 8192 + 2 * 2048)


def pipeline_compiles():
  """(config, GPU kind, XLA's GPU peak GiB) of every pipelined compile this file holds."""
  config = lambda name, overrides: load_config_file(os.path.join(REPO, 'configs', name), overrides)
  cases = [
    *chronicles_and_tr11_cases('tick'),
    *chronicles_and_tr11_cases('step'),
    tr8_104b_case(),
  ]
  rows = [(cfg, 'a100-80gb', xla) for cfg, xla in cases]
  for overrides, gpu, xla in GPU_PIPELINE_PEAK_GIB + GPU_ZERO3_1F1B_PEAK_GIB:
    rows.append((config('bloom_176b.py', overrides), gpu, xla))
  pipelined = [row for row in GPU_NO_RECOMPUTATION_PEAK_GIB if 'mesh.pipeline' in row[0]]
  for overrides, xla in GPU_GPIPE_PEAK_GIB + GPU_1F1B_1B3_PEAK_GIB + pipelined:
    rows.append((config('bloom_1b3.py', overrides), 'h100-80gb', xla))
  return rows


def test_a_fit_within_the_memory_models_error_is_near_the_limit():
  """MEMORY_ERROR bounds the model's underestimates of XLA's GPU compiles (without a pipeline
  the largest, -3.0%; with one -5.3%, hybrid sharding under 'tick', where XLA's allocation holds
  1.1 GiB more than its live buffers); a topology that fits with less headroom is near_limit,
  with why, and one with more headroom, or none, is not."""
  under = max(
    1 - cost_model.estimate(make(), 'h100-80gb')['estimated_memory_gib'] / gib
    for make, gib in GPU_NO_PIPELINE_PEAK_GIB
  )
  assert 0.025 < under < cost_model.MEMORY_ERROR
  under = max(
    1 - cost_model.estimate(cfg, gpu)['estimated_memory_gib'] / gib
    for cfg, gpu, gib in pipeline_compiles()
  )
  assert 0.05 < under < cost_model.MEMORY_ERROR
  tight = cost_model.estimate(_bloom(*_13B, 64, micro=16, stage=3), 'h100-80gb')
  assert tight['fits'] and tight['near_limit']
  assert tight['why_near'].startswith('57.6 GiB per GPU is within 6% (the memory model')
  roomy = cost_model.estimate(_bloom(*_13B, 64, micro=8, stage=3), 'h100-80gb')
  assert roomy['fits'] and not roomy['near_limit'] and 'why_near' not in roomy
  over = cost_model.estimate(_bloom(*_13B, 64, micro=16, stage=1), 'h100-80gb')
  assert not over['fits'] and not over['near_limit']


def test_zero1_peak_is_the_gathers_transposed_mlp_stack_where_later_phases_hold_less():
  """Under ZeRO-1 over 8 ranks XLA gathers each stacked weight with its split dim outermost and
  transposes it whole into the layers' layout: 13B (tensor 1) and 70B (tensor 8) peak there,
  before the first micro-batch, holding an MLP weight's stack twice and its shard (XLA's GPU
  compiles: 59.78 and 36.60 GiB); a 7B's later phases hold about as much, and its peak is in
  the backward (30.87)."""
  gib = 2**30
  for make, peak in (
    (lambda: _no_pipeline(*_13B, 8, 1, 1), 59.78),
    (lambda: _no_pipeline(*_70B, 8, 8, 1), 36.60),
    (lambda: _no_pipeline(*_7B, 8, 1, 1), 30.87),
  ):
    cfg = make()
    r = cost_model.estimate(cfg, 'h100-80gb')
    memory = r['memory_gib_by_category']
    stage, embedding = cost_model.local_params(cfg)
    m = cfg.model
    transposed = 2 * m.num_layers * m.hidden_size * m.ffn_size / cfg.mesh.tensor * (1 + 1 / 8)
    later = memory['kept activations'] + memory['backward workspace']
    later += memory['other temporaries']
    extra = memory['weight copies'] * gib - 2 * (stage + embedding)
    assert math.isclose(extra, max(0.0, transposed - later * gib), abs_tol=1), cfg.mesh
    assert extra > 0 or m.num_layers == 30
    assert abs(r['estimated_memory_gib'] / peak - 1) < 0.015, (cfg.mesh, r['estimated_memory_gib'])


def test_zero3_peak_is_the_loss_where_the_embedding_is_gathered():
  """Under ZeRO-3 without a pipeline XLA's peak with the fused kernels is in the loss's
  backward (7B and 13B on 8 GPUs: 20.55 and 37.50 GiB): the embedding gathered for the logits,
  their chunks' gradient, and the layers' bf16 gradient already zero-filled; the layers'
  backward holds less."""
  for make, peak in (
    (lambda: _no_pipeline(*_7B, 8, 1, 3), 20.55),
    (lambda: _no_pipeline(*_13B, 8, 1, 3), 37.50),
  ):
    r = cost_model.estimate(make(), 'h100-80gb')
    assert r['memory_gib_by_category']['other temporaries'] > 0
    assert abs(r['estimated_memory_gib'] / peak - 1) < 0.025, r['estimated_memory_gib']


def test_memory_without_a_pipeline_is_xlas():
  """Within -4%..+6% of XLA's GPU compiles, 2% on average (the terms before this fit,
  fitted to CPU compiles and the H100's peaks of the code with the zero count's fill: +5% to
  +56%). Three phases, not their sum: the layers' backward (the layers' bf16 gradient and the
  embedding's from the logits), the loss (the fused loss's tiles; under ZeRO-3 the gathered
  embedding, with the forward's materialised scores where they weigh more), and under ZeRO-1
  the gather of the bf16 copy, which XLA transposes whole (13B on 8 GPUs: its peak, at the first
  micro-batch)."""
  errors = []
  for make, gib in GPU_NO_PIPELINE_PEAK_GIB:
    cfg = make()
    estimated = cost_model.estimate(cfg, 'h100-80gb')['estimated_memory_gib']
    errors.append(estimated / gib - 1)
    assert -0.04 < errors[-1] < 0.06, (cfg.mesh, cfg.model.num_layers, estimated, gib)
  mean_abs = sum(map(abs, errors)) / len(errors)
  print(
    f'no-pipeline memory vs XLA: {min(errors):+.1%} .. {max(errors):+.1%}, |mean| {mean_abs:.1%}'
  )
  assert mean_abs < 0.02
