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


def _chain(x, links: int, pallas: bool, interpret: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    for _ in range(links):
        x = jnp.sin(x) * 1.0001
        if pallas:
            x = pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                               interpret=interpret)(x)
        else:
            x = jnp.cos(x) + 1.0
        x = jnp.tanh(x)
    return x


def time_chain(links: int, pallas: bool, calls: int) -> dict[str, float]:
    """Microseconds per call of the compiled chain, pipelined and synchronous."""
    import jax
    import jax.numpy as jnp

    interpret = jax.default_backend() != "gpu"
    fn = jax.jit(lambda x: _chain(x, links, pallas, interpret))
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
    p.add_argument("--smoke", action="store_true", help="4 links, 3 calls (CPU plumbing)")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    if args.smoke:
        args.links, args.calls = 4, 3
    record = new_record("pallas_launch", argv, vars(args))
    record["device"] = jax_device_info()
    xla = time_chain(args.links, False, args.calls)
    pallas = time_chain(args.links, True, args.calls)
    per_link: dict[str, Any] = {k: (pallas[k] - xla[k]) / args.links for k in xla}
    record["results"] = {"xla_fusion": xla, "pallas": pallas,
                         "pallas_extra_us_per_call": per_link}
    finish_record(record, args.out)
    print_table("Pallas call vs XLA fusion", [
        (f"{name} ({args.links} links)", f"{r['pipelined_us']:.0f} us pipelined, "
         f"{r['synchronous_us']:.0f} us synchronous")
        for name, r in (("xla", xla), ("pallas", pallas))] + [
        ("extra per Pallas call", f"{per_link['pipelined_us']:.2f} us pipelined, "
         f"{per_link['synchronous_us']:.2f} us synchronous")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
