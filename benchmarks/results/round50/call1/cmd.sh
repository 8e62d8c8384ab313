#!/usr/bin/env bash
# Session 52 call 1: (a) W1's quantized decode step profiled (Llama-3-8B shapes, int4 GPTQ
# g128 and fp8, one sequence in the 8-row bucket): each kernel with the idle time before it;
# (b) W1 int4 at batch 1, default buckets (8 rows) against a 1-row bucket; (c) the one-launch
# routed FFN where the engine runs it (Mixtral-8x7B, one real token in the 8-row bucket).
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r1; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
echo "== profiles $(date +%T)"
for q in fp8 int4-gptq; do
  timeout 150 python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto \
     --quantization $q --profile /tmp/prof-$q --out $R/w1_${q}_profile.json 2>&1 \
     | grep -v -i warning | tail -2
  tar -czf $OUT/r.tgz -C $R .
done
echo "== w1 int4 buckets $(date +%T)"
HEAD_FLAGS="--cuda-graph-sizes 1 8 32 128 512" AB_WARMUP=0 QUANTW1_KINDS=int4 \
  AB_RUNS="base:1 head:1" OUT=$R timeout 300 bash benchmarks/run_ab.sh . quantw1 2>&1 | tail -3
grep -h "TPOT median\|Roofline TPOT" $R/ab_log_quantw1.txt | tail -6
tar -czf $OUT/r.tgz -C $R .
echo "== split $(date +%T)"
timeout 120 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 --padded-rows 8 \
   --fused 2 3 --swiglu-block-n 128 --down-k-splits 4 --models mixtral-8x7b --check \
   --out $R/split_mixtral_padded8.json > $R/split_log.txt 2>&1
grep -v -i warning $R/split_log.txt | grep "T=\|check\|rel" | head -8
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
