#!/usr/bin/env bash
# Session 50 call 9: Mixtral-8x7B, the split form (--fused 3, chunk 128) against the engine's
# routed pair as the engine tiles it (epilogue 128 columns, down in 4 K ranges: call 8's pair
# ran down in one range), at 1 and 8 tokens.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r9; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
timeout 90 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 8 \
   --fused 2 3 --swiglu-block-n 128 --down-k-splits 4 --models mixtral-8x7b \
   --out $R/split_mixtral_q4.json 2>&1 | grep -v -i warning | grep "T="
tar -czf $OUT/r.tgz -C $R .
