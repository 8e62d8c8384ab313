#!/usr/bin/env bash
# Session 49 call 4 (H200, warm, needs_h200), from the repository root:
export REPO=$(pwd); MULTISTEP_MODELS="mixtral" MULTISTEP_RUNS="8:1" timeout 250 bash benchmarks/run_h200.sh multistep
N_W3=300 timeout 320 bash benchmarks/run_h200.sh w3fp8
