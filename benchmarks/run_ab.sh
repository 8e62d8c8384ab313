#!/usr/bin/env bash
# Before/after in one device call: the same workloads from two checkouts, interleaved, so a
# change is measured against its baseline on the same GPU minutes apart.
#
#   git archive BASE_COMMIT | (mkdir -p .bench_base && tar -x -C .bench_base)  # here, once
#   bash benchmarks/run_ab.sh .bench_base probe    # step probe + W1 (ABBA) + W2, both trees
#                                                  # (~9 min)
#   bash benchmarks/run_ab.sh .bench_base w3       # W3, both trees                (~6 min)
#   bash benchmarks/run_ab.sh .bench_base qwen3    # Qwen3-30B-A3B W1, 8 steps a call, ABBA
#                                                  # (~8 min)
#   bash benchmarks/run_ab.sh .bench_base qwen3c10  # Qwen3-30B-A3B, 10 x 2,048 in / 256 out,
#                                                   # ABBA (~8 min)
#   bash benchmarks/run_ab.sh .bench_base quantw1  # W1 int4 then fp8, 8 steps a call, ABBA
#                                                  # (~7 min)
#   bash benchmarks/run_ab.sh .bench_base decodesplits  # the decode_splits sweeps in DS_ARGS
#                                                  # (";" between sweeps), base then head, twice
#                                                  # (~1 min a sweep and tree)
#   bash benchmarks/run_ab.sh .bench_base ragged   # the ragged kernel's quick tiling sweep on
#                                                  # W3/W4 layouts, base then head (~4 min;
#                                                  # RAGGED_LAYOUTS overrides the layouts,
#                                                  # RAGGED_KV=float8_e4m3fn the cache dtype;
#                                                  # by device time; RAGGED_FLAGS=" " times by
#                                                  # wall clock, as a base older than round 25
#                                                  # must)
#   bash benchmarks/run_ab.sh --smoke .bench_base probe   # the same plumbing, tiny, on CPU
#
# AB_FLAGS: engine flags added to both sides' runs (e.g. "--cuda-graph-sizes 2 8 32 128 512");
# HEAD_FLAGS: to the head's only (a flag against the default, with a base archived from HEAD);
# HEAD_ENV: environment for the head's runs only (e.g. "XLA_FLAGS=--xla_gpu_enable_pdl=false").
# qwen3, qwen3c10, quantw1: AB_RUNS replaces the ABBA order (e.g. "head:1 base:1" when
# device time is short); qwen3, qwen3c10: AB_WARMUP=0 drops the throwaway first run, AB_MODEL
# replaces the Qwen3-30B-A3B model folder (e.g. configs/models/qwen3-30b-a3b-fp8).
# JSON records land in $OUT as {base,head}_<workload>.json (W1: w1_1 and w1_2 per side), the
# log in $OUT/ab_log_<stage>.txt.
set -uo pipefail

SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
BASE=$(cd "$1" && pwd); STAGE=$2
REPO=$(pwd)
OUT=${OUT:-$REPO/benchmarks/results/ab_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT"
LOG=$OUT/ab_log_$STAGE.txt
PY=${PYTHON:-python3}
source "$REPO/benchmarks/device_env.sh"
# One memory pool for both trees: a base older than round 26 left XLA's default 75% to its
# offline runs (the KV cache sized from it), the head claims gpu_memory_utilization's 90%.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

if [ $SMOKE = 1 ]; then
  MODEL=(); ENGINE=(--max-num-seqs 8 --max-num-batched-tokens 64)
  W1=(--batch-size 1 --input-len 16 --output-len 8 --num-iters 2)
  W2=(--batch-size 2 --input-len 8 --output-len 6 --num-iters 2)
  W3=(--num-prompts 4 --input-len 16 --output-len 4); LIMIT=180
else
  MODEL=(--model configs/models/llama3-8b --load-format dummy --dtype bfloat16)
  ENGINE=(--max-num-seqs 512 --max-num-batched-tokens 2048)
  W1=(--batch-size 1 --input-len 512 --output-len 512 --num-iters 3)
  W2=(--batch-size 8 --input-len 32 --output-len 128 --num-iters 5)
  W3=(--num-prompts 1000 --input-len 1024 --output-len 256); LIMIT=270
fi

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# AB_RUNS / AB_WARMUP checked before any device work: an entry naming neither tree would
# otherwise run the head's (in_tree's default) under the wrong name
for run in ${AB_RUNS:-}; do
  case $run in
    base:?*|head:?*) ;;
    *) log "AB_RUNS entry '$run' must be base:N or head:N (e.g. AB_RUNS=\"head:1 base:1\")"
       exit 2 ;;
  esac
