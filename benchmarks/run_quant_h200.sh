#!/usr/bin/env bash
# Issue 14's H200 targets, from the repository root, writing JSON under $OUT (one GPU):
#
#   bash benchmarks/run_quant_h200.sh kernel     # W4A16/W8A16/fp8 matmul vs bf16      (~3 min)
#   bash benchmarks/run_quant_h200.sh w1         # batch-1 TPOT: bf16, GPTQ int4 g128, fp8,
#                                                #   int8 (dummy weights)               (~8 min)
#   bash benchmarks/run_quant_h200.sh w3         # W3 throughput, bf16 vs fp8 weights  (~8 min)
#   bash benchmarks/run_quant_h200.sh w4         # W4, bf16 KV vs fp8 KV; the records'
#                                                #   num_kv_blocks give the 8k capacity (~6 min)
#   bash benchmarks/run_quant_h200.sh --smoke kernel w1 w3 w4   # the plumbing, tiny, on CPU
#
# Llama-3-8B shapes, load_format dummy: quantized runs draw bf16 weights and quantize them
# (configs/models/llama3-8b-gptq-int4 carries a GPTQ 4-bit g128 quantization_config). The
# rooflines count the layers' bytes as stored (packed values + scales) and the KV cache's dtype.
set -uo pipefail

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/quant_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
source "$REPO/benchmarks/device_env.sh"
BENCH=($PY -m pjinfer.benchmarks.cli)
CACHE=/tmp/pjinfer-jax-cache
if [ $SMOKE = 1 ]; then
  BF16=(--dtype bfloat16); GPTQ=("${BF16[@]}" --quantization int8)   # demo model: no GPTQ shape
  ENGINE=(--max-num-seqs 8 --max-num-batched-tokens 64)
  KERNEL=(--matrices 2 --k 256 --n 256 --tokens 1 16 --samples 1 --calls 1)
  W1=(--input-len 16 --output-len 8 --num-iters 1); W3=(--num-prompts 4 --input-len 16
      --output-len 4); W4=(--num-prompts 4); T=300
else
  BF16=(--model configs/models/llama3-8b --load-format dummy --dtype bfloat16)
  GPTQ=(--model configs/models/llama3-8b-gptq-int4 --load-format dummy --dtype bfloat16)
  ENGINE=(--max-num-seqs 512 --max-num-batched-tokens 2048)
  KERNEL=()
  W1=(--input-len 512 --output-len 512 --num-iters 3); W3=(--num-prompts 1000 --input-len 1024
      --output-len 256); W4=(--num-prompts 1000); T=0
fi

run() {  # run NAME SECONDS CMD...: time-limited, logged, never stops the script
  local name=$1 limit=$2; shift 2
  [ $T -gt 0 ] && limit=$T
  echo "[$(date +%H:%M:%S)] START $name: $*" | tee -a "$OUT/log.txt"
  timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$OUT/log.txt" 2>&1
  echo "[$(date +%H:%M:%S)] END $name rc=$?" | tee -a "$OUT/log.txt"
}

for stage in "$@"; do
  case $stage in
    kernel) run quant_matmul 200 $PY benchmarks/quant_matmul.py "${KERNEL[@]}" \
                --out "$OUT/quant_matmul.json" ;;
    w1) for v in bf16 int4 fp8 int8; do
          case $v in bf16) M=("${BF16[@]}");; int4) M=("${GPTQ[@]}");;
                     *) M=("${BF16[@]}" --quantization $v);; esac
          run "w1_$v" 150 "${BENCH[@]}" latency "${M[@]}" "${ENGINE[@]}" \
              --compilation-cache-dir "$CACHE" --batch-size 1 "${W1[@]}" --num-iters-warmup 1 \
              --output-json "$OUT/w1_$v.json"
        done ;;
    w3) for v in bf16 fp8; do
          M=("${BF16[@]}"); [ $v = fp8 ] && M+=(--quantization fp8)
          run "w3_$v" 270 "${BENCH[@]}" throughput "${M[@]}" "${ENGINE[@]}" \
              --compilation-cache-dir "$CACHE" "${W3[@]}" --warmup-requests 8 \
              --output-json "$OUT/w3_$v.json"
        done ;;
    w4) for kv in auto fp8; do
          run "w4_kv_$kv" 180 "${BENCH[@]}" throughput "${BF16[@]}" "${ENGINE[@]}" \
              --kv-cache-dtype $kv --compilation-cache-dir "$CACHE" \
              --dataset synthetic-sharegpt "${W4[@]}" --warmup-requests 8 \
              --output-json "$OUT/w4_kv_$kv.json"
        done ;;
    *) echo "unknown stage $stage (kernel, w1, w3, w4)"; exit 2 ;;
  esac
done
