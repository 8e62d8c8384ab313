#!/usr/bin/env bash
# Session 53 call: the 2-sequence default bucket for int4 (10d5564) against main before it
# (6bdac0e, .bench_base), default flags on both: W1 int4 ABBA, then W1 fp8 (unchanged) AB.
set -u
export REPO=$(pwd) PY=python3
R=/tmp/r; mkdir -p $R/int4 $R/fp8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
AB_WARMUP=0 QUANTW1_KINDS=int4 AB_RUNS="base:1 head:1 head:2 base:2" OUT=$R/int4 timeout 330 \
  bash benchmarks/run_ab.sh .bench_base quantw1 2>&1 | tail -2
tar -czf $OUT/r.tgz -C $R .
AB_WARMUP=0 QUANTW1_KINDS=fp8 AB_RUNS="head:1 base:1" OUT=$R/fp8 timeout 200 \
  bash benchmarks/run_ab.sh .bench_base quantw1 2>&1 | tail -2
tar -czf $OUT/r.tgz -C $R .
grep -h "START\|TPOT median\|Roofline TPOT" $R/*/ab_log_quantw1.txt | cut -c1-100
