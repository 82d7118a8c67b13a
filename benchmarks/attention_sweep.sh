#!/usr/bin/env bash
# Pallas flash-attention tile sizes on one GPU: benchmarks/attention.py once per candidate
# (block_q,block_k,block_q_dkv,block_k_dkv,block_q_dq,block_k_dq num_warps num_stages) at
# seq 4096 x batch 4, 16 heads of 128, bf16 (docs/benchmarks.md).
#
#   benchmarks/attention_sweep.sh LOGFILE
set -u
log=${1:?usage: benchmarks/attention_sweep.sh LOGFILE}
export PYTHONUNBUFFERED=1
: >"$log"
while read -r blocks warps stages; do
  echo "== blocks $blocks warps $warps stages $stages" | tee -a "$log"
  python3 benchmarks/attention.py --seqs 4096 --impls pallas --iters 10 --blocks "$blocks" \
    --num_warps "$warps" --num_stages "$stages" 2>&1 | grep -E '^pallas|failed|Error' | tee -a "$log"
done <<'CANDIDATES'
128,64,64,64,64,64 8 2
128,128,64,64,64,64 8 2
128,64,64,64,64,64 8 3
128,64,64,64,64,64 4 3
128,128,64,128,128,64 8 2
128,64,32,128,128,32 8 2
128,64,64,128,128,64 8 3
128,64,32,64,64,32 4 2
64,64,64,64,64,64 4 3
128,128,128,128,128,128 8 2
128,64,64,128,128,64 4 2
128,64,32,128,128,32 4 3
128,64,32,128,128,32 4 5
128,64,32,128,128,32 8 4
128,128,32,128,128,32 8 3
64,128,32,128,128,32 4 3
CANDIDATES
