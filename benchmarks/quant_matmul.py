"""Weight-only quantized matmul on a stack of Llama-3-8B MLP matrices: Pallas vs XLA vs bf16.

The issue's measurement: 24 matrices of 4096 x 14336 at batch 1, where XLA's dequantize-then-dot
made quantized weights slower than bf16 (bf16 1.09 ms, fp8 1.24, int8 1.28, int4 1.83). For each
weight kind and token count this times, pipelined like the ceilings (`ceilings.timed_rate`):
  bf16   x @ W (XLA), the weight-streaming yardstick
  xla    `quantized_matmul_reference`: the whole weight dequantized, then one dot
  pallas `quantized_matmul`: packed bytes streamed, dequantized in registers
  w8a8   fp8 only: `fp8_w8a8_matmul`, activations quantized per token and XLA's fp8 dot
         (the engine's form above decode sizes)
  routed fp8 only: `routed_fp8`, the routed expert kernel over the weight as a one-expert
         stack that every token chose (a probe: RESULTS.md round 38)
and reports bytes moved as stored (packed values + scales + zeros + x + out), GB/s, the fraction
of the bf16 GEMV's bandwidth (the roofline's ceiling), and TFLOP/s. On a CPU it runs tiny
shapes in interpret mode (the plumbing only).

`--sweep` instead times the Pallas kernel under each of a handful of tilings per kind and
token count (`quantized_matmul_tiling.sweep_candidates`: the default first, single changes
around it, the pre-split-K tiling last) and records, per kind and T, every tiling's ms and
TB/s of packed bytes, the best one and the default's place against it.

  python -m pjinfer.benchmarks.quant_matmul --out quant_matmul.json   # H200 (run_h200.sh quant)
  python -m pjinfer.benchmarks.quant_matmul --out /tmp/q.json --matrices 2 --k 256 --n 256 \
      --tokens 1
  python -m pjinfer.benchmarks.quant_matmul --sweep --tokens 1 16 --out quant_sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

KINDS = ("fp8", "int8", "int4")


def add_stack_args(p: argparse.ArgumentParser) -> None:
    """The record path and the stack of Llama-3-8B MLP matrices (shared with int4_xla_forms)."""
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--matrices", type=int, default=24)
    p.add_argument("--k", type=int, default=4096, help="input dim (hidden size)")
    p.add_argument("--n", type=int, default=14336, help="output dim (intermediate size)")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_stack_args(p)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 2048],
                   help="rows of x: 1 / 16 decode GEMV shapes, 2048 a prefill GEMM")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--group-size", type=int, default=128, help="int4 group (GPTQ g128)")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--sweep", action="store_true",
                   help="time candidate tilings of the Pallas kernel (GPU) instead")
    p.add_argument("--grid", nargs="+", default=None, metavar="FIELD=V1,V2",
                   help="with --sweep: the default tiling, then every combination of these "
                        "values (QuantMatmulBlockSizes fields, e.g. num_stages=2,3,4) in "
                        "place of the handful of single changes")
    p.add_argument("--tilings", nargs="*", default=None, metavar="LINE",
                   help="with --sweep: the default tiling, the rules' tiling where a tuned one "
                        "is the default (quantized_matmul_tiling.TUNED), then these "
                        "(describe() lines such as 't16 n256 k128x1 s8 w4 st3 (dot)'; none: "
                        "those two alone) in place of the single changes")
    p.add_argument("--float16-twins", action="store_true",
                   help="with --sweep: after each fp8 dot tiling, the same with float16_dot")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --sweep: time the candidates this many times, round-robin, so "
                        "the device's drift falls on all of them; a tiling's ms is its best "
                        "round, `round_ms` lists them")
    a = p.parse_args(argv)
    if a.grid and a.tilings is not None:
        p.error("--grid and --tilings both pick the sweep's candidates: give one")
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    from pjinfer.kernels.quantized_matmul_tiling import QuantMatmulBlockSizes

    try:  # a mistyped line fails here, not after the stack is built and quantized
        a.tilings = (None if a.tilings is None
                     else [QuantMatmulBlockSizes.parse(line) for line in a.tilings])
    except ValueError as e:
        p.error(f"--tilings: {e}")
    return a


def quantize(kind: str, w, group_size: int):
    """A bf16 weight [K, N] as the kind's QuantizedWeight (int4: groups of `group_size`)."""
    from pjinfer.quantization.weight import quantize_int4, quantize_per_channel

    return quantize_int4(w, group_size) if kind == "int4" else quantize_per_channel(w, kind)


