"""Grouped matmul (the MoE expert GEMMs) against the device's own ceilings, as JSON.

  python -m pjinfer.benchmarks.moe --out moe_gmm.json            # H200: Qwen3-30B-A3B shapes
  python -m pjinfer.benchmarks.moe --shapes mixtral --out m.json  # Mixtral-8x7B's experts
  python -m pjinfer.benchmarks.moe --smoke --out /tmp/moe.json   # CPU: tiny shapes, plumbing

Shapes: Qwen3-30B-A3B's experts (hidden 2048, expert intermediate 768, 128 experts, top-8),
gate/up fused ([T*k, 2048] x [E, 2048, 1536]) and down ([T*k, 768] x [E, 768, 2048]);
`--shapes mixtral`: hidden 4096, intermediate 14336, 8 experts, top-2.
- prefill: 8,192 tokens (`--prefill-tokens`), routed uniformly at random (Qwen3: every expert
  gets ~512 rows). Rate = 2 x rows x K x N FLOPs / time, over the bf16 matmul rate measured
  here the way `pjinfer.benchmarks.ceilings` measures it (the step's own projection shapes,
  pipelined); beside it the bytes (each touched expert read once, rows in and out) over the
  bandwidth, which is the bound at a mixed step's ~2,048 tokens (~128 rows an expert).
- decode: 1-64 tokens. Bytes = the experts the routing actually touched (distinct experts x
  K x N x 2 B) + activations in and out, over the weight-streaming GEMV bandwidth measured
  here (16 GB stream, pipelined).
- decode layer (`--decode-layer`): one whole MoE layer's experts (`models.moe.expert_ffn`: routing
  bookkeeping, both GEMMs, the combine) on a 16-token decode step with 1-16 real tokens, the
  sorted path against the routed one, and the routed kernel's tiling sweep (`--routed-n`,
  `--routed-k`) on the gate/up GEMM; bytes = the experts the real tokens chose.
Each kernel is timed pipelined (`calls` back to back, one sync), best and median of `samples`;
ratios divide by the best ceilings. Both `backend=auto` (the Pallas kernel on a GPU, ragged_dot
elsewhere) and plain `jax.lax.ragged_dot` are measured; `--block-m/-n/-k` sweep the kernel's
tiling (each a list, with `--num-warps` / `--num-stages` / `--band`: the program order) on
the prefill shapes, and on the decode ones with `--decode-sweep`.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any

import numpy as np

from pjinfer.benchmarks.ceilings import (
    _filled,
    ceilings_record,
    measure_ceilings,
    pipelined_seconds,
    timing_plan,
)
from pjinfer.benchmarks.common import (
    finish_record,
    jax_device_info,
    kernel_bench_parser,
    new_record,
    positive_int,
    power_of_two,
    print_table,
)

QWEN3_30B = dict(hidden=2048, inter=768, experts=128, top_k=8, prefill_tokens=8192,
                 decode_tokens=(1, 2, 4, 8, 16, 32, 64))
MIXTRAL_8X7B = dict(hidden=4096, inter=14336, experts=8, top_k=2, prefill_tokens=8192,
                    decode_tokens=(1, 2, 4, 8, 16, 32, 64))
SHAPES = {"qwen3": QWEN3_30B, "mixtral": MIXTRAL_8X7B}
SMOKE = dict(hidden=64, inter=32, experts=8, top_k=2, prefill_tokens=64, decode_tokens=(1, 4))


def routed_group_sizes(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """Rows per expert when each token picks top_k distinct experts uniformly at random."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts).astype(np.int32)


class _Shape:
    """What `ceilings.measure_ceilings` reads: the GEMV streams [hidden, 2 x inter] matrices
    (one expert's gate/up), the matmul rate is taken on both expert GEMMs as dense matmuls."""

    def __init__(self, hidden: int, inter: int):
        self.hidden_size, self.intermediate_size, self._inter = hidden, 2 * inter, inter

    def matmul_shapes(self, tokens: int) -> list[tuple[int, int, int]]:
        d, i = self.hidden_size, self._inter
        return [(tokens, d, 2 * i), (tokens, i, d)]


def _gemms(s: dict) -> list[tuple[str, int, int]]:
    """(name, K, N) of the two grouped GEMMs of one MoE layer."""
    return [("gate_up", s["hidden"], 2 * s["inter"]), ("down", s["inter"], s["hidden"])]


