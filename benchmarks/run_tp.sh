#!/usr/bin/env bash
# Tensor-parallel acceptance runs (GitHub issue "Sharding") on one host with 2 GPUs, from the
# repository root, writing under $OUT; the whole script fits one 10-minute device command.
#
#   bash benchmarks/run_tp.sh                  # tp1 tp2 70b                          (~9 min)
#   bash benchmarks/run_tp.sh 70b              # only the Llama-3-70B stage           (~4-5 min)
#   XLA_FLAGS=--xla_force_host_platform_device_count=2 bash benchmarks/run_tp.sh --smoke
#                                              # the same plumbing, tiny, demo model, on CPU
#
# Stages (dummy bf16 weights from configs/models/*, nothing downloaded):
#   tp1  Llama-3-8B on GPU 0 (CUDA_VISIBLE_DEVICES=0): throughput 200 x 1024/128, then latency
#        batch 1 512/128 (TPOT) and batch 8 32/128; --max-num-seqs 256 --max-num-batched-tokens
#        2048. Throughput runs first: its engine warm-up fills the compilation cache that the
#        latency runs (same engine flags) then hit.
#   tp2  the same three runs at --tensor-parallel-size 2.
#   70b  Llama-3-70B at tp=2 with a small bucket grid (--max-num-seqs 32
#        --max-num-batched-tokens 512 --max-model-len 4096, fixed --num-kv-blocks so every
#        process compiles identical programs): the OpenAI server driven by `bench serve`
#        (synthetic-sharegpt, 64 prompts at 2 req/s; needs starlette + uvicorn, e.g. carried
#        as wheels in .whl/), then latency batch 1 512/128, whose steps the server's warm-up
#        already put in the compilation cache.
#
# Every step has its own time limit and the script a total budget ($BUDGET seconds, default
# 570): a step gets at most what is left, and is skipped (logged) when less than half its
# limit is left, so the steps that ran still report. A failed step is logged and skipped.
# Results: one JSON per step (tp1_throughput.json, tp1_w1_latency.json, tp2_w2_latency.json,
# tp2_70b_serve.json, ...), all in $OUT/bench_json.tar.gz (re-packed after every step), the
# log in $OUT/bench_log.txt. The roofline fields of tp=2 records use one device's measured
# ceilings and a single-device roofline (weights read by one GPU): read them as relative to tp=1.
# On the device, carry the wheels: run with carry [".whl"] (.whl/ is git-ignored).
set -uo pipefail

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tp1 tp2 70b)
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/run_tp_$(date +%Y%m%d_%H%M%S)}
JSON=/tmp/pjinfer-bench-tp/json   # outside $OUT: the device returns at most 8 files
rm -rf "$JSON" && mkdir -p "$JSON" "$OUT"
LOG=$OUT/bench_log.txt
PY=${PYTHON:-python3}
# Environment, carried wheels, `pjinfer` importable from the checkout.
source "$REPO/benchmarks/device_env.sh"

if [ $SMOKE = 1 ]; then
  # Two CPU devices, so tp=2 has a mesh to shard over.
  case "${XLA_FLAGS:-}" in
    *xla_force_host_platform_device_count*) ;;
    *) export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=2" ;;
  esac
  M8=()                          # the embedded demo model stands in for both models
  M70=()
  E8=(--max-num-seqs 8 --max-num-batched-tokens 64)
  E70=(--max-num-seqs 8 --max-num-batched-tokens 64 --max-model-len 512)
  TH=(--num-prompts 8 --input-len 32 --output-len 8 --warmup-requests 2)
  W1=(--batch-size 1 --input-len 16 --output-len 8 --num-iters 2 --num-iters-warmup 1)
  W2=(--batch-size 2 --input-len 8 --output-len 6 --num-iters 2 --num-iters-warmup 1)
  SERVE=(--num-prompts 6 --request-rate 16)
  W1_70=("${W1[@]}")
  BUDGET=${BUDGET:-3600}; T=300; READY=300
