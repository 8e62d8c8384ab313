#!/usr/bin/env bash
# Session 51 call 1: the one-launch routed SwiGLU at Mixtral-8x7B's shapes (chunk 128, the
# pair's down in 4 K ranges) against the pair, with the compiled check; on an H200 also the
# int4 rows and the Mixtral batch-1 row.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
echo "== mixtral split $(date +%T)"
timeout 170 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 8 \
   --fused 2 3 --swiglu-block-n 128 --down-k-splits 4 --models mixtral-8x7b --check \
   --out $R/split_mixtral.json 2>&1 | grep -v -i warning | grep -i "T=\|error\|check" | head -40
tar -czf $OUT/r.tgz -C $R .
if grep -q H200 $R/gpu.txt; then
  echo "== int4 rows $(date +%T)"
  timeout 100 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 --tokens 1 96 160 192 224 \
     --out $R/int4_rows_h200.json 2>&1 | grep -v -i warning | grep "T=" | head -20
  tar -czf $OUT/r.tgz -C $R .
  echo "== mixtral b1 $(date +%T)"
  MULTISTEP_MODELS="mixtral" MULTISTEP_RUNS="8:1" OUT=$R timeout 230 \
     bash benchmarks/run_h200.sh multistep 2>&1 | tail -3
  grep -h "TPOT median\|Roofline TPOT\|share" $R/bench_log_multistep.txt | tail -4
fi
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
