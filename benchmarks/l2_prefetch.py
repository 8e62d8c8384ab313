"""Probe: a decode GEMV's weight prefetched into L2 while latency-bound kernels run before it.

At batch 1 a decoder layer's attention stretch (rotary + KV write, paged attention, the split
combine) runs ~10 us of kernels that move almost no bytes, and the o projection after it
streams its weight cold from HBM at ~0.55 of the bandwidth (a 5-8 us GEMV is mostly ramp). A
kernel that only issues TMA prefetches of that weight into L2 (`plgpu.async_prefetch`, Pallas'
Mosaic GPU backend: fire and forget, one bulk request a [256, 256] tile) at the stretch's start
would let HBM stream during it, and the GEMV would read L2. This measures whether that pays,
one layer's pattern repeated over `--layers` distinct weights (so L2 holds none in advance):

  gap       `--gap` tiny elementwise kernels (the latency-bound stretch) and nothing else
  pf_gap    the prefetch kernel, then the gap: what the extra kernel costs
  cold      the gap, then the GEMV: today's order
  hot       the same, every layer reading layer 0's weight (L2-resident): the upper bound
  pf        the prefetch, the gap, the GEMV: the candidate
Derived (us a layer): GEMV cold = cold - gap, hot = hot - gap, after a prefetch = pf - pf_gap;
net gain = cold - pf. The prefetch takes x as an operand so XLA cannot hoist it out of its
layer, and the gap's first kernel adds its result (zeros) to x.

  python -m pjinfer.benchmarks.l2_prefetch --out l2_prefetch.json            # GPU
  python -m pjinfer.benchmarks.l2_prefetch --smoke --out /tmp/l2.json        # CPU plumbing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

VARIANTS = ("gap", "pf_gap", "cold", "hot", "pf")
# [K, N] at decode: Qwen3-30B-A3B o and q/k/v, Llama-3-8B o (bf16); Llama o as int4 g128
SHAPES = ("bf16:4096x2048", "bf16:2048x5120", "bf16:4096x4096", "int4:4096x4096")
TILE = 256  # a TMA box's largest side


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="kind:KxN (bf16 | int4)")
    p.add_argument("--rows", type=int, default=8, help="x rows (the engine's decode bucket)")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--gap", type=int, nargs="+", default=[2, 4], help="kernels in the stretch")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--samples", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, no prefetch kernel (CPU)")
    a = p.parse_args(argv)
    try:
        a.shapes = [_shape(s) for s in a.shapes]
    except ValueError as e:
        p.error(f"--shapes: {e}")
    if min(a.gap) < 0 or min(a.rows, a.layers, a.calls, a.samples) < 1:
        p.error("--gap must be >= 0; --rows, --layers, --calls and --samples >= 1")
    return a


def _shape(text: str) -> tuple[str, int, int]:
    """"kind:KxN" -> (kind, K, N)."""
    kind, _, dims = text.partition(":")
    k, _, n = dims.partition("x")
    if kind not in ("bf16", "int4") or not (k.isdigit() and n.isdigit()):
        raise ValueError(f"{text!r} is not kind:KxN with kind bf16 or int4 (e.g. bf16:4096x2048)")
    return kind, int(k), int(n)


def prefetch(w, after):
    """Issue L2 prefetches of the 2-D array `w` ([256, 256] tiles, one a CTA) once `after` is
    ready; returns a token of zeros [1, 128] that the next kernel adds to its input, which
    keeps the call in the program and in place. Mosaic GPU only (the GPU's TMA)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    r, c = w.shape
    br, bc = min(TILE, r), min(TILE, c)
    if r % br or c % bc:
        raise ValueError(f"prefetch: {w.shape} is not whole [{br}, {bc}] tiles")

    def body(w_gmem, after_gmem, token_gmem, zeros_smem):
        del after_gmem
        i, j = lax.axis_index("r"), lax.axis_index("c")
        plgpu.async_prefetch(w_gmem.at[pl.ds(i * br, br), pl.ds(j * bc, bc)])

        @pl.when((i == 0) & (j == 0))
        def _():  # a written token (zeros): XLA drops a custom call whose result goes unread
            zeros_smem[...] = jnp.zeros(zeros_smem.shape, jnp.float32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(zeros_smem, token_gmem)
            plgpu.wait_smem_to_gmem(0)

    token = jax.ShapeDtypeStruct((1, 128), jnp.float32)
    return plgpu.kernel(body, out_type=token, scratch_types=[plgpu.SMEM(token.shape, token.dtype)],
                        grid=(r // br, c // bc), grid_names=("r", "c"))(w, after)


def _layer(x, w, *, kind: str, gap: int, with_dot: bool, with_prefetch: bool, smoke: bool):
    import jax.numpy as jnp
    from jax import lax

    from pjinfer.kernels import ops

    if with_prefetch:
        stream = w if kind == "bf16" else w.packed
        token = (x[:1, :128].astype(jnp.float32) * 0 if smoke else prefetch(stream, x))
        x = x + token[0, 0].astype(x.dtype)
    for _ in range(gap):
        x = lax.optimization_barrier(jnp.tanh(x))
    if not with_dot:
        return x
    y = x @ w if kind == "bf16" else ops.quantized_matmul(
        x, w, backend="reference" if smoke else "pallas")
    return x + jnp.mean(y.astype(jnp.float32), axis=1, keepdims=True).astype(x.dtype)


def _step(variant: str, kind: str, gap: int, smoke: bool):
    import functools

    import jax

    layer = functools.partial(_layer, kind=kind, gap=gap, smoke=smoke,
                              with_dot=variant in ("cold", "hot", "pf"),
                              with_prefetch=variant in ("pf_gap", "pf"))

    def fn(x, ws):
        for w in ws:
            x = layer(x, ws[0] if variant == "hot" else w)
        return x

    return jax.jit(fn)


def _weights(kind: str, k: int, n: int, layers: int):
    from pjinfer.benchmarks.ceilings import _filled
    from pjinfer.benchmarks.quant_matmul import quantize

    ws = [_filled((k, n), 7 + i) for i in range(layers)]
    return ws if kind == "bf16" else [quantize("int4", w, 128) for w in ws]


def _custom_calls(step, x, ws) -> int:
    """Mosaic GPU custom calls in the optimized HLO: the prefetches XLA kept."""
    text = step.lower(x, ws).compile().as_text()
    return text.count("custom_call_target=\"mosaic_gpu")


def run(argv: list[str] | None = None) -> dict:
    import jax

    from pjinfer.benchmarks.ceilings import _filled, pipelined_seconds

    a = _args(argv)
    if a.smoke:
        a.shapes, a.layers, a.gap, a.calls, a.samples = (
            [("bf16", 256, 128), ("int4", 256, 256)], 2, [1], 1, 1)
    record: dict = {"device": str(jax.devices()[0].device_kind), "rows": a.rows,
                    "layers": a.layers, "calls": a.calls, "samples": a.samples, "runs": []}
    for kind, k, n in a.shapes:
        shape = f"{kind}:{k}x{n}"
        ws = _weights(kind, k, n, a.layers)
        x = _filled((a.rows, k), 3)
        for gap in a.gap:
            steps = {variant: _step(variant, kind, gap, a.smoke) for variant in VARIANTS}
            us = {}
            for variant, step in steps.items():
                secs = pipelined_seconds(step, (x, ws), calls=a.calls, samples=a.samples,
                                         warmup=2, sync=jax.block_until_ready)
                us[variant] = statistics.median(secs) * 1e6 / a.layers
            row = {"shape": shape, "gap": gap, "us_per_layer": us,
                   "gemv_cold_us": us["cold"] - us["gap"], "gemv_hot_us": us["hot"] - us["gap"],
                   "prefetch_kernel_us": us["pf_gap"] - us["gap"],
                   "gemv_after_prefetch_us": us["pf"] - us["pf_gap"],
                   "net_gain_us": us["cold"] - us["pf"]}
            if not a.smoke:
                row["prefetch_calls_kept"] = _custom_calls(steps["pf"], x, ws)
            record["runs"].append(row)
            print(json.dumps(row), flush=True)
    Path(a.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    run()
