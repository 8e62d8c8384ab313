#!/usr/bin/env bash
# Session 50 call 2: int4 wide tilings at 96 / 128 / 192 rows (call 1 on an H100: the rule's
# 128-row wT.dot tile 2.24 ms at 96 rows, 3.41 at 192, where XLA's form took 2.62 / 2.71).
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r2; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
T=("t128 n128 k128x1 s1 w8 st4 (wT.dot)" "t128 n128 k128x1 s1 w8 st3 (wT.dot)"
   "t64 n128 k128x1 s1 w4 st3 (dot)" "t64 n128 k128x1 s1 w4 st3 (wT.dot)"
   "t64 n128 k128x1 s2 w4 st3 (dot)" "t64 n128 k128x1 s1 w8 st3 (wT.dot)")
for t in 128 96 192; do
  echo "== sweep T=$t $(date +%T)"
  timeout 110 python3 -m pjinfer.benchmarks.quant_matmul --sweep --kinds int4 \
     --tokens $t --tilings "${T[@]}" --out $R/int4_wide_$t.json 2>&1 | grep -v -i warning | grep "T=\|best" | tail -14
  tar -czf $OUT/r.tgz -C $R .
done
echo "== done $(date +%T)"
