"""Probe: fp8 W8A8 decode GEMVs on Pallas' Mosaic GPU backend (TMA loads, fp8 `wgmma` from
shared memory, no dequantization in the kernel) against what the engine runs at decode today,
over one Llama-3-8B step's worth of each projection (32 matrices a shape), in one process.

Why: issue 14's W1 fp8 row (<= 2.6 ms) is held by the fp8 decode GEMVs, which stream e4m3
weights at ~0.64 of the bf16 GEMV's rate (benchmarks/RESULTS.md, rounds 11 and 22): the Triton
weight-only kernel widens every weight before its dot. The issue's fp8 form quantizes the
activations per token where the GPU does fp8 matmuls; then a Hopper kernel need not touch the
weights at all: TMA copies [rows, block_k] e4m3 tiles to shared memory and `wgmma` multiplies
them by the token rows' e4m3 tile (both K-major, as fp8 `wgmma` requires). Round 21's
memory-only int4 kernel (the same grid and pipeline) streamed 2.8-3.7 TB/s, so this asks how
close an fp8 GEMV with no per-weight instructions comes to that.

  python -m pjinfer.benchmarks.fp8_mosaic --configs W X E:4:4 E:6:4 E:4:2:256 --tokens 1 8 \
      --out fp8_mosaic.json

Forms beside the bf16 XLA GEMV of the same shapes (the share's denominator): W, the engine's
fp8 weight-only Triton kernel (its default tiling); X, XLA's W8A8 dot over the [N, K] weight
(what the engine runs above 64 rows); E:stages:splits[:block_k[:rows]], the Mosaic kernel
(float32 partials [splits, N, 8] summed and rescaled by XLA, like X's rescale). Bytes count the
e4m3 weight and its float32 channel scales. On a CPU every E config lowers for CUDA; the tests
run E in Pallas' GPU interpreter (its wgmma as a float32 dot: the interpreter has none over a
transposed operand) and W in Triton's, on small shapes against the float32 reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from pjinfer.benchmarks import int4_mosaic_kernels as K  # noqa: E402

LLAMA3_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))  # q/k/v, o, gate/up, down
USAGE = "configs: W, X or E:stages:splits[:block_k[:rows]] (block_k a multiple of 128, rows 64/128)"


def e4m3_partials(xq, w, *, stages: int = 4, k_splits: int = 1, block_k: int = 128,
                  rows: int = 64, interp=None):
    """xq e4m3 [Tp, K] (Tp a multiple of 8) and w e4m3 [N, K] -> float32 partial sums
    [k_splits, N, Tp] of w @ xq.T: one warpgroup a CTA of `rows` output rows and one K range,
    `stages` [rows, block_k] tiles in flight. `interp`: Pallas' GPU interpreter, where the
    wgmma (which it lacks over a transposed operand) is the same product as a float32 dot."""
    tp, k = xq.shape
    n = w.shape[0]
    if tp % 8 or n % rows or rows % K.WG_ROWS or block_k % 128 or k % (k_splits * block_k):
        raise ValueError(f"unsupported probe shape: x {xq.shape}, w {w.shape}, rows {rows}, "
                         f"block_k {block_k}, {k_splits} splits")
    ks, accs = k // k_splits, rows // K.WG_ROWS

    def kernel(x_gmem, w_gmem, o_gmem, o_smem):
        n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")

        def scoped(*acc_refs):
            for acc in acc_refs if interp else ():  # shared memory there: zeroed by hand
                acc[...] = jnp.zeros(acc.shape, jnp.float32)

            def body(_, x_smem, w_smem):
                for r, acc in enumerate(acc_refs):
                    w_rows = w_smem.at[pl.ds(r * K.WG_ROWS, K.WG_ROWS)]
                    if interp:
                        acc[...] += jnp.dot(w_rows[...].astype(jnp.float32),
                                            x_smem[...].astype(jnp.float32).T)
                    else:
                        plgpu.wgmma(acc, w_rows, x_smem.T)
                plgpu.wgmma_wait(0)

            tiles = K._tiled(block_k * 8, 8)
            plgpu.emit_pipeline(body, grid=(ks // block_k,), max_concurrent_steps=stages, in_specs=[
                plgpu.BlockSpec((tp, block_k), lambda i: (0, i), transforms=tiles),
                plgpu.BlockSpec((rows, block_k), lambda i: (0, i), transforms=tiles)])(
                x_gmem.at[:, pl.ds(s_idx * ks, ks)],
                w_gmem.at[pl.ds(n_idx * rows, rows), pl.ds(s_idx * ks, ks)])
            K._write(o_smem, acc_refs, lambda r: o_gmem.at[
                s_idx, pl.ds(n_idx * rows + r * K.WG_ROWS, K.WG_ROWS)])

        acc = (plgpu.SMEM if interp else plgpu.ACC)((K.WG_ROWS, tp), jnp.float32)
        pl.run_scoped(scoped, *[acc] * accs)

    return plgpu.kernel(
        kernel, out_type=K._partials_type(k_splits, n, tp),
        scratch_types=[K._partials_smem(accs, tp)], grid=(n // rows, k_splits),
        grid_names=("n", "s"), compiler_params=K.PARAMS, interpret=interp)(xq, w)


def parse_config(text: str) -> tuple[str, Callable | None]:
    """'E:4:2:256' -> ("E:4:2:256", the kernel's partial); 'W' / 'X' -> (name, None)."""
    if text in ("W", "X"):
        return text, None
    variant, *fields = text.split(":")
    if variant != "E" or not 2 <= len(fields) <= 4:
        raise ValueError(f"bad config {text!r}: {USAGE}")
    try:
        values = [int(f) for f in fields]
    except ValueError as e:
        raise ValueError(f"bad config {text!r}: {USAGE}") from e
    names = ("stages", "k_splits", "block_k", "rows")
    return text, functools.partial(e4m3_partials, **dict(zip(names, values, strict=False)))


def _apply(name: str, kernel: Callable | None, t: int, interpret: bool) -> Callable:
    """(x, weights) -> [x @ W for W in the stack] as [T, N] bf16, in the config's form."""
    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul, quantize_activations
    from pjinfer.kernels.quantized_matmul import quantized_matmul

    if name == "W":
        return lambda x, ws: [quantized_matmul(x, w, interpret=interpret) for w in ws]
    if name == "X":
        return lambda x, ws: [fp8_w8a8_matmul(x, w) for w in ws]
    tp = max(8, -(-t // 8) * 8)  # wgmma's N: a multiple of 8 rows
    if interpret:
        from pjinfer.benchmarks.int4_mosaic import _interpret_params

        kernel = functools.partial(kernel, interp=_interpret_params())

    def run(x, ws):
        xq, x_scale = quantize_activations(jnp.pad(x, ((0, tp - t), (0, 0))))
        return [(kernel(xq, w.packed).sum(0).T * x_scale * w.scales)[:t].astype(x.dtype)
                for w in ws]
    return run


def _rel(got, ref) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def _reference(x, w) -> jax.Array:
    """float32 x @ the e4m3 weight as stored, rescaled: what every form approximates."""
    return x.astype(jnp.float32) @ (w.packed.astype(jnp.float32) * w.scales.T).T


def _stack(k: int, n: int, matrices: int, seed: int) -> tuple[list, list]:
    """bf16 [K, N] matrices and their per-channel e4m3 forms (the engine's `--quantization fp8`)."""
    from pjinfer.benchmarks.ceilings import _filled
    from pjinfer.quantization.weight import quantize_per_channel

    dense = [_filled((k, n), seed + i) for i in range(matrices)]
    return dense, [quantize_per_channel(w, "fp8") for w in dense]


def time_forms(configs: list[str], shapes, tokens: list[int], matrices: int, *,
               timing: dict | None = None, interpret: bool = False) -> list[dict]:
    """Each shape's stack in every form, pipelined, beside the bf16 XLA GEMV of the process."""
    from pjinfer.benchmarks.ceilings import _filled, timed_rate

    timing = timing or {"calls": 10, "samples": 5, "warmup": 2}
    parsed, rows = [parse_config(c) for c in configs], []
    for si, (k, n) in enumerate(shapes):
        dense, fp8 = _stack(k, n, matrices, 100 * si)
        fp8_bytes = sum(w.packed.nbytes + w.scales.nbytes for w in fp8)
        for t in tokens:
            x = _filled((t, k), 7 + t)
            ref = _reference(x, fp8[0])
            bf16_gemv = jax.jit(lambda x, ws: [x @ w for w in ws])
            forms = [("bf16", bf16_gemv, dense, 2 * k * n * matrices)]
            forms += [(name, jax.jit(_apply(name, fn, t, interpret)), fp8, fp8_bytes)
                      for name, fn in parsed]
            bf16 = None
            for name, fn, ws, nbytes in forms:
                rate = timed_rate(fn, (x, ws), nbytes, timing, jax.block_until_ready)
                bf16 = bf16 or rate["best_per_s"]
                row = {"name": name, "shape_kn": [k, n], "tokens": t, "bytes_per_call": nbytes,
                       "fraction_of_bf16_gemv_bandwidth": rate["best_per_s"] / bf16, **rate}
                if name != "bf16":
                    row["rel_err"] = _rel(fn(x, ws[:1])[0], ref)
                rows.append(row)
                print(f"{k}x{n} T={t} {name}: {rate['seconds_per_call']['best'] * 1e3:.3f} ms, "
                      f"{rate['best_per_s'] / 1e12:.2f} TB/s, "
                      f"{row['fraction_of_bf16_gemv_bandwidth']:.3f} of bf16's, "
                      f"rel err {row.get('rel_err', 0):.2e}", flush=True)
        del dense, fp8
    return rows


def lower_on_cpu(configs: list[str]) -> list[dict]:
    """Each E config lowered for CUDA at every shape; W and X skipped (the CPU check of every
    form is `time_forms(..., interpret=True)` on a small shape)."""
    out = []
    for name, fn in (parse_config(c) for c in configs):
        if fn is None:
            out.append({"name": name, "skipped": "runs on a GPU; interpret-mode check in tests"})
            continue
        for k, n in LLAMA3_8B:
            xq = jax.ShapeDtypeStruct((8, k), jnp.float8_e4m3fn)
            w = jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)
            jax.jit(fn).trace(xq, w).lower(lowering_platforms=("cuda",))
        out.append({"name": name, "lowered_for_cuda": [list(s) for s in LLAMA3_8B]})
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--configs", nargs="+", default=["W", "X", "E:4:4"], help=USAGE)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--matrices", type=int, default=32, help="matrices a shape (Llama's layers)")
    a = p.parse_args(argv)
    try:
        for c in a.configs:
            parse_config(c)
    except ValueError as e:
        p.error(str(e))
    if a.matrices < 1 or any(t < 1 for t in a.tokens):
        p.error("--matrices and --tokens must be positive")
    on_cpu = jax.default_backend() == "cpu"
    record = {"device": jax.devices()[0].device_kind, "configs": a.configs,
              "runs": lower_on_cpu(a.configs) if on_cpu else
              time_forms(a.configs, LLAMA3_8B, a.tokens, a.matrices)}
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
