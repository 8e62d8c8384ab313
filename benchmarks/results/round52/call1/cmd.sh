#!/usr/bin/env bash
# Session 54 call 1. On an H200: the rows after rounds 48-51 (W1 int4 / fp8, Qwen3-30B-A3B
# batch 1 and 10 concurrent; 8 decode steps a call). On an H100: W1's decode step profiled
# at 2 sequence rows against 8 (fp8, then int4 GPTQ g128), each kernel's time.
set -u
export REPO=$(pwd) PY=python3
R=/tmp/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
cp .scratch/s54a.sh $R/cmd.sh
if grep -q H200 $R/gpu.txt; then
  MULTISTEP_MODELS="qwen3 int4 fp8 qwen3c10" MULTISTEP_RUNS="8:1" OUT=$R timeout 560 \
    bash benchmarks/run_h200.sh multistep 2>&1 | tail -3
  tar -czf $OUT/r.tgz -C $R .
  grep -h "TPOT median\|Roofline\|roofline" $R/bench_log_multistep.txt | tail -20
  exit 0
fi
source benchmarks/device_env.sh
for q in fp8 int4-gptq; do
  for sizes in "2 8 32 128 512" "8 32 128 512"; do
    tag=${q}_${sizes%% *}
    timeout 135 python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto \
      --quantization $q --cuda-graph-sizes $sizes --num-kv-blocks 2000 \
      --profile /tmp/prof-$tag --out $R/w1_${tag}_profile.json 2>&1 | grep -v -i warning | tail -2
    tar -czf $OUT/r.tgz -C $R .
  done
done
