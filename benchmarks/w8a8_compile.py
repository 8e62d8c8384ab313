"""Compile time and form of the fp8 W8A8 dot (`kernels.fp8_matmul.fp8_w8a8_matmul`) per
Llama-3-8B projection shape and token count: seconds to lower and compile, whether XLA made it
a cuBLASLt fp8 GEMM or a Triton fusion (the optimized HLO's custom calls and fusion kinds), and
the best of a few timed calls. Run it under different XLA_FLAGS to compare (round 10: an fp8
engine's warm-up of ~50 step shapes outlasted 270 s where bf16's took under 90 s).

  python -m pjinfer.benchmarks.w8a8_compile --out w8a8_compile.json
  XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m pjinfer.benchmarks.w8a8_compile ...
"""

from __future__ import annotations

import argparse
import os
import re
import time

from pjinfer.benchmarks.common import positive_int
from pjinfer.benchmarks.quant_matmul import write_record

# (name, K, N): Llama-3-8B's q/k/v (fused width), o, gate/up (fused), down
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[128, 2048])
    p.add_argument("--calls", type=positive_int, default=5)
    p.add_argument("--smoke", action="store_true", help="shapes / 64 (CPU plumbing)")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def _forms(hlo: str) -> list[str]:
    """The custom-call targets and fusion kinds of an optimized HLO module."""
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    kinds = re.findall(r'"kind":"(__triton[a-z_]*)"', hlo)
    return sorted(set(calls + kinds))


def run(argv: list[str] | None = None) -> dict:
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul
    from pjinfer.quantization.weight import quantize_per_channel

    a = _args(argv)
    scale = 64 if a.smoke else 1
    record = {"device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS"),
              "runs": []}
    for name, k, n in SHAPES:
        k, n = k // scale, n // scale
        w = quantize_per_channel(jnp.ones((k, n), jnp.bfloat16) * 0.01, "fp8")
        for t in a.tokens:
            x = jnp.ones((t, k), jnp.bfloat16)
            t0 = time.perf_counter()
            compiled = jax.jit(fp8_w8a8_matmul).lower(x, w).compile()
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(compiled(x, w))
            times = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(x, w))
                times.append(time.perf_counter() - t0)
            row = {"shape": name, "k": k, "n": n, "tokens": t, "compile_s": compile_s,
                   "best_ms": min(times) * 1e3, "forms": _forms(compiled.as_text())}
            record["runs"].append(row)
            print(f"{name:8s} T={t:5d}: compile {compile_s:6.2f} s  run {row['best_ms']:7.3f} ms"
                  f"  {row['forms']}", flush=True)
    write_record(a.out, record)
    return record


if __name__ == "__main__":
    run()
