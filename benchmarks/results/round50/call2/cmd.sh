#!/usr/bin/env bash
# Session 52 call 2 (call 1's machine, warm): call 1's profiles had run out of memory (the
# probe's default 40,000 KV blocks are ~80 GB for Llama-3-8B: an H200's size); W1's fp8 decode
# step profiled with 2,000 blocks, each kernel with the idle time before it.
export REPO=$(pwd) PY=python3; source benchmarks/device_env.sh; mkdir -p $OUT
timeout 190 python3 benchmarks/step_probe.py --layouts decode_1x768 --backends auto --quantization fp8 \
  --num-kv-blocks 2000 --profile /tmp/prof-fp8 --out $OUT/w1_fp8_profile.json 2>&1 | grep -v -i warning | tail -3
