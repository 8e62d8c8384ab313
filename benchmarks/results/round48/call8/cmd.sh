#!/usr/bin/env bash
# Session 50 call 8: the one-launch routed SwiGLU (`routed_ffn_split`, --fused 3) at wider I
# chunks beside the engine's routed pair (--fused 2, the activation in gate/up's epilogue):
# call 7 timed one chunk a model (the benchmark kept only the first --swiglu-block-n for 3).
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r8; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
echo "== qwen3 $(date +%T)"
timeout 140 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 8 \
   --fused 2 3 --swiglu-block-n 32 64 128 --models qwen3-30b-a3b --k-splits 2 \
   --out $R/split_qwen3.json 2>&1 | grep -v -i warning | grep "T="
tar -czf $OUT/r.tgz -C $R .
echo "== mixtral $(date +%T)"
timeout 100 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 \
   --fused 2 3 --swiglu-block-n 128 256 --models mixtral-8x7b \
   --out $R/split_mixtral.json 2>&1 | grep -v -i warning | grep "T="
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