done
case ${AB_WARMUP:-1} in
  0|1) ;;
  *) log "AB_WARMUP must be 0 or 1, got '$AB_WARMUP'"; exit 2 ;;
esac

# in_tree NAME CMD...: run CMD from checkout NAME (base|head) with that checkout as `pjinfer`.
in_tree() {
  local name=$1; shift
  local dir=$REPO; [ "$name" = base ] && dir=$BASE
  log "START $name: $*"
  local t0=$SECONDS
  run_step in_checkout "$dir" "$name" "$@" >>"$LOG" 2>&1
  log "END $name rc=$? in $((SECONDS - t0))s"
}

in_checkout() {  # in_checkout DIR NAME CMD...: (in run_step's subshell) CMD from DIR's tree
  local dir=$1 name=$2; shift 2
  local head_env=(); [ "$name" = head ] && read -ra head_env <<< "${HEAD_ENV:-}"
  cd "$dir" && eval "$(bash "$REPO/benchmarks/make_shim.sh" "$dir" "/tmp/shim-$name")" \
    && env "${head_env[@]}" timeout --signal=INT --kill-after=15 $LIMIT "$@"
}

bench() {  # bench NAME WORKLOAD KIND ARGS...: one pjinfer bench command in checkout NAME
  local name=$1 workload=$2 kind=$3; shift 3
  in_tree "$name" $PY -m pjinfer.benchmarks.cli "$kind" "${MODEL[@]}" "${ENGINE[@]}" \
      ${AB_FLAGS:-} $([ "$name" = head ] && echo "${HEAD_FLAGS:-}") \
      --compilation-cache-dir "/tmp/ab-cache-$name" "$@" \
      --output-json "$OUT/${name}_$workload.json"
}

