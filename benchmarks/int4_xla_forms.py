"""XLA's int4 matmul in two forms: the engine's (uint8 nibbles unpacked by shifts, then
dequantized and dotted) against native `jnp.int4` values whose convert and group scale XLA may
fuse into the GEMM's operand load.

Why: above the Pallas kernel's rows (49-512, the W2/W3 decode buckets), int4 Llama-3-8B runs
XLA's dequantize-then-dot, which writes every weight out in bf16 and reads it back (16.1
against bf16's 8.8 ms a step at 128 sequences on an H100; RESULTS.md round 44). If XLA's GEMM
fusion reads int4 operands itself, the native form streams 0.5 bytes a weight instead.

Per token count, over a stack of Llama-3-8B MLP matrices (4096 x 14336, GPTQ g128 shapes):
  bf16       x @ W, the yardstick
  uint8      `quantized_matmul_reference` on the engine's QuantizedWeight (int4, zeros)
  s4         values as jnp.int4 [N, K], bf16 scales [N, G]: (v * s) per group, dot
  s4_zeros   the same with per-group zeros folded as v * s - z * s ([N, G] both)
  u4         the engine's uint8 bytes bitcast to uint4 (no copy: nibbles in stored order),
             x's columns put in that order instead, (v - z) * s per group in x's dtype
Each row: ms (pipelined), the compiled temp bytes (a materialised bf16 weight shows as >= its
size) and whether the optimized HLO's dot fusion reads an int4 operand. On a CPU: small shapes.

  python -m pjinfer.benchmarks.int4_xla_forms --out int4_forms.json
  python -m pjinfer.benchmarks.int4_xla_forms --out /tmp/f.json --matrices 2 --k 256 --n 384 \
      --tokens 8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def _args(argv: list[str] | None) -> argparse.Namespace:
    from pjinfer.benchmarks.quant_matmul import add_stack_args

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_stack_args(p)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 2048])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--samples", type=int, default=None)
    a = p.parse_args(argv)
    if a.k % a.group_size:
        p.error(f"--k ({a.k}) must be a multiple of --group-size ({a.group_size})")
    return a


def native_weight(rng: np.random.Generator, k: int, n: int, group_size: int) -> dict:
    """Random int4 values [N, K] as jnp.int4, bf16 scales and zeros-times-scales [N, G]."""
    import jax.numpy as jnp

    groups = k // group_size
    values = rng.integers(-8, 8, (n, k), dtype=np.int8)
    scales = rng.uniform(0.005, 0.02, (n, groups)).astype(np.float32)
    zeros = rng.integers(-2, 3, (n, groups)).astype(np.float32)
    return {"values": jnp.asarray(values).astype(jnp.int4),
            "scales": jnp.asarray(scales, jnp.bfloat16),
            "zero_scales": jnp.asarray(zeros * scales, jnp.bfloat16)}


def native_dot(x, w: dict, zeros: bool):
    """x [T, K] @ the native weight's [K, N] -> [T, N] (bf16), grouped along K."""
    n, k = w["values"].shape
    groups = w["scales"].shape[1]
    v = w["values"].astype(x.dtype).reshape(n, groups, k // groups)  # [N, G, gs]
    dense = v * w["scales"][:, :, None]
    if zeros:
        dense = dense - w["zero_scales"][:, :, None]
    return _dot_stored(x, dense.reshape(n, k))


def bitcast_dot(x, w):
    """x [T, K] @ an engine int4 QuantizedWeight -> [T, N]: its bytes read as uint4 pairs
    (low nibble first), so the values come in the packing's order (block b of 2 S rows: row
    2 b S + i, then 2 b S + S + i); x's columns are shuffled to match, K groups stay whole."""
    import jax
    import jax.numpy as jnp

    from pjinfer.quantization.weight import permute_input

    x = permute_input(x, w)
    n, half = w.packed.shape
    k, span, groups = 2 * half, w.span, w.scales.shape[0]
    t = x.shape[0]
    x = x.reshape(t, k // (2 * span), 2, span).swapaxes(2, 3).reshape(t, k)
    v = jax.lax.bitcast_convert_type(w.packed, jnp.uint4).reshape(n, groups, k // groups)
    zero = w.zero_point if w.zeros is None else w.zeros.T[:, :, None].astype(x.dtype)
    dense = (v.astype(x.dtype) - zero) * w.scales.T[:, :, None].astype(x.dtype)
    return _dot_stored(x, dense.reshape(n, k))


def _dot_stored(x, dense):
    """x [T, K] @ a weight stored [N, K] (K contiguous, no transpose) -> [T, N] in x's dtype,
    float32 sums."""
    import jax
    import jax.numpy as jnp

    y = jax.lax.dot_general(x, dense, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def native_reference(x, w: dict, zeros: bool) -> np.ndarray:
    """The same product in float32 numpy, for the error column."""
    n, k = w["values"].shape
    g = w["scales"].shape[1]
    v = np.asarray(w["values"].astype("int8"), np.float32).reshape(n, g, k // g)
    s = np.asarray(w["scales"], np.float32)[:, :, None]
    dense = v * s - (np.asarray(w["zero_scales"], np.float32)[:, :, None] if zeros else 0)
    return np.asarray(x, np.float32) @ dense.reshape(n, k).T


def _error(form: str, x, w) -> float:
    """Relative error of one matrix's product in `form` against float32."""
    from pjinfer.kernels.quantized_matmul import quantized_matmul_reference

    if form == "u4":
        got = bitcast_dot(x, w)
        want = np.asarray(quantized_matmul_reference(x.astype("float32"), w), np.float32)
    else:
        got = native_dot(x, w, form == "s4_zeros")
        want = native_reference(x, w, form == "s4_zeros")
    got = np.asarray(got, np.float32)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def hlo_facts(compiled) -> dict:
    """Temp bytes, and whether a dot's fused computation takes an int4 (s4 / u4) operand."""
    text = compiled.as_text()
    blocks = text.split("\n\n")
    reads_int4 = any(" dot(" in b and ("s4[" in b or "u4[" in b) for b in blocks)
    return {"temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "dot_fusion_reads_int4": reads_int4,
            "triton_gemm_fusions": text.count("__triton_gemm"),
            "cublas_calls": text.count("__cublas$gemm")}


def run(argv: list[str] | None = None) -> dict:
    import jax

    from pjinfer.benchmarks.ceilings import _filled, timed_rate, timing_plan
    from pjinfer.kernels.quantized_matmul import quantized_matmul_reference
    from pjinfer.quantization.weight import quantize_int4

    a = _args(argv)
    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(a.calls, a.samples, 2, on_cpu=on_cpu)
    rng = np.random.default_rng(0)
    stack = [_filled((a.k, a.n), i) for i in range(a.matrices)]  # bf16 [K, N]
    engine_ws = [quantize_int4(w, a.group_size) for w in stack]
    native_ws = [native_weight(rng, a.k, a.n, a.group_size) for _ in range(a.matrices)]
    forms = {
        "bf16": (lambda x, ws: [x @ w for w in ws], stack, 2 * a.k * a.n),
        "uint8": (lambda x, ws: [quantized_matmul_reference(x, w) for w in ws], engine_ws,
                  engine_ws[0].nbytes),
        "s4": (lambda x, ws: [native_dot(x, w, False) for w in ws], native_ws,
               a.k * a.n // 2 + 2 * a.n * (a.k // a.group_size)),
        "s4_zeros": (lambda x, ws: [native_dot(x, w, True) for w in ws], native_ws,
                     a.k * a.n // 2 + 4 * a.n * (a.k // a.group_size)),
        "u4": (lambda x, ws: [bitcast_dot(x, w) for w in ws], engine_ws, engine_ws[0].nbytes),
    }
    record: dict = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                    "jax": jax.__version__, "matrices": a.matrices, "k": a.k, "n": a.n,
                    "group_size": a.group_size, "pipelined": timing, "runs": []}
    for t in a.tokens:
        x = _filled((t, a.k), 1000 + t)
        for name, (fn, ws, weight_bytes) in forms.items():
            moved = a.matrices * (weight_bytes + 2 * t * (a.k + a.n))
            jitted = jax.jit(fn)
            facts = hlo_facts(jitted.lower(x, ws).compile())
            rate = timed_rate(jitted, (x, ws), moved, timing, jax.block_until_ready)
            row = {"form": name, "tokens": t, "bytes_per_call": moved, **facts, **rate,
                   "ms": rate["seconds_per_call"]["best"] * 1e3}
            if name in ("s4", "s4_zeros", "u4"):
                row["relative_error"] = _error(name, x, ws[0])
            record["runs"].append(row)
            print(f"{name:8s} T={t:5d}: {row['ms']:8.3f} ms  {rate['best_per_s'] / 1e9:8.1f} "
                  f"GB/s  temp {facts['temp_bytes'] / 2**20:9.1f} MiB  int4 in dot: "
                  f"{facts['dot_fusion_reads_int4']}", flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # each T's rows kept as they come
        Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    run()
