"""What a jitted call's arguments cost the launching thread, per call.

    python -m pjinfer.benchmarks.host_launch --out host_launch.json   # H200
    python -m pjinfer.benchmarks.host_launch --smoke --out /tmp/h.json  # CPU plumbing

A trivial executable (the sum of its arguments' first elements) is called `--calls` times
without waiting, and the time to issue the calls is divided by their number. Its arguments:
`n` small int32 arrays given as NumPy (each is its own host-to-device copy), the same arrays
already on the device, or packed into one buffer by `engine.host_pack` (one copy); and a
pytree of `--leaves` device arrays (what the model step's params and KV caches cost to pass).
An engine step is issued while the step before runs, so this time is what bounds a batch-1
decode when it exceeds the device's step time (RESULTS.md, "Round 5: the host's
launch time per step").
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


def issue_us(fn, args: tuple, calls: int) -> float:
    """Microseconds the host spends per call issuing `calls` calls back to back."""
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    issued = time.perf_counter() - start
    jax.block_until_ready(outs)
    return issued / calls * 1e6


def measure(counts: list[int], leaves: int, calls: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pjinfer.engine.host_pack import pack, unpack

    out: dict[str, Any] = {}
    for n in counts:
        host = [np.arange(16, dtype=np.int32) + i for i in range(n)]
        each = jax.jit(lambda *xs: sum(x[0] for x in xs))
        packed = jax.jit(lambda p: sum(x[0] for x in unpack(p)))
        out[f"args_{n}"] = {
            "numpy_us": issue_us(each, tuple(host), calls),
            "device_us": issue_us(each, tuple(jax.device_put(h) for h in host), calls),
            "packed_us": issue_us(lambda *xs, f=packed: f(pack(list(xs))), tuple(host), calls)}
    tree = {f"w{i}": jnp.zeros((4,), jnp.float32) for i in range(leaves)}
    x = jax.device_put(np.zeros(4, np.float32))
    out[f"pytree_{leaves}_leaves_us"] = issue_us(jax.jit(lambda p, x: x + 1), (tree, x), calls)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="pjinfer.benchmarks.host_launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=positive_int, nargs="+", default=[1, 10, 25],
                   help="numbers of small host arrays per call")
    p.add_argument("--leaves", type=positive_int, default=300,
                   help="device arrays in the pytree argument")
    p.add_argument("--calls", type=positive_int, default=200)
    p.add_argument("--smoke", action="store_true", help="3 calls (CPU plumbing)")
    p.add_argument("--out", default=None, help="JSON result path")
    args = p.parse_args(argv)
    if args.smoke:
        args.calls = 3
    record = new_record("host_launch", argv, vars(args))
    record["device"] = jax_device_info()
    record["results"] = res = measure(args.counts, args.leaves, args.calls)
    finish_record(record, args.out)
    rows = [(f"{n} host arrays", "{numpy_us:.1f} us as NumPy, {device_us:.1f} on device, "
             "{packed_us:.1f} packed".format(**res[f"args_{n}"])) for n in args.counts]
    rows.append((f"pytree of {args.leaves} device arrays",
                 f"{res[f'pytree_{args.leaves}_leaves_us']:.1f} us"))
    print_table("Host time to issue one call", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