else
  M8=(--model configs/models/llama3-8b --load-format dummy --dtype bfloat16)
  M70=(--model configs/models/llama3-70b --load-format dummy --dtype bfloat16)
  E8=(--max-num-seqs 256 --max-num-batched-tokens 2048)
  # 13 step shapes (seq buckets 8, 32 x token buckets 16..512) instead of 28: 80 layers
  # unrolled compile ~2.5x longer per shape than 8B's 32. 4096 blocks = 64k tokens (~10.7 GB
  # of KV per GPU at tp=2), fixed so server and latency processes compile the same cache shape.
  E70=(--max-num-seqs 32 --max-num-batched-tokens 512 --max-model-len 4096 --num-kv-blocks 4096)
  TH=(--num-prompts 200 --input-len 1024 --output-len 128 --warmup-requests 8)
  W1=(--batch-size 1 --input-len 512 --output-len 128 --num-iters 5 --num-iters-warmup 1)
  W2=(--batch-size 8 --input-len 32 --output-len 128 --num-iters 5 --num-iters-warmup 1)
  SERVE=(--num-prompts 64 --request-rate 2)
  W1_70=(--batch-size 1 --input-len 512 --output-len 128 --num-iters 3 --num-iters-warmup 1)
  BUDGET=${BUDGET:-570}; T=0; READY=270
fi
CACHE=/tmp/pjinfer-jax-cache
# cache NAME: the compilation cache folder of one step. On the GPU all steps share one, so
# latency runs reuse what the throughput run or the server compiled. On CPU (smoke) every step
# gets a fresh one: XLA:CPU executables reloaded from a cache another process wrote
# intermittently fail to dispatch ("Function <fusion> not found"; seen with jax 0.10.2).
cache() { if [ $SMOKE = 1 ]; then echo "$CACHE-smoke/$1"; else echo "$CACHE"; fi; }
[ $SMOKE = 1 ] && rm -rf "$CACHE-smoke"
BENCH=($PY -m pjinfer.benchmarks.cli)
GPU0=(env CUDA_VISIBLE_DEVICES=0)

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
pack() { tar -C "$(dirname "$JSON")" -czf "$OUT/bench_json.tar.gz" json 2>/dev/null; }
left() { echo $((BUDGET - SECONDS)); }
# step NAME SECONDS CMD...: run with a time limit (T in smoke mode), cut to what is left of the
# budget; skipped when less than half the limit is left. Logs its output, keeps going on failure.
step() {
  local name=$1 limit=$2; shift 2
  [ $SMOKE = 1 ] && limit=$T
  local rem=$(( $(left) - 5 ))
  if [ $rem -lt $((limit / 2)) ]; then
    log "SKIP $name: ${rem}s left of the ${BUDGET}s budget, limit ${limit}s"; return 0
  fi
  [ $limit -gt $rem ] && limit=$rem
  log "START $name (limit ${limit}s): $*"
  local t0=$SECONDS
  run_step timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  log "END $name rc=$rc in $((SECONDS - t0))s"
  pack
  return 0
}

# stage_8b TAG TP [PREFIX...]: throughput, then W1 and W2 latency, all one engine configuration.
stage_8b() {
  local tag=$1 tp=$2; shift 2
  local pre=("$@")
  local common=("${M8[@]}" "${E8[@]}" --tensor-parallel-size "$tp")
  step "${tag}_throughput" 170 "${pre[@]}" "${BENCH[@]}" throughput "${common[@]}" "${TH[@]}" \
      --compilation-cache-dir "$(cache "${tag}_throughput")" --no-progress \
      --output-json "$JSON/${tag}_throughput.json"
  step "${tag}_w1_latency" 90 "${pre[@]}" "${BENCH[@]}" latency "${common[@]}" "${W1[@]}" \
      --compilation-cache-dir "$(cache "${tag}_w1_latency")" \
      --output-json "$JSON/${tag}_w1_latency.json"
  step "${tag}_w2_latency" 90 "${pre[@]}" "${BENCH[@]}" latency "${common[@]}" "${W2[@]}" \
      --compilation-cache-dir "$(cache "${tag}_w2_latency")" \
      --output-json "$JSON/${tag}_w2_latency.json"
}