case $STAGE in
  probe)
    if [ $SMOKE = 0 ]; then
      for t in base head; do
        in_tree $t $PY benchmarks/step_probe.py --backends auto --out "$OUT/${t}_probe.json"
      done
    fi
    # ABBA: the first engine process of a device call runs slow (RESULTS.md, round 5: W1
    # TPOT 5.43 ms first vs 4.57-4.65 for the next three), so each side gets one early run
    for run in base:1 head:1 head:2 base:2; do
      bench ${run%:*} w1_${run#*:} latency "${W1[@]}" --num-iters-warmup 1
    done
    for t in base head; do bench $t w2 latency "${W2[@]}" --num-iters-warmup 1; done ;;
  w3)
    for t in base head; do bench $t w3 throughput "${W3[@]}" --warmup-requests 8; done ;;
  qwen3)  # W1 on Qwen3-30B-A3B shapes, whose batch-1 step is host-bound (RESULTS.md, round 5)
    if [ $SMOKE = 0 ]; then
      MODEL=(--model ${AB_MODEL:-configs/models/qwen3-30b-a3b} --load-format dummy --dtype bfloat16)
      ENGINE=(--max-num-seqs 256 --max-num-batched-tokens 8192); LIMIT=140
    fi
    # a short throwaway run first: a device call's first engine process runs slow (round 5),
    # and in round 6 both first-process Qwen3 runs were the slowest of their calls
    [ "${AB_WARMUP:-1}" = 1 ] && bench base warmup latency "${W1[@]}" --output-len 32 \
        --num-iters 1 --num-iters-warmup 1
    for run in ${AB_RUNS:-base:1 head:1 head:2 base:2}; do
      bench ${run%:*} w1_qwen3_${run#*:} latency "${W1[@]}" --num-iters 2 --num-iters-warmup 1 \
          --num-scheduler-steps 8
    done ;;
  qwen3c10)  # issue 13's 10 concurrent sequences of 2,048 tokens on Qwen3-30B-A3B, 256 decode
    # steps a run (the TPOT target's context, shorter output so that ABBA fits one call)
    if [ $SMOKE = 0 ]; then
      MODEL=(--model ${AB_MODEL:-configs/models/qwen3-30b-a3b} --load-format dummy --dtype bfloat16)
      ENGINE=(--max-num-seqs 256 --max-num-batched-tokens 8192); LIMIT=150
      W1=(--batch-size 10 --input-len 2048 --output-len 256)
    fi
    [ "${AB_WARMUP:-1}" = 1 ] && bench base warmup latency "${W1[@]}" --output-len 16 \
        --num-iters 1 --num-iters-warmup 1
    for run in ${AB_RUNS:-base:1 head:1 head:2 base:2}; do
      bench ${run%:*} c10_qwen3_${run#*:} latency "${W1[@]}" --num-iters 1 \
          --num-iters-warmup 1 --num-scheduler-steps 8
    done ;;
  quantw1)  # W1 with int4 (GPTQ g128 shapes) then fp8 weights, 8 decode steps a call, ABBA
    # (QUANTW1_BATCH: another batch size, its records named w1_b<N>_<kind>_<run>)
    dense=("${MODEL[@]}") batch=${QUANTW1_BATCH:+b${QUANTW1_BATCH}_}
    for kind in ${QUANTW1_KINDS:-int4 fp8}; do
      MODEL=("${dense[@]}") quant=(--quantization fp8)
      if [ $kind = int4 ]; then
        [ $SMOKE = 1 ] && continue  # the demo model has no int4 checkpoint
        MODEL=(--model configs/models/llama3-8b-gptq-int4 --load-format dummy --dtype bfloat16)
        quant=()
      fi
      for run in ${AB_RUNS:-base:1 head:1 head:2 base:2}; do
        bench ${run%:*} w1_${batch}${kind}_${run#*:} latency "${W1[@]}" "${quant[@]}" \
            ${QUANTW1_BATCH:+--batch-size $QUANTW1_BATCH} --num-scheduler-steps 8 \
            --num-iters-warmup 1
      done
    done
    MODEL=("${dense[@]}") ;;
  decodesplits)  # decode-attention kernel tilings from both trees, by device time
    IFS=';' read -ra sweeps <<< "${DS_ARGS:- }"
    n=0
    for args in "${sweeps[@]}"; do
      n=$((n + 1))
      [ $SMOKE = 1 ] && args=--smoke
      for run in base:1 head:1 base:2 head:2; do
        in_tree ${run%:*} $PY -m pjinfer.benchmarks.decode_splits $args \
            --out "$OUT/${run%:*}_decode_splits_${n}_${run#*:}.json"
      done
    done ;;
  ragged)  # the ragged (prefill / mixed) kernel's tilings from both trees
    if [ $SMOKE = 1 ]; then log "SKIP ragged in smoke mode (Llama-3-8B shapes only)"; exit 0; fi
    for t in base head; do
      in_tree $t $PY benchmarks/bench_attention.py --skip-tune --skip-decode --quick \
          ${RAGGED_FLAGS:---device-time} \
          --layouts ${RAGGED_LAYOUTS:-prefill_8x512 mixed_255dec1k+1792 mixed_256dec300+8x220} \
          --kv-dtype ${RAGGED_KV:-bfloat16} --out "$OUT/${t}_ragged_${RAGGED_KV:-bfloat16}.json"
    done ;;
  *) echo "unknown stage $STAGE (probe | w3 | qwen3 | qwen3c10 | quantw1 | decodesplits | ragged)"
     exit 2 ;;
esac
