#!/usr/bin/env bash
# Session 51 call 6: profile a stack of 24 int4 GEMVs (4096 x 14336 g128): Triton kernel,
# Mosaic probe kernel (K ranges 4 and 1), bf16; kernels, busy time and gaps per call
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r6; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
timeout 240 python3 .scratch/int4_profile.py $R/int4_profile.json 2>&1 | grep -v -i "warning" | grep -v "cuda_event.cc" | tail -20
tar -czf $OUT/r.tgz -C $R .