stage_70b() {
  local common=("${M70[@]}" "${E70[@]}" --tensor-parallel-size 2)
  serve_70b "${common[@]}" --compilation-cache-dir "$(cache tp2_70b_server)"
  step tp2_70b_w1_latency 150 "${BENCH[@]}" latency "${common[@]}" "${W1_70[@]}" \
      --compilation-cache-dir "$(cache tp2_70b_w1_latency)" \
      --output-json "$JSON/tp2_70b_w1_latency.json"
}

# The OpenAI server at tp=2 (engine warm-up on: every step shape compiled before it answers
# /health), driven over HTTP by `bench serve`; the server is stopped before the next step.
serve_70b() {
  if ! $PY -c "import starlette, uvicorn" 2>/dev/null; then
    log "SKIP tp2_70b_serve: starlette/uvicorn missing (carry them as wheels in .whl/)"
    return 0
  fi
  local need=75   # seconds the serve benchmark needs once the server is up
  [ $SMOKE = 1 ] && need=60
  local wait=$READY rem=$(( $(left) - need ))
  [ $wait -gt $rem ] && wait=$rem
  if [ $wait -lt 60 ]; then log "SKIP tp2_70b_serve: ${rem}s left for the server start"; return 0; fi
  local port=8124
  log "START tp2_70b_server (ready within ${wait}s): launch_server $*"
  local t0=$SECONDS
  $PY -m pjinfer.benchmarks.launch_server "$@" --port $port >>"$LOG" 2>&1 &
  local server=$!
  local ready=0
  while [ $((SECONDS - t0)) -lt "$wait" ]; do
    if $PY -c "import httpx; httpx.get('http://127.0.0.1:$port/health').raise_for_status()" \
        2>/dev/null; then ready=1; break; fi
    kill -0 $server 2>/dev/null || break
    sleep 1
  done
  local ready_s=$((SECONDS - t0))
  $PY - "$JSON/tp2_70b_server_startup.json" "$ready" "$ready_s" "$@" <<'EOF'
import json, sys
path, ready, seconds, *argv = sys.argv[1:]
json.dump({"command": "launch_server", "argv": argv, "healthy": ready == "1",
           "healthy_after_s": int(seconds),
           "note": "wall time from process start to /health OK (load + warm-up compile)"},
          open(path, "w"), indent=2)
EOF
  if [ $ready = 1 ]; then
    log "tp2_70b_server healthy after ${ready_s}s"
    step tp2_70b_serve 120 "${BENCH[@]}" serve --base-url "http://127.0.0.1:$port" \
        "${M70[@]:0:2}" --dataset synthetic-sharegpt "${SERVE[@]}" --no-progress \
        --output-json "$JSON/tp2_70b_serve.json"
  else
    log "FAIL tp2_70b_serve: the server did not become healthy in ${ready_s}s"
  fi
  # SIGTERM (uvicorn shuts down gracefully), then SIGKILL: the GPUs must be free for the next.
  kill $server 2>/dev/null
  for _ in $(seq 1 20); do kill -0 $server 2>/dev/null || break; sleep 1; done
  kill -9 $server 2>/dev/null
  wait $server 2>/dev/null
  log "tp2_70b_server stopped"
  pack
}

log "stages: ${STAGES[*]} smoke=$SMOKE budget=${BUDGET}s repo=$REPO out=$OUT"
[ -d "$CACHE" ] && log "compilation cache $CACHE already holds $(ls "$CACHE" | wc -l) entries"
$PY -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())" \
    2>&1 | tee -a "$LOG"
for stage in "${STAGES[@]}"; do
  case $stage in
    tp1) stage_8b tp1 1 "${GPU0[@]}" ;;
    tp2) stage_8b tp2 2 ;;
    70b) stage_70b ;;
    *) log "unknown stage $stage (tp1 | tp2 | 70b)" ;;
  esac
done
pack
log "done in ${SECONDS}s; JSON files: $(ls "$JSON" | tr '\n' ' ')"
