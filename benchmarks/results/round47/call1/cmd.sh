#!/usr/bin/env bash
# Session 49: H200 -> routed decode row (qwen3) then int4 rows at 64/128; H100 -> int4 rows 64-512.
set -u
export REPO=$(pwd) PY=python3
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $OUT/gpu.txt
if [[ $gpu == *H200* ]]; then
  timeout 230 bash -c 'source benchmarks/device_env.sh; R=/tmp/r; mkdir -p $R; \
    python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 8 --fused 0 1 2 \
      --swiglu-block-n 32 64 128 --models qwen3-30b-a3b --k-splits 2 \
      --out $R/routed_ffn_qwen3.json 2>&1 | grep -v -i warning | tail -30; \
    tar -czf $OUT/routed.tgz -C $R .'
  INT4ROWS_TOKENS="64 128" timeout 330 bash benchmarks/run_h200.sh int4rows
else
  timeout 580 bash benchmarks/run_h200.sh int4rows
fi
echo "== done $(date +%T)"
