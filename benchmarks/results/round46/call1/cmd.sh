#!/usr/bin/env bash
# Session 47, short call: fix 3's int4 8-step probe, XLA's int4 forms, the int4 engine at b64.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r; mkdir -p $R
pack() { tar -czf $OUT/r.tgz -C $R . ; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $R/gpu.txt
probe() {  # probe NAME QUANT STEPS DUMP
  local name=$1 q=$2 s=$3 d=$4 qa=()
  [ $q != none ] && qa=(--quantization $q)
  rm -rf /tmp/xd
  if [ $d = 1 ]; then export XLA_FLAGS="--xla_dump_to=/tmp/xd --xla_dump_hlo_module_re=multi_decode|packed_step"; else unset XLA_FLAGS; fi
  echo "== $name $(date +%T)"
  timeout 150 python3 benchmarks/step_probe.py --backends auto --layouts decode_64x512 \
     --num-kv-blocks 8000 "${qa[@]}" --num-scheduler-steps $s --out $R/mem_$name.json
  unset XLA_FLAGS
  [ $d = 1 ] && timeout 60 python3 -m pjinfer.benchmarks.buffer_assignment /tmp/xd --top 12 --out $R/ba_$name.json
  pack
}
probe int4_8 int4-gptq 8 1

echo "== int4 forms $(date +%T)"
timeout 150 python3 -m pjinfer.benchmarks.int4_xla_forms --tokens 128 512 --calls 5 \
    --out $R/int4_forms.json 2>&1 | grep -v Warning
pack
echo "== engine int4 b64 $(date +%T)"
OUT=$R AB_WARMUP=0 QUANTW1_KINDS=int4 QUANTW1_BATCH=64 AB_RUNS="head:1" timeout 150 bash benchmarks/run_ab.sh . quantw1
grep -v "request bench" $R/ab_log_quantw1.txt | tail -25
pack
echo "== done $(date +%T)"
