#!/usr/bin/env bash
# Mosaic GPU flash-attention tiles and options on one Hopper GPU: benchmarks/attention.py once per
# candidate (block_q,block_kv,block_q_dkv,block_kv_dkv,block_q_dq,block_kv_dq,compute_wgs,stages,
# then persistent,early_handoff,paired_backward,issue_handoff,own_turn_barriers as 0 or 1: the
# fields of t5x_like.kernels.MosaicBlocks) at seq 2048 x batch 8, 4096 x batch 4 and 8192 x batch
# 2, 16 heads of 128, bf16 (issue 33's range; 2048 is the default kernels' weakest). The defaults
# first, then issue_handoff (tokamax's order, not yet measured) alone, with a turn barrier per
# warpgroup (tokamax 0.0.17's form), with the persistent forward, and with 64-key tiles in a
# ring of 4; the 2026-11-28 sweep of the other three options is in docs/benchmarks.md. About 40 s
# a candidate; one that does not fit shared memory or registers prints its error and the next
# runs.
#
#   benchmarks/mosaic_sweep.sh LOGFILE
set -u
log=${1:?usage: benchmarks/mosaic_sweep.sh LOGFILE}
export PYTHONUNBUFFERED=1
: >"$log"
while read -r blocks; do
  echo "== mosaic_blocks $blocks" | tee -a "$log"
  timeout 90 python3 benchmarks/attention.py --seqs 2048,4096,8192 --impls mosaic --iters 10 \
    --mosaic_blocks "$blocks" 2>&1 | grep -E '^mosaic|failed|Error' | tee -a "$log"
done <<'CANDIDATES'
64,128,64,64,64,64,2,2,0,0,0,0,0
64,128,64,64,64,64,2,2,0,0,0,1,0
64,128,64,64,64,64,2,2,0,0,0,1,1
64,128,64,64,64,64,2,2,1,0,0,1,0
64,64,64,64,64,64,2,4,0,0,0,1,1
CANDIDATES
