#!/usr/bin/env bash
# Session 50 call 7: the one-launch routed SwiGLU (`routed_ffn_split`, --fused 3) beside the
# engine's routed pair (--fused 2, the activation in gate/up's epilogue): Qwen3-30B-A3B at 1
# and 8 tokens, Mixtral-8x7B at 1; then the compiled kernel against the reference.
set -u
export REPO=$(pwd) PY=python3
source benchmarks/device_env.sh
R=/tmp/r7; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $R/gpu.txt
echo "== qwen3 $(date +%T)"
timeout 140 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 8 \
   --fused 2 3 --swiglu-block-n 16 32 64 --models qwen3-30b-a3b --k-splits 2 \
   --out $R/split_qwen3.json 2>&1 | grep -v -i warning | grep "T=" 
tar -czf $OUT/r.tgz -C $R .
echo "== mixtral $(date +%T)"
timeout 120 python3 -m pjinfer.benchmarks.moe_decode_stack --samples 8 --tokens 1 \
   --fused 2 3 --swiglu-block-n 64 128 --models mixtral-8x7b \
   --out $R/split_mixtral.json 2>&1 | grep -v -i warning | grep "T="
tar -czf $OUT/r.tgz -C $R .
echo "== check $(date +%T)"
timeout 60 python3 - <<'PY' 2>&1 | grep -v -i warning | tee $R/check.txt
import jax, jax.numpy as jnp, numpy as np
from pjinfer.kernels.routed_ffn_split import routed_ffn_split
from pjinfer.kernels.routed_matmul import routed_ffn_reference
rng = np.random.default_rng(0)
for t, chunk in ((1, 32), (8, 32), (8, 16)):
    x = jnp.asarray(rng.normal(size=(t, 2048)), jnp.bfloat16)
    gu = jnp.asarray(rng.normal(size=(128, 2048, 1536)) / 45, jnp.bfloat16)
    dn = jnp.asarray(rng.normal(size=(128, 768, 2048)) / 28, jnp.bfloat16)
    ids = jnp.asarray(np.argsort(rng.random((t, 128)), axis=1)[:, :8], jnp.int32)
    got = routed_ffn_split(x, gu, dn, ids, chunk=chunk).astype(jnp.float32)
    want = routed_ffn_reference(x, gu, dn, ids).astype(jnp.float32)
    err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    print(f"T={t} chunk={chunk} relative error {err:.2e}")
PY
tar -czf $OUT/r.tgz -C $R .
echo "== done $(date +%T)"
