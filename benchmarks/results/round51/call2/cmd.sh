#!/usr/bin/env bash
# Session 53 call: W1 int4 and fp8 at batch 1, default decode buckets (8 rows) against a
# 1-row bucket (--cuda-graph-sizes 1 8 32 128 512), ABBA each, same tree.
set -u
export REPO=$(pwd) PY=python3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
HEAD_FLAGS="--cuda-graph-sizes 1 8 32 128 512" AB_WARMUP=0 QUANTW1_KINDS="${KINDS:-int4 fp8}" \
  AB_RUNS="base:1 head:1 head:2 base:2" OUT=$OUT timeout 570 bash benchmarks/run_ab.sh . quantw1 \
  2>&1 | tail -3
grep -h "START\|TPOT median\|Roofline TPOT" $OUT/ab_log_quantw1.txt | cut -c1-120 | tail -30