def routed_fp8(x, w, interpret: bool):
    """x [T, K] @ a per-channel fp8 weight [K, N] by the routed expert kernel, the weight a
    one-expert stack (values [1, N, K] as stored, scales [1, N]) every token chose."""
    import jax.numpy as jnp

    from pjinfer.kernels.routed_matmul import routed_matmul
    from pjinfer.kernels.routed_tiling import default_routed_tiling

    n, k = w.packed.shape
    (block_n, block_k), k_splits = default_routed_tiling((1, k, n), 1)
    ids = jnp.zeros((x.shape[0], 1), jnp.int32)
    return routed_matmul(x, w.packed[None], ids, per_assignment=False,
                         rhs_scales=w.scales.reshape(1, n), block_n=block_n, block_k=block_k,
                         k_splits=k_splits, interpret=interpret)


def run(argv: list[str] | None = None) -> dict:
    import jax

    from pjinfer.benchmarks.ceilings import _filled, timed_rate, timing_plan
    from pjinfer.kernels import quantized_matmul as qmm
    from pjinfer.kernels.fp8_matmul import fp8_w8a8_matmul

    a = _args(argv)
    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(a.calls, a.samples, 2, on_cpu=on_cpu)
    stack = [_filled((a.k, a.n), i) for i in range(a.matrices)]  # bf16 [K, N] each
    sync = jax.block_until_ready
    record: dict = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                    "matrices": a.matrices, "k": a.k, "n": a.n, "group_size": a.group_size,
                    "interpret": on_cpu, "pipelined": timing, "runs": []}

    def measure(name: str, kind: str, fn, operands, weight_bytes: int, t: int,
                runs: list | None = None) -> dict:
        moved = weight_bytes + a.matrices * 2 * t * (a.k + a.n)  # + x read, out written (bf16)
        rate = timed_rate(jax.jit(fn), operands, moved, timing, sync)
        best = rate["seconds_per_call"]["best"]
        row = {"path": name, "kind": kind, "tokens": t, "bytes_per_call": moved,
               "weight_bytes": weight_bytes, **rate,
               "tflops": 2 * a.matrices * t * a.k * a.n / best / 1e12}
        (record["runs"] if runs is None else runs).append(row)
        print(f"{name:7s} {kind:5s} T={t:5d}: {best * 1e3:8.3f} ms  "
              f"{rate['best_per_s'] / 1e9:8.1f} GB/s", flush=True)
        return row

    def save() -> None:  # after each row count: a run stopped by a time limit keeps those
        write_record(a.out, record)

    if a.sweep:
        record["sweep"] = {}
        _sweep(a, stack, measure, on_cpu, record["sweep"], save)
    for t in [] if a.sweep else a.tokens:
        x = _filled((t, a.k), 1000 + t)
        bf16 = measure("bf16", "bf16", lambda x, ws: [x @ w for w in ws], (x, stack),
                       a.matrices * a.k * a.n * 2, t)
        for kind in a.kinds:
            ws = [quantize(kind, w, a.group_size) for w in stack]
            nbytes = sum(w.nbytes for w in ws)
            measure("xla", kind, lambda x, ws: [qmm.quantized_matmul_reference(x, w)
                                                for w in ws], (x, ws), nbytes, t)
            row = measure("pallas", kind, lambda x, ws: [qmm.quantized_matmul(
                x, w, interpret=on_cpu) for w in ws], (x, ws), nbytes, t)
            rows = [row]
            if kind == "fp8":
                rows.append(measure("w8a8", kind, lambda x, ws: [fp8_w8a8_matmul(x, w)
                                                                 for w in ws], (x, ws), nbytes, t))
                rows.append(measure("routed", kind, lambda x, ws: [routed_fp8(
                    x, w, interpret=on_cpu) for w in ws], (x, ws), nbytes, t))
            for r in rows:
                r["fraction_of_bf16_gemv_bandwidth"] = r["best_per_s"] / bf16["best_per_s"]
                r["speedup_vs_bf16"] = (bf16["seconds_per_call"]["best"]
                                        / r["seconds_per_call"]["best"])
            del ws
        save()
    save()
    return record


