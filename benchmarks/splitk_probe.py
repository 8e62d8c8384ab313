"""Does XLA run a decode step's projection as K-range partials we hand on, without a copy?

  python -m pjinfer.benchmarks.splitk_probe --out splitk_probe.json           # GPU
  python -m pjinfer.benchmarks.splitk_probe --smoke --out /tmp/splitk.json    # CPU plumbing

At batch 1 XLA cuts a projection's K into ranges (split-K) and sums the float32 partials in a
kernel of its own, which nothing else fuses: after the o projection the sum and the residual
add, then the RMSNorm, each a kernel (RESULTS.md, rounds 23 and 30). If the model wrote the
cut itself, x [T, S, K/S] against W [S, K/S, N] as a dot batched over S, a kernel of ours
could take the partials [S, T, N] and sum them with the residual add and the norm. Whether
that pays depends on what XLA makes of the batched dot: this times `layers` projections a
call, each followed by residual add and RMSNorm, in three forms, and counts the kernels of
each in XLA's optimized HLO:

  plain     x @ W, then add and norm (what the models do today)
  batched   x viewed [T, S, K/S] (a transpose to [S, T, K/S] if XLA wants one), dot batched
            over S, partials summed by XLA, then add and norm
  batched_s x given already as [S, T, K/S] (what a kernel before it could store), as above
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

import numpy as np

from pjinfer.benchmarks.ceilings import _filled, pipelined_seconds, timing_plan
from pjinfer.benchmarks.common import finish_record, jax_device_info, new_record, positive_int

# (name, K, N): Qwen3-30B-A3B's o projection and router, Llama-3-8B's o projection
SHAPES = [("qwen3_o", 4096, 2048), ("qwen3_router", 2048, 128), ("llama_o", 4096, 4096)]
SMOKE_SHAPES = [("tiny", 64, 32)]
FORMS = ("plain", "batched", "batched_s")


def step_fn(form: str, splits: int):
    """f(x, residual, weights per layer) -> the residual after every layer's projection, add
    and RMSNorm (each layer's on the chain of the one before, so none is skipped)."""
    import jax
    import jax.numpy as jnp

    def norm(h):
        h32 = h.astype(jnp.float32)
        return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)
                ).astype(h.dtype)

    def project(x, w):  # x [T, K], w [K, N] -> float32 [T, N]
        t, k = x.shape
        if form == "plain":
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
        xs = x.reshape(t, splits, k // splits)
        if form == "batched_s":
            xs = jax.lax.optimization_barrier(xs.transpose(1, 0, 2))  # [S, T, K/S]
            parts = jnp.einsum("stk,skn->stn", xs, w.reshape(splits, k // splits, -1),
                               preferred_element_type=jnp.float32)
        else:
            parts = jnp.einsum("tsk,skn->stn", xs, w.reshape(splits, k // splits, -1),
                               preferred_element_type=jnp.float32)
        return parts.sum(0)

    def run(x, residual, weights):
        for w in weights:  # h feeds the norm and the next residual, as in a decoder layer
            h = (residual.astype(jnp.float32) + project(x, w)).astype(residual.dtype)
            residual = h + norm(h)  # the norm's output standing for the MLP's
        return residual

    return jax.jit(run)


def kernel_counts(hlo: str) -> dict[str, int]:
    """Kernels of the optimized module's entry computation, by kind (fusion kinds, custom
    calls, copies/transposes)."""
    entry = hlo[hlo.index("ENTRY"):]
    kinds = re.findall(r"= \S+ (fusion|custom-call|copy|transpose|reduce)\(.*?(?:kind=(\w+)|"
                       r"custom_call_target=\"([^\"]+)\"|$)", entry, re.M)
    counts: dict[str, int] = {}
    for op, kind, target in kinds:
        key = f"{op}:{kind or target or '-'}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    record = new_record("splitk_probe", argv, vars(args))
    record["device"] = jax_device_info()
    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(args.calls, args.samples, 2, on_cpu=on_cpu)
    record["rows"] = []
    for name, k, n in (SMOKE_SHAPES if args.smoke else SHAPES):
        weights = [_filled((k, n), 20 + i) for i in range(args.layers)]
        for t in args.tokens:
            x, residual = _filled((t, k), 1), _filled((t, n), 2)
            for splits in args.splits:
                row: dict[str, Any] = {"shape": name, "k": k, "n": n, "tokens": t,
                                       "splits": splits, "forms": {}}
                for form in FORMS:
                    if form == "plain" and splits != args.splits[0]:
                        continue
                    fn = step_fn(form, splits)
                    hlo = fn.lower(x, residual, weights).compile().as_text()
                    sec = pipelined_seconds(fn, (x, residual, weights),
                                            sync=jax.block_until_ready, **timing)
                    per_layer = min(sec) / args.layers
                    row["forms"][form] = {"us_per_layer": per_layer * 1e6,
                                          "kernels": kernel_counts(hlo),
                                          "weight_tb_s": k * n * 2 / per_layer / 1e12}
                    print(f"{name} T={t} S={splits} {form}: {per_layer * 1e6:.2f} us/layer, "
                          f"{row['forms'][form]['kernels']}", flush=True)
                    if args.hlo_dir:
                        with open(f"{args.hlo_dir}/{name}_t{t}_s{splits}_{form}.txt", "w") as f:
                            f.write(hlo)
                record["rows"].append(row)
        del weights
    record["dtype"] = str(jnp.bfloat16.dtype)
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=positive_int, default=48)
    parser.add_argument("--hlo-dir", default=None, help="write each form's optimized HLO here")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args(argv)
    finish_record(run(args, argv), args.out)
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
