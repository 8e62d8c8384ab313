#!/usr/bin/env bash
# Session 50 call 6: int4 at 1, 8 and 16 rows over each Llama-3-8B decode projection (32 a
# shape): does a 16-row tile over 8 real rows (x read through clamped rows) cost more than
# one over 16 whole rows? If so, padding x at decode pays.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r6; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
for shape in "4096 28672" "14336 4096" "4096 6144" "4096 4096"; do
  set -- $shape
  echo "== $1 x $2 $(date +%T)"
  timeout 70 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 --tokens 1 8 16 \
     --matrices 32 --k $1 --n $2 --out $R/int4_${1}x${2}.json 2>&1 | grep -v -i warning | grep "T="
  tar -czf $OUT/r.tgz -C $R .
done
echo "== done $(date +%T)"
