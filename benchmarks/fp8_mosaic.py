"""Probe: fp8 decode GEMVs on Pallas' Mosaic GPU backend (`kernels/fp8_gemv.py`: TMA loads,
`wgmma`; W8A8 over e4m3 rows, W8A16 over float16 rows) against the Triton weight-only kernel and
XLA, over one Llama-3-8B step's worth of each projection (32 matrices a shape), in one process.

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
(what the engine runs above 64 rows); E:stages:splits[:block_k], the Mosaic kernel
(`kernels/fp8_gemv.py`: float32 partials [splits, N, Tp] summed and rescaled by XLA, like X's
rescale) over e4m3 rows quantized per token; G:..., the same kernel over float16 rows, each
weight tile upcast into wgmma's registers (W8A16, the engine's form); E or G alone: the
kernel's own tiling rule's choice a shape. Bytes count the
e4m3 weight and its float32 channel scales. On a CPU every E and G config lowers for CUDA; the
tests run them in Pallas' GPU interpreter (its wgmma as a float32 dot: the interpreter has none
over a transposed operand) and W in Triton's, on small shapes against the float32 reference.
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

from pjinfer.kernels import fp8_gemv  # noqa: E402

LLAMA3_8B = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))  # q/k/v, o, gate/up, down
USAGE = ("configs: W, X, E[:stages:splits[:block_k]] or G[:stages:splits[:block_k]] "
         "(block_k a multiple of 128)")


def parse_config(text: str) -> tuple[str, fp8_gemv.Fp8GemvTiling | None]:
    """'E:4:2:256' -> ("E:4:2:256", that tiling); 'E' / 'G' -> the engine's rule's tiling a
    shape (None); 'W' / 'X' -> (name, None)."""
    if text in ("W", "X", "E", "G"):
        return text, None
    variant, *fields = text.split(":")
    if variant not in ("E", "G") or not 2 <= len(fields) <= 3:
        raise ValueError(f"bad config {text!r}: {USAGE}")
    try:
        return text, fp8_gemv.Fp8GemvTiling(*(int(f) for f in fields))
    except ValueError as e:
        raise ValueError(f"bad config {text!r}: {USAGE} ({e})") from e


def _activations(name: str) -> str:
    """The operand form of a Mosaic config: E e4m3 rows, G float16 rows."""
    return "e4m3" if name[0] == "E" else "float16"


def _apply(name: str, tiling: fp8_gemv.Fp8GemvTiling | None, interpret: bool) -> Callable:
    """(x, weights) -> [x @ W for W in the stack] as [T, N] bf16, in the config's form."""
    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul
    from pjinfer.kernels.quantized_matmul import quantized_matmul

    if name == "W":
        return lambda x, ws: [quantized_matmul(x, w, interpret=interpret) for w in ws]
    if name == "X":
        return lambda x, ws: [fp8_w8a8_matmul(x, w) for w in ws]
    act = _activations(name)
    return lambda x, ws: [fp8_gemv.fp8_gemvs(x, (w,), tiling=tiling, activations=act,
                                             interpret=interpret)[0] for w in ws]


def _rel(got, ref) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def _reference(x, w) -> jax.Array:
    """float32 x @ the e4m3 weight as stored, rescaled: what every form approximates."""
    from pjinfer.quantization.weight import dequantize

    return x.astype(jnp.float32) @ dequantize(w)


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
    bf16_gemv = jax.jit(lambda x, ws: [x @ w for w in ws])
    for si, (k, n) in enumerate(shapes):
        dense, fp8 = _stack(k, n, matrices, 100 * si)
        fp8_bytes = sum(w.packed.nbytes + w.scales.nbytes for w in fp8)
        for t in tokens:
            x = _filled((t, k), 7 + t)
            ref = _reference(x, fp8[0])
            forms = [("bf16", bf16_gemv, dense, 2 * k * n * matrices)]
            forms += [(name, jax.jit(_apply(name, fn, interpret)), fp8, fp8_bytes)
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
    """Each E and G config lowered for CUDA at every shape; W and X skipped (the CPU check of every
    form is `time_forms(..., interpret=True)` on a small shape)."""
    out = []
    for name, tiling in (parse_config(c) for c in configs):
        if name in ("W", "X"):
            out.append({"name": name, "skipped": "runs on a GPU; interpret-mode check in tests"})
            continue
        for k, n in LLAMA3_8B:
            act = _activations(name)
            xq = jax.ShapeDtypeStruct((8, k), jnp.float8_e4m3fn if act == "e4m3" else
                                      jnp.float16)
            w = jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)
            kernel = functools.partial(fp8_gemv.e4m3_partials,
                                       tiling=tiling or fp8_gemv.pick_tiling(k, n, act))
            jax.jit(lambda xq, w, f=kernel: f(xq, (w,))).trace(xq, w).lower(
                lowering_platforms=("cuda",))
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
    from pjinfer.kernels import ops

    record = {"device": jax.devices()[0].device_kind, "configs": a.configs,
              "engine_takes_the_kernel": ops._hopper(),  # ops' dispatch on this device
              "runs": lower_on_cpu(a.configs) if on_cpu else
              time_forms(a.configs, LLAMA3_8B, a.tokens, a.matrices)}
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