def _time(fn, args: tuple, timing: dict) -> dict[str, float]:
    import jax

    seconds = pipelined_seconds(fn, args, sync=jax.block_until_ready, **timing)
    return {"median_s": float(np.median(seconds)), "best_s": float(min(seconds))}


def _kernels(backend_sizes: list[dict]) -> dict[str, Any]:
    """name -> jitted f(lhs, rhs, group_sizes) for ragged_dot, ops' auto dispatch, and every
    block-size triple asked for (the Pallas kernel)."""
    import functools

    import jax
    import jax.numpy as jnp

    from pjinfer.kernels import ops
    from pjinfer.kernels.grouped_matmul import grouped_matmul

    fns = {"ragged_dot": jax.jit(lambda a, b, g: jax.lax.ragged_dot(
        a, b, g, preferred_element_type=jnp.float32).astype(a.dtype)),
        "auto": jax.jit(ops.grouped_matmul)}
    interpret = jax.default_backend() != "gpu"
    for sizes in backend_sizes:
        name = ("pallas_m{block_m}_n{block_n}_k{block_k}_s{k_splits}_w{num_warps}"
                "_st{num_stages}").format(**sizes)
        name += "" if sizes["band"] is None else f"_b{sizes['band']}"
        fns[name] = jax.jit(functools.partial(grouped_matmul, interpret=interpret, **sizes))
    return fns