def _sweep(a: argparse.Namespace, stack: list, measure, on_cpu: bool, out: dict,
           save) -> None:
    """Into `out`, per kind, per T: the Pallas kernel under each candidate tiling, ms and
    TB/s of packed bytes (+ x and out), fastest first, the best and the default's ratio to
    it; the bf16 GEMV beside them as the yardstick (`save` after each T). A tiling that fails
    (e.g. too much shared memory) is listed under `failed`, and the sweep goes on."""
    from pjinfer.benchmarks.ceilings import _filled

    xs = {t: _filled((t, a.k), 1000 + t) for t in a.tokens}
    bf16 = {t: measure("bf16", "bf16", lambda x, ws: [x @ w for w in ws], (xs[t], stack),
                       a.matrices * a.k * a.n * 2, t, runs=[]) for t in a.tokens}
    for kind in a.kinds:
        ws = [quantize(kind, w, a.group_size) for w in stack]
        for t, x in xs.items():
            candidates = _candidates(a, t, ws[0], x)
            timed: dict = {}  # tiling -> its rows, one a round
            failed = []
            for _ in range(a.rounds):
                for sizes in candidates:
                    if any(f["tiling"] == sizes.describe() for f in failed):
                        continue
                    try:
                        row = _time_tiling(sizes, kind, x, ws, t, measure, on_cpu)
                        timed.setdefault(sizes, []).append(row)
                    except Exception as e:  # noqa: BLE001 - any compile failure is a result
                        failed.append({"tiling": sizes.describe(), "error": repr(e)[:500]})
                        print(f"{sizes.describe()}: failed: {e!r:.200}", flush=True)
            rows = [_best_round(rs) for rs in timed.values()]
            out.setdefault(kind, {})[str(t)] = _summary(rows, failed, candidates[0], bf16[t])
            print(f"== {kind} T={t}: {json.dumps(_headline(out[kind][str(t)]))}", flush=True)
            save()
        del ws


def _candidates(a: argparse.Namespace, t: int, w, x) -> list:
    """The sweep's tilings for T = t: the default first, then the grid, the listed lines or
    the handful of single changes."""
    from pjinfer.kernels.quantized_matmul_tiling import (
        grid_candidates,
        pick_block_sizes,
        supported,
        sweep_candidates,
    )

    if a.grid:
        return _twins(a, x, w, grid_candidates(t, w, x, a.grid))
    if a.tilings is None:
        return _twins(a, x, w, sweep_candidates(t, w, x))
    out = [pick_block_sizes(t, w), pick_block_sizes(t, w, tuned=False)]
    for sizes in a.tilings:
        if not supported(x, w, sizes):  # one list serves several shapes: skip, say so
            print(f"--tilings {sizes.describe()!r}: skipped, the kernel cannot tile a "
                  f"{w.kind} weight of {w.shape} with it (quantized_matmul_tiling.supported)",
                  flush=True)
        else:
            out.append(sizes)
    return _twins(a, x, w, list(dict.fromkeys(out)))


