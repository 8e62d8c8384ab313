"""The routed expert GEMMs at decode sizes as a step runs them, per tiling, as JSON.

  python -m pjinfer.benchmarks.moe_decode_stack --out moe_decode_stack.json      # H200
  python -m pjinfer.benchmarks.moe_decode_stack --smoke --out /tmp/stack.json    # CPU plumbing

One jitted call runs `layers` MoE layers' routed GEMMs back to back (gate/up, then down, each
layer its own weights and its own random top-k routing), as a decode step does. Timing one GEMM
per call would time JAX's dispatch at 1-4 tokens, not the kernel (RESULTS.md, MoE round 4).
Bytes = the distinct experts each layer's tokens chose x K x N x 2 B; the bandwidth ceiling is
the weight-streaming GEMV measured in the same process (`benchmarks/ceilings.py`). Shapes:
Qwen3-30B-A3B (2048 -> 2 x 768, 128 experts, top-8) and Mixtral-8x7B (4096 -> 2 x 14336, 8
experts, top-2), with fewer layers than the models (the weights must be read from HBM, not L2,
and fit beside each other). `--expert-dtype fp8|int8` streams quantized experts
(`pjinfer.quantization.experts`: a byte a value, float32 scales counted in the bytes);
`fp8-block` as block-wise fp8 checkpoints hold them (Qwen3-30B-A3B-FP8: a scale per output
channel and 128-row K group, each K step scaling its sums; block_k must divide 128);
`int4` as 4-bit GPTQ / AWQ checkpoints' experts load (nibbles, scales per 128-row group,
block_k 128: one nibble block a step). `--padded-rows 8` runs x with the engine's batch-1
bucket of rows, the rows past the real tokens choosing no expert (what the kernels and the
sums after them see in a padded step).
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
from pjinfer.kernels.routed_matmul import ROUTED_SPLITS

MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8, layers=24),
    "mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, top_k=2, layers=6),
}
SMOKE = {"tiny": dict(hidden=64, inter=32, experts=8, top_k=2, layers=2)}


class _Shape:
    """What `measure_ceilings` reads: a GEMV stream of [hidden, 2 x inter] matrices."""

    def __init__(self, hidden: int, inter: int):
        self.hidden_size, self.intermediate_size = hidden, 2 * inter

    def matmul_shapes(self, tokens: int) -> list[tuple[int, int, int]]:
        return [(tokens, self.hidden_size, self.intermediate_size)]


BLOCK_K_GROUP = 128  # block-wise fp8 checkpoints' K blocks (Qwen3-30B-A3B-FP8, DeepSeek-V3)


def routing(tokens: int, experts: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """[tokens, top_k] distinct experts per token, uniformly at random."""
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)


def stack_fn(tiling: dict[str, int], interpret: bool):
    """Jitted f(x, ids per layer, gate_up per layer, down per layer): every layer's two routed
    GEMMs in order, each layer's input the previous layer's output (so none is skipped)."""
    import jax

    from pjinfer.kernels.expert_stack import silu_and_mul
    from pjinfer.kernels.routed_ffn_split import routed_ffn_split
    from pjinfer.kernels.routed_matmul import routed_ffn, routed_matmul
    from pjinfer.quantization.experts import QuantizedExperts

    shared = {k: v for k, v in tiling.items()
              if k not in ("down_k_splits", "fused", "swiglu_block_n")}
    down_k_splits = tiling["down_k_splits"]

    def stored(w):  # (values, scales) as the kernels take a stack; scales None for floats
        return (w.values, w.scales) if isinstance(w, QuantizedExperts) else (w, None)

    def gemm(x, w, ids, **kw):
        kw = {**shared, **kw}  # down's K ranges replace gate/up's
        values, scales = stored(w)
        return routed_matmul(x, values, ids, rhs_scales=scales, interpret=interpret, **kw)

    def ffn(x, gu, dn, ids):
        """`routed_ffn`: the activation in the down kernel's loads (fused 1) or gate/up's
        epilogue (fused 2, gate/up's columns `swiglu_block_n` wide)."""
        (gu, gu_scales), (dn, dn_scales) = stored(gu), stored(dn)
        blocks = (shared["block_n"], shared["block_k"])
        epilogue = tiling["fused"] == 2
        gate_blocks = (tiling["swiglu_block_n"], blocks[1]) if epilogue else blocks
        return routed_ffn(x, gu, dn, ids, gate_up_scales=gu_scales, down_scales=dn_scales,
                          blocks=(gate_blocks, blocks),
                          k_splits=(1 if epilogue else shared["k_splits"], down_k_splits),
                          activation="gate_up" if epilogue else "down",
                          num_warps=shared["num_warps"], num_stages=shared["num_stages"],
                          splits=shared["splits"], interpret=interpret)

    def run(x, ids, gate_up, down):
        for layer_ids, gu, dn in zip(ids, gate_up, down, strict=True):
            if tiling["fused"] == 3:
                y = routed_ffn_split(x, gu, dn, layer_ids, chunk=tiling["swiglu_block_n"],
                                     block_n=shared["block_n"], block_k=shared["block_k"],
                                     num_warps=shared["num_warps"],
                                     num_stages=shared["num_stages"],
                                     splits=shared["splits"], interpret=interpret)
            elif tiling["fused"]:
                y = ffn(x, gu, dn, layer_ids)
            else:  # the activation as an XLA kernel between the two
                h = gemm(x, gu, layer_ids, per_assignment=False)  # [T*k, 2I]
                y = gemm(silu_and_mul(h), dn, layer_ids, per_assignment=True,
                         k_splits=down_k_splits)
            x = y.reshape(x.shape[0], -1, x.shape[1]).sum(axis=1).astype(x.dtype)
        return x

    return jax.jit(run)


def layer_error(fn, x, ids, gate_up, down) -> float:
    """The stack `fn` over its first layer alone against the reference FFN (summed over each
    token's choices like the stack): relative error, float32 norms."""
    import jax.numpy as jnp

    from pjinfer.kernels import ops

    got = fn(x, ids[:1], gate_up[:1], down[:1]).astype(jnp.float32)
    want = ops.routed_ffn(x, gate_up[0], down[0], ids[0], backend="reference")
    want = want.reshape(x.shape[0], -1, x.shape[1]).astype(jnp.float32).sum(axis=1)
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def run_model(name: str, s: dict, tokens: list[int], tilings: list[dict], timing: dict,
              bandwidth: float, seed: int, expert_dtype: str = "bfloat16",
              check: bool = False, padded_rows: int = 0) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from pjinfer.quantization.experts import quantize_experts

    d, inter, e, k, n_layers = s["hidden"], s["inter"], s["experts"], s["top_k"], s["layers"]
    gate_up = [_filled((e, d, 2 * inter), 10 + i) for i in range(n_layers)]
    down = [_filled((e, inter, d), 100 + i) for i in range(n_layers)]
    per_expert = 2 * 3 * d * inter  # bf16 gate, up and down
    if expert_dtype != "bfloat16":  # a byte a value, float32 scales per output channel
        kind = "fp8" if expert_dtype == "fp8-block" else expert_dtype
        blocks = expert_dtype in ("fp8-block", "int4")  # K groups (smoke shapes: one)
        group = min(BLOCK_K_GROUP, d, inter)  # both stacks alike: one block_k (int4: 2 S)
        g_gu, g_dn = (group, group) if blocks else (d, inter)
        gate_up = [quantize_experts(w, kind, g_gu) for w in gate_up]
        down = [quantize_experts(w, kind, g_dn) for w in down]
        per_expert = sum(s.nbytes for s in (gate_up[0], down[0])) // e  # as stored
    interpret = jax.default_backend() != "gpu"
    rows = []
    for t in tokens:
        rng = np.random.default_rng(seed + t)
        ids = [routing(t, e, k, rng) for _ in range(n_layers)]
        touched = sum(len(np.unique(i)) for i in ids)
        moved = touched * per_expert  # gate, up and down of every expert read
        rows_in = max(t, padded_rows)  # the engine's bucket: padding tokens choose no expert
        ids = [np.pad(i, ((0, rows_in - t), (0, 0)), constant_values=-1) for i in ids]
        x = _filled((rows_in, d), 7)
        dev_ids = [jnp.asarray(i) for i in ids]
        entry: dict[str, Any] = {"model": name, "tokens": t, "rows": rows_in,
                                 "experts_read": touched,
                                 "expert_dtype": expert_dtype, "bytes": moved, "tilings": {}}
        for tiling in tilings:
            fn = stack_fn(tiling, interpret)
            try:
                sec = pipelined_seconds(fn, (x, dev_ids, gate_up, down),
                                        sync=jax.block_until_ready, **timing)
            except Exception as err:  # a tiling that does not compile (shared memory)
                entry["tilings"][_name(tiling)] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            best, median = min(sec), float(np.median(sec))
            entry["tilings"][_name(tiling)] = {
                "best_s": best, "median_s": median, "us_per_layer": best / n_layers * 1e6,
                "vs_bandwidth": moved / best / bandwidth}
            if check:
                entry["tilings"][_name(tiling)]["relative_error"] = layer_error(
                    fn, x, dev_ids, gate_up, down)
        ok = {n: r for n, r in entry["tilings"].items() if "best_s" in r}
        if ok:
            entry["best_tiling"] = min(ok, key=lambda n: ok[n]["best_s"])
        rows.append(entry)
        print(f"{name} T={t}: " + ", ".join(
            f"{n} {r['us_per_layer']:.1f} us/layer {r['vs_bandwidth']:.2f}"
            for n, r in ok.items()), flush=True)
    del gate_up, down
    return rows


def _name(tiling: dict[str, int]) -> str:
    name = "n{block_n}_k{block_k}_w{num_warps}_s{num_stages}_p{splits}".format(**tiling)
    if tiling["k_splits"] > 1 or tiling["down_k_splits"] > 1:  # names of earlier records kept
        name += "_q{k_splits}_{down_k_splits}".format(**tiling)
    if tiling["fused"] == 2:
        return name + "_epilogue{swiglu_block_n}".format(**tiling)
    if tiling["fused"] == 3:
        return name + "_split{swiglu_block_n}".format(**tiling)
    return name + ("_fused" if tiling["fused"] else "")


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import jax

    models = SMOKE if args.smoke else {m: MODELS[m] for m in args.models}
    record = new_record("moe_decode_stack", argv, vars(args))
    record.update(device=jax_device_info(), models=models)
    first = next(iter(models.values()))
    ceilings = measure_ceilings(_Shape(first["hidden"], first["inter"]), tokens=16,
                                calls=args.calls, samples=args.samples)
    record["ceilings"] = ceilings_record(ceilings)
    timing = timing_plan(args.calls, args.samples, 2, on_cpu=jax.default_backend() == "cpu")
    tilings = [dict(block_n=n, block_k=k, num_warps=w, num_stages=st, splits=sp, k_splits=q,
                    down_k_splits=dq, fused=f, swiglu_block_n=sn)
               for n, k, w, st, sp, q, dq, f, sn in itertools.product(
                   args.block_n, args.block_k, args.num_warps, args.num_stages, args.splits,
                   args.k_splits, args.down_k_splits, args.fused, args.swiglu_block_n)
               if f >= 2 or sn == args.swiglu_block_n[0]]  # the widths matter to 2 and 3
    record["rows"] = [row for name, s in models.items()
                      for row in run_model(name, s, args.tokens, tilings, timing,
                                           ceilings.hbm_bytes_per_s, args.seed,
                                           args.expert_dtype, args.check,
                                           args.padded_rows or 0)]
    best = [(r, r["tilings"][r["best_tiling"]]) for r in record["rows"] if "best_tiling" in r]
    print_table("Routed expert GEMMs, all layers in one call (best tiling)", [
        (f"{r['model']} T={r['tokens']} {r['best_tiling']}",
         f"{t['us_per_layer']:.1f} us/layer, {t['vs_bandwidth']:.2f} of bandwidth")
        for r, t in best])
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = kernel_bench_parser(__doc__)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--block-n", type=power_of_two, nargs="+", default=[128])
    parser.add_argument("--block-k", type=power_of_two, nargs="+", default=[128])
    parser.add_argument("--num-warps", type=power_of_two, nargs="+", default=[4])
    parser.add_argument("--num-stages", type=positive_int, nargs="+", default=[3])
    parser.add_argument("--splits", type=positive_int, nargs="+", default=[ROUTED_SPLITS],
                        help="programs per column block (at most one per assignment)")
    parser.add_argument("--k-splits", type=positive_int, nargs="+", default=[1],
                        help="K ranges of the gate/up GEMM (float32 partials summed after; "
                        "the kernel takes the largest count <= this that divides K's blocks, "
                        "the name keeps the count asked)")
    parser.add_argument("--down-k-splits", type=positive_int, nargs="+", default=[1],
                        help="K ranges of the down GEMM")
    parser.add_argument("--fused", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0],
                        help="1: `routed_ffn` (the activation in the down kernel's loads); 2: "
                        "`routed_ffn` with the activation in gate/up's epilogue (what the "
                        "engine runs where a block of >= 32 columns divides I); 3: "
                        "`routed_ffn_split` (one launch, a program an I chunk of an expert; "
                        "float stacks); 0: two routed_matmul calls with XLA's activation "
                        "kernel between")
    parser.add_argument("--swiglu-block-n", type=power_of_two, nargs="+", default=[64],
                        help="--fused 2: gate/up's column block (the engine's: 64 for Qwen3, "
                        "128 for Mixtral); --fused 3: the I chunk of a program")
    parser.add_argument("--expert-dtype", default="bfloat16",
                        choices=("bfloat16", "fp8", "int8", "fp8-block", "int4"),
                        help="experts as stored: bf16, or quantized (fp8 / int8 values; "
                        f"fp8-block: scales per {BLOCK_K_GROUP}-row K group too; int4: "
                        f"GPTQ-style nibbles, scales per {BLOCK_K_GROUP}-row group)")
    parser.add_argument("--check", action="store_true",
                        help="also each tiling's first layer against the reference FFN "
                        "(relative_error in the record)")
    parser.add_argument("--padded-rows", type=positive_int, default=None,
                        help="x's rows as the engine's decode bucket has them (8 at batch 1): "
                        "the rows past --tokens choose no expert (ids -1)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.padded_rows is not None and args.padded_rows > 64:
        parser.error("--padded-rows must be in 1..64 (the routed kernel's decode sizes)")
    if any(t < 1 or t > 64 for t in args.tokens):
        parser.error("--tokens must be in 1..64 (the routed kernel's decode sizes)")
    finish_record(run(args, argv), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
