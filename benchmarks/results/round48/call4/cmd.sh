#!/usr/bin/env bash
# Session 50 call 4: x padded to whole 64-row tiles, where one partial tile was not measured
# (int4 48 rows, fp8 / int8 24 and 48 rows: head against 45201c2 in .bench_base), then W1
# int4 at batch 96 (--max-num-seqs 96: decode steps of 96 rows), base then head.
set -u
export REPO=$(pwd) PY=python3
R=/tmp/r4; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
( source benchmarks/device_env.sh
  for side in head base; do
    echo "== $side $(date +%T)"
    ( [ $side = base ] && eval "$(bash benchmarks/make_shim.sh .bench_base /tmp/shim-base)"
      cd /tmp && timeout 100 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 fp8 int8 \
         --tokens 24 48 --out $R/${side}_rows.json 2>&1 | grep -v -i warning | grep "T=" )
    tar -czf $OUT/r.tgz -C $R .
  done )
echo "== engine b96 $(date +%T)"
AB_FLAGS="--max-num-seqs 96" AB_WARMUP=0 QUANTW1_KINDS=int4 QUANTW1_BATCH=96 \
  AB_RUNS="base:1 head:1" OUT=$R timeout 300 bash benchmarks/run_ab.sh .bench_base quantw1 2>&1 | tail -3
grep -h "START\|TPOT median\|Roofline\|share" $R/ab_log_quantw1.txt | tail -8
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
