#!/usr/bin/env bash
# Session 50 call 3: int4 with x padded to whole wide tiles (head) against 45201c2 (base,
# .bench_base) at 96-256 rows; head's defaults timed through --sweep (relative errors kept).
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r3; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
for t in 96 128 160 192 224 256; do
  echo "== head T=$t $(date +%T)"
  timeout 60 python3 -m pjinfer.benchmarks.quant_matmul --sweep --kinds int4 --tokens $t \
     --tilings "t64 n128 k128x1 s1 w4 st3 (wT.dot)" --out $R/head_$t.json 2>&1 \
     | grep -v -i warning | grep "T=\|best" | tail -4
  tar -czf $OUT/r.tgz -C $R .
done
echo "== base $(date +%T)"
( eval "$(bash benchmarks/make_shim.sh .bench_base /tmp/shim-base)"
  cd /tmp && timeout 120 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 \
     --tokens 96 160 192 224 --out $R/base.json 2>&1 | grep -v -i warning | tail -12 )
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
