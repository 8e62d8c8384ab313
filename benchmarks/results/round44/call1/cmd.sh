#!/usr/bin/env bash
# Round 44 call 1: fix 2 (multi-step barrier) on the GPU; int4 dot-merger question; int4 engine b64.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r; mkdir -p $R
pack() { tar -czf $OUT/r.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt; python3 -c "import jax;print(jax.__version__, jax.devices())" >> $R/gpu.txt 2>&1
probe() {  # probe NAME QUANT STEPS DUMP
  local name=$1 q=$2 s=$3 d=$4 qa=()
  [ $q != none ] && qa=(--quantization $q)
  rm -rf /tmp/xd
  if [ $d = 1 ]; then export XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_module_re=multi_decode|packed_step"; else unset XLA_FLAGS; fi
  echo "== $name $(date +%T)"
  timeout 150 python3 benchmarks/step_probe.py --backends auto --layouts decode_64x512 \
     --num-kv-blocks 8000 "${qa[@]}" --num-scheduler-steps $s --out $R/mem_$name.json
  unset XLA_FLAGS
  if [ $d = 1 ]; then timeout 60 python3 -m pjinfer.benchmarks.buffer_assignment /tmp/xd --top 40 --out $R/ba_$name.json; 
    grep -l "" /tmp/xd/*buffer-assignment* | head -3
    for f in /tmp/xd/*after_optimizations.txt; do echo "$f concat: $(grep -c ' concatenate(' $f) dot-like: $(grep -c 'cublas-gemm\|__triton_gemm' $f)"; done; fi
  pack
}
probe int4_8 int4-gptq 8 1
probe int4_1 int4-gptq 1 1
probe fp8_8 fp8 8 0
probe bf16_8 none 8 0
echo "== engine int4 b64 $(date +%T)"
OUT=$R AB_WARMUP=0 QUANTW1_KINDS=int4 QUANTW1_BATCH=64 AB_RUNS="head:1" timeout 240 bash benchmarks/run_ab.sh . quantw1
pack
echo "== done $(date +%T)"