def _twins(a: argparse.Namespace, x, w, tilings: list) -> list:
    """`tilings`, each fp8 dot followed by its float16_dot twin where --float16-twins asks."""
    from pjinfer.kernels.quantized_matmul_tiling import supported

    if not a.float16_twins:
        return tilings
    out = []
    for sizes in tilings:
        out.append(sizes)
        twin = dataclasses.replace(sizes, float16_dot=True)
        if supported(x, w, twin):
            out.append(twin)
    return list(dict.fromkeys(out))


def _best_round(rows: list[dict]) -> dict:
    """One tiling's rounds as one row: the best round's, with every round's ms beside it."""
    best = dict(min(rows, key=lambda r: r["ms"]))
    best["round_ms"] = [r["ms"] for r in rows]
    best["compile_and_time_s"] = sum(r["compile_and_time_s"] for r in rows)
    return best


def _time_tiling(sizes, kind: str, x, ws: list, t: int, measure, on_cpu: bool) -> dict:
    """One candidate: compiled and timed; the row with its tiling, ms and TB/s."""
    from pjinfer.kernels import quantized_matmul as qmm

    start = time.perf_counter()
    got = qmm.quantized_matmul(x, ws[0], block_sizes=sizes, interpret=on_cpu)
    want = qmm.quantized_matmul_reference(x, ws[0])
    error = float(np.linalg.norm(np.asarray(got, np.float32) - np.asarray(want, np.float32))
                  / np.linalg.norm(np.asarray(want, np.float32)))
    row = measure(sizes.describe(), kind, lambda x, ws: [
        qmm.quantized_matmul(x, w, block_sizes=sizes, interpret=on_cpu) for w in ws],
        (x, ws), sum(w.nbytes for w in ws), t, runs=[])
    return {"tiling": sizes.describe(), "ms": row["seconds_per_call"]["best"] * 1e3,
            "relative_error": error,
            "tb_per_s": row["best_per_s"] / 1e12, "best_per_s": row["best_per_s"],
            "block_sizes": dataclasses.asdict(sizes),
            "compile_and_time_s": time.perf_counter() - start}


# relative error vs the reference above which a tiling's output is wrong, not rounded: the
# bf16 output's rounding is ~5e-3 at these sizes (RESULTS.md, quantized matmul)
MAX_ERROR = 2e-2


def _summary(rows: list, failed: list, default, bf16: dict) -> dict:
    """Fastest first among the tilings whose output is right (then the `wrong` ones), each
    with its fraction of the bf16 GEMV's bandwidth."""
    for r in rows:
        r["fraction_of_bf16_gemv_bandwidth"] = r.pop("best_per_s") / bf16["best_per_s"]
    rows = sorted(rows, key=lambda r: r["ms"])
    wrong = [r["tiling"] for r in rows if not r["relative_error"] < MAX_ERROR]
    rows = [r for r in rows if r["tiling"] not in wrong] + [r for r in rows if r["tiling"] in wrong]
    mine = next((r for r in rows if r["tiling"] == default.describe()), None)
    return {"bf16_ms": bf16["seconds_per_call"]["best"] * 1e3,
            "bf16_tb_per_s": bf16["best_per_s"] / 1e12,
            "best": rows[0]["tiling"] if rows else None, "default": default.describe(),
            "default_vs_best": mine["ms"] / rows[0]["ms"] if mine else None,
            "tilings": rows, "failed": failed, "wrong": wrong}


def _headline(summary: dict) -> dict:
    best = summary["tilings"][0] if summary["tilings"] else {}
    return {"best": summary["best"], "best_ms": best.get("ms"),
            "best_tb_per_s": best.get("tb_per_s"), "default": summary["default"],
            "default_vs_best": summary["default_vs_best"], "bf16_ms": summary["bf16_ms"],
            "failed": len(summary["failed"]), "wrong": len(summary["wrong"])}


def write_record(path: str, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    run()
