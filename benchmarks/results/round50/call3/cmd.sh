#!/usr/bin/env bash
# Session 52 call 3 (same machine, warm): W1's int4 (GPTQ g128) and bf16 decode steps profiled
export REPO=$(pwd) PY=python3; source benchmarks/device_env.sh; mkdir -p $OUT
timeout 170 python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --quantization int4-gptq \
  --num-kv-blocks 2000 --profile /tmp/prof-int4 --out $OUT/w1_int4_profile.json 2>&1 | grep -v -i warning | tail -3
timeout 60 python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --num-kv-blocks 2000 \
  --profile /tmp/prof-bf16 --out $OUT/w1_bf16_profile.json 2>&1 | grep -v -i warning | tail -2
