"""The projections of one decode step, as the engine runs them: quantized vs bf16.

Per weight kind, the seven Linear weights of every decoder layer of Llama-3-8B (q/k/v and
gate/up sharing their x, o, down), at T tokens, timed pipelined like the ceilings
(`ceilings.timed_rate`) on these paths:
  bf16        x @ W per weight (XLA), the yardstick
  grouped     `ops.quantized_matmuls` per group, what `layers.linears` calls: one Pallas kernel
              and one K-split sum per group (q/k/v, gate/up) where the weights allow it
  per_weight  `ops.quantized_matmul` per weight (one kernel and one sum each)
Each row records ms per step (all layers), ms per layer, GB/s of weight bytes as stored, and
the speedup over bf16. The difference between a path's time and its weight bytes at the bf16
path's bandwidth is what the kernels and the ops around them cost beyond streaming: the part
of a W1 TPOT the projections account for. On a CPU it runs tiny shapes in interpret mode
(the plumbing only).

  python -m pjinfer.benchmarks.quant_layers --out quant_layers.json          # H200
  python -m pjinfer.benchmarks.quant_layers --out /tmp/l.json --layers 1 --hidden 256 \
      --intermediate 512 --q-width 256 --kv-width 128 --tokens 16 --samples 1 --calls 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

KINDS = ("int4", "fp8", "int8")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--q-width", type=int, default=4096, help="heads x head_dim")
    p.add_argument("--kv-width", type=int, default=1024, help="kv heads x head_dim")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 1],
                   help="rows of x: 16 is the engine's smallest decode bucket")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--group-size", type=int, default=128, help="int4 group (GPTQ g128)")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--calls", type=int, default=10)
    return p.parse_args(argv)


def layer_groups(a: argparse.Namespace) -> list[tuple[int, list[int]]]:
    """(input dim, output dims) of each x a decoder layer multiplies: q/k/v, o, gate/up, down."""
    h, f = a.hidden, a.intermediate
    return [(h, [a.q_width, a.kv_width, a.kv_width]), (a.q_width, [h]), (h, [f, f]), (f, [h])]


def run(argv: list[str] | None = None) -> dict:
    import jax

    from pjinfer.benchmarks.ceilings import _filled, timed_rate, timing_plan
    from pjinfer.benchmarks.quant_matmul import quantize, write_record
    from pjinfer.kernels import ops

    a = _args(argv)
    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(a.calls, a.samples, 2, on_cpu=on_cpu)
    groups = layer_groups(a)
    seed = iter(range(10**6))
    bf16 = [[[_filled((k, n), next(seed)) for n in outs] for k, outs in groups]
            for _ in range(a.layers)]  # [layer][group][weight]
    record: dict = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                    "layers": a.layers, "groups": groups, "group_size": a.group_size,
                    "interpret": on_cpu, "pipelined": timing, "runs": []}
    paths = {
        "bf16": lambda x, ws: [x @ w for w in ws],
        "grouped": lambda x, ws: ops.quantized_matmuls(x, ws, backend="pallas"),
        "per_weight": lambda x, ws: [ops.quantized_matmul(x, w, backend="pallas") for w in ws]}

    def step(path: str):
        def fn(xs, layers):
            return [[paths[path](x, ws) for x, ws in zip(xs, layer, strict=True)]
                    for layer in layers]
        return jax.jit(fn)

    for t in a.tokens:
        xs = [_filled((t, k), 1000 + t + i) for i, (k, _) in enumerate(groups)]
        base = None
        for kind in ("bf16", *a.kinds):
            layers = bf16 if kind == "bf16" else [
                [[quantize(kind, w, a.group_size) for w in ws] for ws in layer]
                for layer in bf16]
            nbytes = sum(w.nbytes for w in jax.tree.leaves(
                layers, is_leaf=lambda w: hasattr(w, "nbytes")))
            for path in ["bf16"] if kind == "bf16" else ["grouped", "per_weight"]:
                rate = timed_rate(step(path), (xs, layers), nbytes, timing, jax.block_until_ready)
                best = rate["seconds_per_call"]["best"]
                row = {"kind": kind, "path": path, "tokens": t, "weight_bytes": nbytes,
                       "ms_per_step": best * 1e3, "ms_per_layer": best * 1e3 / a.layers,
                       "gb_per_s": rate["best_per_s"] / 1e9, **rate}
                base = base or row
                row["speedup_vs_bf16"] = base["ms_per_step"] / row["ms_per_step"]
                # beyond streaming the packed bytes at the bf16 path's bandwidth
                row["ms_beyond_streaming"] = row["ms_per_step"] - nbytes / (
                    base["gb_per_s"] * 1e6)
                record["runs"].append(row)
                print(f"{kind:5s} {path:10s} T={t:3d}: {row['ms_per_step']:7.3f} ms/step "
                      f"{row['gb_per_s']:8.1f} GB/s  x{row['speedup_vs_bf16']:.2f} vs bf16",
                      flush=True)
            del layers
    write_record(a.out, record)
    return record


if __name__ == "__main__":
    run()
