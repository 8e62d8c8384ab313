#!/usr/bin/env bash
# Session 50 call 1: the int4 row rules (16-row tiles to 32 rows, a 64-row tile to 64, 128-row
# wT.dot tiles to 256) at row counts between the sweep's, then the int4 engine at batch 64.
set -u
export REPO=$(pwd) PY=python3
R=/tmp/r5; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
( source benchmarks/device_env.sh
  echo "== rows $(date +%T)"
  timeout 90 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 --tokens 1 48 96 192 \
     --out $R/int4_rule_rows.json 2>&1 | grep -v -i warning | tail -20 )
tar -czf $OUT/r.tgz -C $R .
echo "== engine b64 $(date +%T)"
AB_WARMUP=0 QUANTW1_KINDS=int4 QUANTW1_BATCH=64 AB_RUNS="head:1" OUT=$R timeout 210 \
   bash benchmarks/run_ab.sh . quantw1 2>&1 | tail -5
grep -h "TPOT\|Roofline" $R/ab_log_quantw1.txt | tail -8
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
