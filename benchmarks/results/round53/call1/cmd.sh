#!/usr/bin/env bash
# Session 55. On an H200: the rows after rounds 48-52 (Qwen3-30B-A3B batch 1 and 10
# concurrent, W1 int4 / fp8, Mixtral-8x7B batch 1; 8 decode steps a call), from `main`.
# On an H100: round 52's few-splits patch measured: W1 int4 ABBA and fp8 AB, head = main +
# patch, base = .bench_base (main); then paged decode attention at 5 / 8 / 9 / 17 splits at
# batch 1 (Llama-3-8B heads, the 8-sequence bucket), device time and kernels a call.
# Results are tarred every 20 s, so a call cut short still returns what it had.
set -u
export REPO=$(pwd) PY=python3
R=/tmp/r; mkdir -p $R/ab
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
cp .scratch/s55a.sh $R/cmd.sh
( while sleep 20; do tar -czf $OUT/r.tmp.tgz -C $R . 2>/dev/null && mv $OUT/r.tmp.tgz $OUT/r.tgz; done ) &
TARRER=$!
if grep -q H200 $R/gpu.txt; then
  MULTISTEP_MODELS="qwen3 int4 fp8 qwen3c10 mixtral" MULTISTEP_RUNS="8:1" OUT=$R timeout 400 \
    bash benchmarks/run_h200.sh multistep 2>&1 | tail -3
  kill $TARRER; tar -czf $OUT/r.tgz -C $R .
  grep -h "TPOT median\|Roofline\|roofline" $R/bench_log_multistep.txt | tail -24
  exit 0
fi
P=benchmarks/results/round52/few_splits.patch.txt
git apply $P 2>/dev/null || patch -p1 < $P
grep -q "^FEW_SPLITS = 8" kernels/decode_attention.py || { echo "patch not applied"; exit 4; }
AB_WARMUP=0 QUANTW1_KINDS=int4 AB_RUNS="head:1 base:1 base:2 head:2" OUT=$R/ab timeout 270 \
  bash benchmarks/run_ab.sh .bench_base quantw1 2>&1 | tail -2
AB_WARMUP=0 QUANTW1_KINDS=fp8 AB_RUNS="head:1 base:1" OUT=$R/ab timeout 150 \
  bash benchmarks/run_ab.sh .bench_base quantw1 2>&1 | tail -2
grep -h "START\|TPOT median\|Roofline TPOT" $R/ab/ab_log_quantw1.txt | cut -c1-110
( source benchmarks/device_env.sh
S="--splits 5 8 9 17 --pages 8 --device-time --seqs 1 --max-model-len 2048 --samples 3"
timeout 45 python3 -m pjinfer.benchmarks.decode_splits $S --heads 32 --kv-heads 8 \
  --padded-seqs 8 --context 768 --out $R/splits_llama_8x768.json 2>&1 | grep -v -i warning \
  | grep "pages\|rror" )
kill $TARRER; tar -czf $OUT/r.tgz -C $R .
