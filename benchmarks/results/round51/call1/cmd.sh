#!/usr/bin/env bash
# Session 53 call 1: the rows after rounds 48-50 on an H200 (W1 int4 and fp8, Qwen3-30B-A3B
# batch 1 and 10 concurrent; 8 decode steps a call). On any other card: report it and stop.
set -u
export REPO=$(pwd) PY=python3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
if ! grep -q H200 $OUT/gpu.txt; then echo "not an H200: stopping"; exit 3; fi
MULTISTEP_MODELS="qwen3 int4 fp8 qwen3c10" MULTISTEP_RUNS="8:1" OUT=$OUT timeout 580 \
  bash benchmarks/run_h200.sh multistep 2>&1 | tail -5
grep -h "TPOT median\|Roofline\|roofline" $OUT/bench_log_multistep.txt | tail -20
