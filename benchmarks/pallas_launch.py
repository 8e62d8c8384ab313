"""What one Pallas call costs inside a jitted step, next to an XLA fusion doing the same.

    python -m pjinfer.benchmarks.pallas_launch --out pallas_launch.json   # H200
    python -m pjinfer.benchmarks.pallas_launch --smoke --out /tmp/p.json  # CPU plumbing

A chain of `--links` tiny links (sin, then cos + 1 as XLA ops or +1 as a Pallas kernel, then
tanh) on a [16, 128] array, so the device work is negligible and the time is the launching:
per call, pipelined (calls queued back to back) and synchronous (each waited for). The
difference per link is what a Pallas kernel adds over a fusion. XLA replays its fusions as
command buffers (CUDA graphs); its command-buffer scheduling admits custom calls only through
FFI handlers marked command-buffer compatible, which Pallas' Triton call is not, so each
Pallas call is launched on its own between the graphs around it. Decode steps with many
small Pallas kernels (one per projection: the quantized matmul, the LoRA kernel) pay it
per kernel (issues 14 and 15).

Each Pallas backend is timed (`--backends`): "triton" lowers to XLA's Triton custom call,
"mosaic" (Mosaic GPU) to the `mosaic_gpu_v2` FFI handler; were that handler command-buffer
compatible its extra cost per call would be ~0. On the H200 (jax 0.11.2) it costs more than
Triton's (benchmarks/RESULTS.md, "Pallas calls and command buffers").
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pjinfer.benchmarks.common import (
    finish_record,
    jax_device_info,
    new_record,
    positive_int,
    print_table,
)

BACKENDS = ("triton", "mosaic")


def _add_one(x, backend: str, interpret: bool):
    """x + 1 as one Pallas kernel of `backend`: Triton through `pallas_call`, Mosaic GPU
    through `plgpu.kernel` (jax 0.11's `pallas_call` finds no Mosaic GPU lowering rule)."""
    import jax
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if backend == "mosaic":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return plgpu.kernel(body, out_type=out, interpret=interpret or None)(x)
    from jax.experimental.pallas import triton as pltriton

    return pl.pallas_call(body, out_shape=out, interpret=interpret,
                          compiler_params=pltriton.CompilerParams(num_warps=4,
                                                                  num_stages=1))(x)


def _chain(x, links: int, backend: str | None, interpret: bool):
    """`links` x (sin, +1 as XLA ops or a Pallas kernel of `backend`, tanh)."""
    import jax.numpy as jnp

    for _ in range(links):
        x = jnp.sin(x) * 1.0001
        x = jnp.cos(x) + 1.0 if backend is None else _add_one(x, backend, interpret)
        x = jnp.tanh(x)
    return x


def time_chain(links: int, backend: str | None, calls: int) -> dict[str, float]:
    """Microseconds per call of the compiled chain, pipelined and synchronous."""
    import jax
    import jax.numpy as jnp

    interpret = jax.default_backend() != "gpu"
    fn = jax.jit(lambda x: _chain(x, links, backend, interpret))
    y = fn(jnp.ones((16, 128), jnp.float32))
    y.block_until_ready()
    start = time.perf_counter()
    for _ in range(calls):
        y = fn(y)
    y.block_until_ready()
    pipelined = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    for _ in range(calls):
        y = fn(y)
        y.block_until_ready()
    synchronous = (time.perf_counter() - start) / calls
    return {"pipelined_us": pipelined * 1e6, "synchronous_us": synchronous * 1e6}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="pjinfer.benchmarks.pallas_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--links", type=positive_int, default=32)
    p.add_argument("--calls", type=positive_int, default=200)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                   help="Pallas backends to time against the XLA chain")
    p.add_argument("--smoke", action="store_true", help="4 links, 3 calls (CPU plumbing)")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    if args.smoke:
        args.links, args.calls = 4, 3
    record = new_record("pallas_launch", argv, vars(args))
    record["device"] = jax_device_info()
    results: dict[str, Any] = {"xla_fusion": time_chain(args.links, None, args.calls)}
    rows = [_row(f"xla ({args.links} links)", results["xla_fusion"])]
    for backend in args.backends:
        try:
            timed = time_chain(args.links, backend, args.calls)
        except Exception as e:  # noqa: BLE001 - a backend this jax/GPU lacks is recorded
            results[backend] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            rows.append((backend, results[backend]["error"][:100]))
            continue
        extra = {k: (timed[k] - results["xla_fusion"][k]) / args.links for k in timed}
        results[backend] = {**timed, "extra_us_per_call": extra}
        rows += [_row(f"{backend} ({args.links} links)", timed),
                 _row(f"extra per {backend} call", extra, ".2f")]
    record["results"] = results
    finish_record(record, args.out)
    print_table("Pallas call vs XLA fusion", rows)
    return 0


def _row(name: str, r: dict[str, float], fmt: str = ".0f") -> tuple[str, str]:
    return name, (f"{r['pipelined_us']:{fmt}} us pipelined, "
                  f"{r['synchronous_us']:{fmt}} us synchronous")


if __name__ == "__main__":
    raise SystemExit(main())