def run_case(fns: dict, m: int, k: int, n: int, sizes: np.ndarray, timing: dict,
             check: bool) -> dict[str, Any]:
    """Every kernel on one shape; `check` compares each with ragged_dot first."""
    import jax.numpy as jnp

    lhs, rhs = _filled((m, k), 3), _filled((len(sizes), k, n), 4)
    g = jnp.asarray(sizes)
    out: dict[str, Any] = {}
    ref = fns["ragged_dot"](lhs, rhs, g) if check else None
    for name, fn in fns.items():
        try:  # a tiling that does not compile (shared memory, registers) is recorded, not fatal
            if check:
                err = float(jnp.max(jnp.abs(fn(lhs, rhs, g).astype(jnp.float32)
                                            - ref.astype(jnp.float32))))
                out.setdefault("max_abs_diff_vs_ragged_dot", {})[name] = err
            out[name] = _time(fn, (lhs, rhs, g), timing)
        except Exception as e:  # noqa: BLE001 - any compile or launch failure
            out.setdefault("failed", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import jax

    s = SMOKE if args.smoke else SHAPES[args.shapes]
    if args.prefill_tokens is not None:
        s = {**s, "prefill_tokens": args.prefill_tokens}
    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(args.calls, args.samples, 2, on_cpu=on_cpu)
    record = new_record("moe_grouped_matmul", argv, vars(args))
    record.update(device=jax_device_info(), shapes=s)
    # Ceilings, measured here on the experts' own shapes (CPU: 16 rows, a small stream).
    ceilings = measure_ceilings(_Shape(s["hidden"], s["inter"]),
                                tokens=s["prefill_tokens"] * s["top_k"], calls=args.calls,
                                samples=args.samples)
    record["ceilings"] = ceilings_record(ceilings)
    if args.decode_layer:
        record["decode_layer"] = _decode_layer(s, args, timing, ceilings.hbm_bytes_per_s)
        return record
    sweep = [dict(block_m=m_, block_n=n_, block_k=k_, k_splits=s_, num_warps=w_,
                  num_stages=st_, band=b_)
             for m_, n_, k_, s_, w_, st_, b_ in itertools.product(
                 args.block_m, args.block_n, args.block_k, args.k_splits, args.num_warps,
                 args.num_stages, args.band)]
    fns = _kernels(sweep)
    record["prefill"] = _prefill(fns, s, timing, ceilings, args.seed)
    decode_fns = fns if args.decode_sweep else {k: fns[k] for k in ("ragged_dot", "auto")}
    record["decode"] = _decode(decode_fns, s, timing, ceilings.hbm_bytes_per_s, args.seed)
    _print(record)
    return record


def _bytes_moved(touched: int, m: int, k: int, n: int) -> int:
    """bf16 bytes a grouped GEMM of m rows needs: each touched expert's [K, N] read once, the
    rows read, the outputs written."""
    return 2 * (touched * k * n + m * k + m * n)


def _prefill(fns, s, timing, ceilings, seed) -> dict[str, Any]:
    tokens, top_k = s["prefill_tokens"], s["top_k"]
    sizes = routed_group_sizes(tokens, s["experts"], top_k, seed)
    touched, m = int((sizes > 0).sum()), tokens * top_k
    out = {"tokens": tokens, "rows": int(sizes.sum()), "rows_per_expert_max": int(sizes.max()),
           "experts_touched": touched}
    for name, k, n in _gemms(s):
        res = run_case(fns, m, k, n, sizes, timing, check=True)
        flops = 2 * m * k * n
        moved = _bytes_moved(touched, m, k, n)
        roofline_s = max(flops / ceilings.matmul_flops_per_s, moved / ceilings.hbm_bytes_per_s)
        for kernel, t in res.items():
            if kernel.startswith(("max_abs", "failed")):
                continue
            t["tflops_best"] = flops / t["best_s"] / 1e12
            t["vs_matmul_rate"] = flops / t["best_s"] / ceilings.matmul_flops_per_s
            t["vs_bandwidth"] = moved / t["best_s"] / ceilings.hbm_bytes_per_s
            t["vs_roofline"] = roofline_s / t["best_s"]
        out[name] = {"k": k, "n": n, "flops": flops, "bytes": moved, "roofline_s": roofline_s,
                     **res}
    return out


def _decode(fns, s, timing, bandwidth, seed) -> list[dict[str, Any]]:
    rows = []
    for tokens in s["decode_tokens"]:
        sizes = routed_group_sizes(tokens, s["experts"], s["top_k"], seed + tokens)
        touched = int((sizes > 0).sum())
        entry: dict[str, Any] = {"tokens": tokens, "experts_touched": touched}
        for name, k, n in _gemms(s):
            m = tokens * s["top_k"]
            res = run_case(fns, m, k, n, sizes, timing, check=tokens == s["decode_tokens"][-1])
            moved = _bytes_moved(touched, m, k, n)
            for kernel, t in res.items():
                if kernel.startswith(("max_abs", "failed")):
                    continue
                t["tb_per_s_best"] = moved / t["best_s"] / 1e12
                t["vs_bandwidth"] = moved / t["best_s"] / bandwidth
            entry[name] = {"bytes": moved, **res}
        rows.append(entry)
    return rows


def _decode_layer(s, args, timing, bandwidth) -> list[dict[str, Any]]:
    """One MoE layer's expert FFN per path, and the routed kernel per tiling, at 16 padded
    tokens of which `real` route (the rest carry weight 0, as an engine step's padding)."""
    import functools

    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.routed_matmul import routed_matmul
    from pjinfer.models.moe import expert_ffn

    d, inter, e, k = s["hidden"], s["inter"], s["experts"], s["top_k"]
    padded = 16 if not args.smoke else 4
    gate_up, down = _filled((e, d, 2, inter), 5), _filled((e, inter, d), 6)
    x = _filled((padded, d), 7)
    interpret = jax.default_backend() != "gpu"
    paths = {p: jax.jit(functools.partial(expert_ffn, backend="pallas", path=p))
             for p in ("sorted", "routed")}
    rows = []
    for real in sorted({1, 4, padded // 2 + 2, padded} & set(range(1, padded + 1))):
        rng = np.random.default_rng(args.seed + real)
        ids = jnp.asarray(np.argsort(rng.random((padded, e)), axis=1)[:, :k], jnp.int32)
        weights = jnp.where(jnp.arange(padded)[:, None] < real, 1.0 / k, 0.0)
        touched = len(set(np.asarray(ids[:real]).reshape(-1).tolist()))
        moved = 2 * touched * 3 * d * inter  # the experts' gate, up and down weights
        entry: dict[str, Any] = {"real_tokens": real, "experts_touched": touched,
                                 "bytes": moved}
        outs = {}
        for name, fn in paths.items():
            outs[name] = fn(x, weights, ids, gate_up, down)
            t = _time(fn, (x, weights, ids, gate_up, down), timing)
            entry[name] = {**t, "vs_bandwidth": moved / t["best_s"] / bandwidth}
        # the compiled kernels checked against each other (bf16 sums in another order)
        scale = float(jnp.max(jnp.abs(outs["sorted"]))) or 1.0
        entry["max_rel_diff_routed_vs_sorted"] = float(
            jnp.max(jnp.abs(outs["routed"] - outs["sorted"]))) / scale
        flat = gate_up.reshape(e, d, 2 * inter)
        routed_ids = jnp.where(weights > 0, ids, -1)
        for bn, bk in itertools.product(args.routed_n, args.routed_k):
            fn = jax.jit(functools.partial(routed_matmul, per_assignment=False, block_n=bn,
                                           block_k=bk, interpret=interpret))
            t = _time(fn, (x, flat, routed_ids), timing)
            entry[f"gate_up_routed_n{bn}_k{bk}"] = {**t, "vs_bandwidth": 2 * touched * d * 2
                                                    * inter / t["best_s"] / bandwidth}
        rows.append(entry)
        print(f"real {real}: " + ", ".join(f"{p} {entry[p]['best_s'] * 1e6:.1f} us"
                                           for p in paths)
              + f" (routed vs sorted: {entry['max_rel_diff_routed_vs_sorted']:.1e})", flush=True)
    return rows


def _print(record: dict[str, Any]) -> None:
    c = record["ceilings"]
    rows = [("bf16 matmul, best (TFLOP/s)", c["matmul_tflops"]),
            ("GEMV stream, best (TB/s)", c["hbm_tb_per_s"])]
    for name in ("gate_up", "down"):
        for kernel in ("auto", "ragged_dot"):
            r = record["prefill"][name][kernel]
            rows.append((f"prefill {name} {kernel} (ms, x matmul rate, x roofline)",
                         f"{r['best_s'] * 1e3:.3f}, {r['vs_matmul_rate']:.2f}, "
                         f"{r['vs_roofline']:.2f}"))
        swept = {k: v for k, v in record["prefill"][name].items() if k.startswith("pallas_")}
        if swept:
            best = min(swept, key=lambda k: swept[k]["best_s"])
            rows.append((f"prefill {name} best of {len(swept)}: {best}",
                         f"{swept[best]['best_s'] * 1e3:.3f}, "
                         f"{swept[best]['vs_matmul_rate']:.2f}, "
                         f"{swept[best]['vs_roofline']:.2f}"))
    for d in record["decode"]:
        for name in ("gate_up", "down"):
            r = d[name]["auto"]
            rows.append((f"decode {d['tokens']} tok {name} auto (ms, x bandwidth)",
                         f"{r['best_s'] * 1e3:.4f}, {r['vs_bandwidth']:.2f}"))
    print_table("Grouped matmul", rows)


def _band(text: str) -> int | None:
    """--band value: 'all' (None: one band of every tile) or a positive tile count."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of tiles >= 1, or 'all'")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = kernel_bench_parser(__doc__)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3",
                        help="the experts' shapes: Qwen3-30B-A3B or Mixtral-8x7B")
    parser.add_argument("--prefill-tokens", type=positive_int, default=None,
                        help="tokens of the prefill case (default: the shapes' 8,192; a "
                        "mixed step's ~2,048 gives ~128 rows an expert, bandwidth-bound)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-m", type=power_of_two, nargs="+", default=[64])
    parser.add_argument("--block-n", type=power_of_two, nargs="+", default=[128])
    parser.add_argument("--block-k", type=power_of_two, nargs="+", default=[64])
    parser.add_argument("--k-splits", type=power_of_two, nargs="+", default=[1])
    parser.add_argument("--num-warps", type=power_of_two, nargs="+", default=[4])
    parser.add_argument("--num-stages", type=positive_int, nargs="+", default=[3])
    parser.add_argument("--band", type=_band, nargs="+", default=[None],
                        help="program orders: tiles per band (`grouped_matmul.band_order`), "
                             "'all' for one band (tile fastest)")
    parser.add_argument("--decode-layer", action="store_true",
                        help="only the decode-layer comparison (sorted vs routed experts)")
    parser.add_argument("--routed-n", type=power_of_two, nargs="+", default=[32, 64, 128])
    parser.add_argument("--routed-k", type=power_of_two, nargs="+", default=[64, 128, 256])
    parser.add_argument("--decode-sweep", action="store_true",
                        help="time the block-size sweep on the decode shapes too (default: "
                             "prefill only; decode times ragged_dot and auto)")
    args = parser.parse_args(argv)
    finish_record(run(args, argv), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
