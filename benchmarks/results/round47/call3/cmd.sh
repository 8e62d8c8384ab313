#!/usr/bin/env bash
# Session 49 call 3 (H200, warm after calls 1-2), from the repository root:
export REPO=$(pwd); MULTISTEP_MODELS="qwen3 int4 fp8 qwen3c10" MULTISTEP_RUNS="8:1" timeout 585 bash benchmarks/run_h200.sh multistep
