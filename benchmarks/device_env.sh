# Sourced by the device run scripts (run_h200.sh, run_tp.sh) after setting REPO and PY:
# the environment every benchmark process on the device machine needs.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# `python -m` would put the cwd (the repo, whose pjinfer/ lacks the mapped subpackages) first.
export PYTHONSAFEPATH=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Wheels carried in .whl/ (starlette, uvicorn, ...) go to /tmp/site without touching the image.
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The engine imports llguidance (structured outputs): without it every engine run fails at
# import, so say so once, up front (round 23 lost a device call to this).
$PY -c "import llguidance" 2>/dev/null \
  || echo "device_env.sh: llguidance is not importable; carry the wheels in .whl/ (run's carry)" >&2
# Import the repository as `pjinfer` without installing it.
eval "$(bash "$REPO/benchmarks/make_shim.sh" "$REPO" /tmp/pjinfer-shim)"

# A step's command runs in the background (`run_step`) so that a TERM or INT to the script (a
# device call's own time limit) reaches it: `timeout` gives its command a process group of its
# own, which a signal to the script's group misses, and the process would hold the GPU into
# the next stage of the call (round 32 lost a run to this).
STEP_PID=
run_step() {  # run_step CMD...: CMD in the background, waited for; its status
  "$@" &
  STEP_PID=$!
  wait "$STEP_PID"
  local rc=$?
  STEP_PID=
  return $rc
}
stop_step() {
  [ -n "$STEP_PID" ] || return 0
  pkill -TERM -P "$STEP_PID" 2>/dev/null
  kill -TERM "$STEP_PID" 2>/dev/null
  wait "$STEP_PID" 2>/dev/null
}
trap 'stop_step; exit 143' TERM INT
