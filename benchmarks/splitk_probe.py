"""Can a decode step's projection hand its K-range partials to the next kernel, copy-free?

  python -m pjinfer.benchmarks.splitk_probe --out splitk_probe.json           # GPU
  python -m pjinfer.benchmarks.splitk_probe --splits 4 --routed 128:1 128:2 64:1 64:2 \
      --out dense_routed.json                    # GPU, with the routed kernel as a dense GEMV
  python -m pjinfer.benchmarks.splitk_probe --reduce --splits 4 --out reduce.json   # GPU
  python -m pjinfer.benchmarks.splitk_probe --smoke --out /tmp/splitk.json    # CPU plumbing

At batch 1 XLA cuts a projection's K into ranges (split-K) and sums the float32 partials in a
kernel of its own before the next kernel reads them (q/k/v before the rotary kernel, the router
before the routing kernel: 1.5 us each a layer of Qwen3-30B-A3B on the H100, RESULTS.md round
30). If the model made the cut itself, x [T, S, K/S] against W [S, K/S, N] as a dot batched
over S, the next (Pallas) kernel could sum the partials [S, T, N] as it loads them. Whether
that pays depends on what XLA makes of the batched dot and of x's layout. Each layer here:

  x = norm(h)                (an XLA fusion; x also read by a Pallas kernel, as the experts
                              read the router's input)      -- source "norm"
  x = a Pallas kernel's output, stored as the dot wants it  -- source "kernel" (the attention
                              combine before the o projection could store [S, T, K/S])
  y = x @ W                  plain: XLA's dot (its own split-K and sum)
                             batched: the [S, T, N] partials of the dot batched over S
                             routed: the routed expert kernel over W as a one-expert stack
                             (every token choosing it: W read once), block_n columns and
                             S K ranges a program, its raw [S, Tp, N] output as is
                             reduce: sum(x[:, :, None] * W, axis=1) in float32, no dot:
                             one reduction fusion where the dot is a GEMM and a split-K sum
  a Pallas kernel sums y's partials (one for plain and reduce) and h takes its mean

timed over `layers` layers a call, and counted: the kernels of the optimized HLO's entry
(fusions by kind, custom calls, copies), a layer.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from typing import Any

from pjinfer.benchmarks.ceilings import _filled, pipelined_seconds, timing_plan
from pjinfer.benchmarks.common import (
    finish_record,
    jax_device_info,
    kernel_bench_parser,
    new_record,
    positive_int,
)
from pjinfer.kernels.common import dividing_block

# (name, K, N, source): Qwen3-30B-A3B's q/k/v and router (x from the input / post-attention
# norm), its o projection (x from attention), Llama-3-8B's (and Mixtral-8x7B's) q/k/v and o
SHAPES = [("qwen3_qkv", 2048, 5120, "norm"), ("qwen3_router", 2048, 128, "norm"),
          ("qwen3_o", 4096, 2048, "kernel"), ("llama_qkv", 4096, 6144, "norm"),
          ("llama_o", 4096, 4096, "kernel")]
SMOKE_SHAPES = [("tiny", 64, 32, "norm"), ("tiny_o", 64, 32, "kernel")]


def _kernels(interpret: bool):
    """(touch, make, consume) Pallas stand-ins: a kernel reading x [T, K]; one storing x from
    h, [T, K] or [S, T, K/S]; one summing partials [S, T, N] into [T, N] (bn columns a
    program)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from pjinfer.kernels.common import triton_params

    call = functools.partial(pl.pallas_call, compiler_params=triton_params(4, 1),
                             interpret=interpret)

    def whole(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    def touch(x):
        def body(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2
        return call(body, in_specs=[whole(x.shape)], out_specs=whole(x.shape),
                    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    def make(h, splits: int | None):
        t, k = h.shape
        shape = (t, k) if splits is None else (splits, t, k // splits)

        def body(h_ref, o_ref):
            x = h_ref[...] * 2
            o_ref[...] = x if splits is None else x.reshape(t, splits, k // splits
                                                            ).transpose(1, 0, 2)
        return call(body, in_specs=[whole(h.shape)], out_specs=whole(shape),
                    out_shape=jax.ShapeDtypeStruct(shape, h.dtype))(h)

    def consume(parts, bn: int):
        s, t, n = parts.shape

        def body(p_ref, o_ref):
            o_ref[...] = jnp.sum(p_ref[...].astype(jnp.float32), axis=0).astype(o_ref.dtype)
        return call(body, grid=(n // bn,),
                    in_specs=[pl.BlockSpec((s, t, bn), lambda j: (0, 0, j))],
                    out_specs=pl.BlockSpec((t, bn), lambda j: (0, j)),
                    out_shape=jax.ShapeDtypeStruct((t, n), jnp.bfloat16))(parts)

    return touch, make, consume


def routed_dense(x, w, block_n: int, k_splits: int, interpret: bool):
    """x [T, K] @ w [K, N] through the routed kernel (one expert that every token chose): its
    raw [S, Tp, N] K-range partials (Tp >= 16 rows, those past T unwritten), as a consumer
    that knows the layout would read them. One program a column block and K range: the first
    assignment does all the work, so the T - 1 programs a MoE step would add only look."""
    import jax.numpy as jnp

    from pjinfer.kernels import routed_matmul as rm

    ids = jnp.zeros((x.shape[0], 1), jnp.int32)
    out, q = rm._routed_call(x, w[None], [], ids, per_assignment=False, glu=None,
                             block_n=block_n, block_k=min(128, x.shape[1]), num_warps=4,
                             num_stages=3, splits=1, k_splits=k_splits,
                             dtype=x.dtype, interpret=interpret)
    return out.reshape(q, -1, w.shape[1])


def step_fn(form: str, source: str, splits: int, interpret: bool, block_n: int = 128):
    """f(h, weights per layer) -> h after every layer (each on the chain of the one before);
    `splits` and `block_n` (routed only) are the form's K ranges and column block."""
    import jax
    import jax.numpy as jnp

    touch, make, consume = _kernels(interpret)

    def norm(h):
        h32 = h.astype(jnp.float32)
        return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)
                ).astype(h.dtype)

    def layer(h, w):  # h [T, K], w [K, N]
        t, k = h.shape
        ws = w.reshape(splits, k // splits, -1)
        extra = 0.0
        if source == "kernel" and form == "batched":
            parts = jnp.einsum("stk,skn->stn", make(h, splits), ws,
                               preferred_element_type=jnp.float32)
        else:
            x = make(h, None) if source == "kernel" else norm(h)
            if source == "norm":
                extra = touch(x).astype(jnp.float32) * 1e-3
            if form == "plain":
                parts = jnp.dot(x, w, preferred_element_type=jnp.float32)[None]
            elif form == "reduce":  # no dot: XLA's reduction emitter, one kernel
                parts = jnp.sum(x.astype(jnp.float32)[:, :, None]
                                * w.astype(jnp.float32)[None], axis=1)[None]
            elif form == "routed":
                parts = routed_dense(x, w, block_n, splits, interpret)
            else:
                parts = jnp.einsum("tsk,skn->stn", x.reshape(t, splits, k // splits), ws,
                                   preferred_element_type=jnp.float32)
        y = consume(parts, min(128, parts.shape[2]))[:t]  # [T, N]
        return (h.astype(jnp.float32) + jnp.mean(y.astype(jnp.float32), -1, keepdims=True)
                + extra).astype(h.dtype)

    def run(h, weights):
        for w in weights:
            h = layer(h, w)
        return h

    return jax.jit(run)


KERNEL_OP = re.compile(r"^\s*\S+ = \S+ (fusion|custom-call|copy|transpose)\((.*)$", re.M)


def kernel_counts(hlo: str) -> dict[str, int]:
    """The optimized module's entry computation: its kernels by kind (fusion kind, custom
    call target, copy)."""
    counts: dict[str, int] = {}
    for op, rest in KERNEL_OP.findall(hlo[hlo.index("ENTRY"):]):
        kind = re.search(r"kind=(\w+)|custom_call_target=\"([^\"]+)\"", rest)
        key = op if kind is None else f"{op}:{kind.group(1) or kind.group(2)}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import jax

    record = new_record("splitk_probe", argv, vars(args))
    record["device"] = jax_device_info()
    interpret = jax.default_backend() != "gpu"
    timing = timing_plan(args.calls, args.samples, 2, on_cpu=interpret)
    record["rows"] = []
    for name, k, n, source in (SMOKE_SHAPES if args.smoke else SHAPES):
        weights = [_filled((k, n), 20 + i) for i in range(args.layers)]
        for t in args.tokens:
            h = _filled((t, k), 1)
            forms = ([("plain", args.splits[0], None)]
                     + ([("reduce", 1, None)] if args.reduce else [])
                     + [("batched", s, None) for s in args.splits]
                     + [("routed", s, dividing_block(bn, n)) for bn, s in args.routed])
            for form, splits, block_n in forms:
                fn = step_fn(form, source, splits, interpret, block_n)
                hlo = fn.lower(h, weights).compile().as_text()
                sec = pipelined_seconds(fn, (h, weights), sync=jax.block_until_ready, **timing)
                per_layer = min(sec) / args.layers
                counts = kernel_counts(hlo)
                row = {"shape": name, "k": k, "n": n, "source": source, "tokens": t,
                       "form": form, "splits": splits if form in ("batched", "routed") else None,
                       "block_n": block_n,
                       "us_per_layer": per_layer * 1e6,
                       "kernels_per_layer": {key: c / args.layers for key, c in counts.items()},
                       "weight_tb_s": k * n * 2 / per_layer / 1e12}
                record["rows"].append(row)
                print(f"{name} T={t} {form} S={row['splits']} bn={block_n}: "
                      f"{per_layer * 1e6:.2f} us/layer, {row['weight_tb_s']:.2f} TB/s, "
                      "kernels/layer "
                      f"{ {key: round(v, 2) for key, v in row['kernels_per_layer'].items()} }",
                      flush=True)
                if args.hlo_dir:
                    tag = f"{name}_t{t}_{form}_s{row['splits']}_n{block_n}"
                    with open(f"{args.hlo_dir}/{tag}.txt", "w") as f:
                        f.write(hlo)
        del weights
    return record


def _routed_tiling(text: str) -> tuple[int, int]:
    """'BLOCK_N:K_RANGES' -> (block_n, k_ranges), for argparse."""
    try:
        block_n, ranges = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected BLOCK_N:K_RANGES, e.g. 128:2") from None
    if block_n < 16 or block_n & (block_n - 1) or ranges < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: block_n must be a power of two >= 16 "
                                         "and K ranges >= 1")
    return block_n, ranges


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = kernel_bench_parser(__doc__)
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 8])
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[4, 8])
    parser.add_argument("--layers", type=positive_int, default=48)
    parser.add_argument("--routed", type=_routed_tiling, nargs="*", default=[],
                        metavar="BLOCK_N:K_RANGES",
                        help="also time the routed kernel as a dense GEMV at these tilings "
                             "(block_n a power of two, capped at N; K ranges dividing K's "
                             "128-wide blocks), e.g. 128:1 64:2")
    parser.add_argument("--reduce", action="store_true",
                        help="also time the projection as a float32 multiply-and-sum (no dot)")
    parser.add_argument("--hlo-dir", default=None, help="write each form's optimized HLO here")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--samples", type=int, default=None)
    args = parser.parse_args(argv)
    ks = sorted({k for _, k, _, _ in (SMOKE_SHAPES if args.smoke else SHAPES)})
    if any(k % s for k in ks for s in args.splits):
        parser.error(f"--splits must divide every projection's K ({ks}), got {args.splits}")
    finish_record(run(args, argv), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
