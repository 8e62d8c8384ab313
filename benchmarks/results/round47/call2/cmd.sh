#!/usr/bin/env bash
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r2; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader
T=("t64 n128 k128x1 s1 w4 st3 (dot)" "t64 n128 k128x1 s1 w8 st3 (dot)"
   "t64 n128 k128x1 s1 w8 st3 (wT.dot)" "t64 n128 k128x1 s1 w4 st3 (wT.dot)"
   "t64 n128 k128x1 s2 w4 st3 (dot)" "t64 n128 k128x1 s1 w4 st4 (dot)"
   "t64 n64 k128x1 s1 w4 st3 (dot)" "t128 n128 k128x1 s1 w8 st3 (dot)" "t128 n128 k128x1 s1 w8 st4 (wT.dot)")
for t in 64 128 256 512; do
  echo "== sweep T=$t $(date +%T)"
  timeout 100 python3 -m pjinfer.benchmarks.quant_matmul --sweep --kinds int4 \
     --tokens $t --tilings "${T[@]}" --out $R/int4_wide_$t.json 2>&1 | grep -v -i warning | grep "T=\|best" | tail -14
  tar -czf $OUT/r.tgz -C $R .
done
echo "== xla 256 512 $(date +%T)"
timeout 80 python3 -m pjinfer.benchmarks.quant_matmul --kinds int4 --tokens 256 512 --out $R/int4_base_256_512.json 2>&1 | grep -v -i warning | tail -8
tar -czf $OUT/r.tgz -C $R .
