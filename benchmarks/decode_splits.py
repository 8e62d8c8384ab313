"""Paged decode attention at a few-sequence, long-context step, swept over context splits, pages
per compute block, pipeline stages and warps: by default the engine's shapes for
Qwen3-30B-A3B with 10 sequences of 2,560 tokens (round 10: this kernel took 1.80 ms of an
11.6 ms step, 2.5 GB of KV at 0.29 of the bandwidth, with `default_decode_block_sizes`' 5
splits).

Inputs are laid out as the engine's step has them: the batch padded to its sequence bucket
(padding rows have length 0), block tables as wide as `--max-model-len` allows, pages
shuffled over the cache. Each tiling is checked against the reference, then timed (median of
`--samples` samples of `--calls` back-to-back calls; with `--device-time` the device-busy time
of `--calls` profiled calls instead, since a kernel of tens of microseconds is timed by the
host's dispatch otherwise); the record has ms, TB/s of KV read, and the default tiling's
place. `--kv-dtype float8_e4m3fn` runs the fp8 cache's kernels.

  python -m pjinfer.benchmarks.decode_splits --out decode_splits.json   # H200
  python -m pjinfer.benchmarks.decode_splits --splits 5 16 --pages 4 8 --stages 2 3 \
      --warps 4 8 --device-time --out decode_tilings.json
  python -m pjinfer.benchmarks.decode_splits --smoke --out /tmp/d.json  # CPU plumbing
"""

from __future__ import annotations

import argparse

from pjinfer.benchmarks.common import median_call_seconds, positive_int
from pjinfer.benchmarks.quant_matmul import write_record
from pjinfer.benchmarks.trace_summary import busy_seconds, device_profile


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=positive_int, default=32)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--seqs", type=positive_int, default=10)
    p.add_argument("--padded-seqs", type=positive_int, default=16,
                   help="the engine's sequence bucket")
    p.add_argument("--context", type=positive_int, default=2560)
    p.add_argument("--max-model-len", type=positive_int, default=4096)
    p.add_argument("--splits", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--pages", type=positive_int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=positive_int, nargs="+", default=[2],
                   help="Triton pipeline depths (2: the default tiling's)")
    p.add_argument("--warps", type=positive_int, nargs="+", default=[4])
    p.add_argument("--calls", type=positive_int, default=20)
    p.add_argument("--samples", type=positive_int, default=5)
    p.add_argument("--kv-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16",
                   help="the cache's dtype (float8_e4m3fn: what --kv-cache-dtype fp8 stores)")
    p.add_argument("--device-time", action="store_true",
                   help="also profile each tiling's calls: device-busy ms (a small kernel's "
                        "wall-clock ms is the host's dispatch); the best is then by these")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.seqs > a.padded_seqs or a.context > a.max_model_len or a.heads % a.kv_heads:
        p.error("need --seqs <= --padded-seqs, --context <= --max-model-len and --heads a "
                "multiple of --kv-heads")
    if a.smoke:
        a.heads, a.kv_heads, a.head_dim, a.seqs, a.padded_seqs = 4, 2, 16, 2, 4
        a.context, a.max_model_len, a.splits, a.pages = 40, 64, [1, 2], [1]
        a.stages, a.warps = a.stages[:2], a.warps[:1]
        a.calls, a.samples = 1, 1
    return a


def _inputs(a: argparse.Namespace):
    """q [S, H, D], caches [NB, bs, KVH, D], tables [S, MB], lens [S]: `seqs` real rows of
    `context` tokens, the rest of the bucket empty."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    used = -(-a.context // a.block_size)
    width = -(-a.max_model_len // a.block_size)
    num_blocks = a.seqs * used + 1
    shape = (num_blocks, a.block_size, a.kv_heads, a.head_dim)
    kk, kv, kq = jax.random.split(jax.random.PRNGKey(0), 3)
    tables = np.zeros((a.padded_seqs, width), np.int32)
    tables[:a.seqs, :used] = (rng.permutation(num_blocks - 1) + 1).reshape(a.seqs, used)
    lens = np.zeros(a.padded_seqs, np.int32)
    lens[:a.seqs] = a.context
    return (jax.random.normal(kq, (a.padded_seqs, a.heads, a.head_dim), jnp.bfloat16),
            jax.random.normal(kk, shape, jnp.bfloat16).astype(a.kv_dtype),
            jax.random.normal(kv, shape, jnp.bfloat16).astype(a.kv_dtype),
            jnp.asarray(tables), jnp.asarray(lens))


def run(argv: list[str] | None = None) -> dict:
    import jax
    import numpy as np

    from pjinfer.kernels.common import AttentionParams
    from pjinfer.kernels.decode_attention import (
        DecodeBlockSizes,
        decode_attention,
        decode_attention_reference,
        default_decode_block_sizes,
    )

    a = _args(argv)
    args = _inputs(a)
    attn = AttentionParams(scale=a.head_dim ** -0.5)
    interpret = jax.default_backend() == "cpu"
    kv_bytes = a.seqs * a.context * a.kv_heads * a.head_dim * 2 * args[1].dtype.itemsize  # K, V
    ref = np.asarray(decode_attention_reference(*args, attn), np.float32)[:a.seqs]
    default = default_decode_block_sizes(a.padded_seqs, a.kv_heads, args[3].shape[1],
                                         a.block_size, args[1].dtype)
    tilings = {DecodeBlockSizes(pages_per_compute_block=p, num_splits=s, num_warps=w,
                                num_stages=st)
               for p in a.pages for s in a.splits for w in a.warps for st in a.stages}
    rows = []
    for sizes in sorted(tilings | {default}, key=lambda b: (
            b.pages_per_compute_block, b.num_splits, b.num_warps, b.num_stages)):
        fn = jax.jit(lambda *x, sizes=sizes: decode_attention(
            *x, attn, block_sizes=sizes, interpret=interpret))
        out = np.asarray(fn(*args), np.float32)[:a.seqs]
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
        wall = median_call_seconds(fn, *args, reps=a.calls, repeats=a.samples)
        profile = device_profile(fn, *args, calls=a.calls) if a.device_time else {}
        busy = busy_seconds(profile)
        kernels = profile.get("kernels_per_step")  # the attention kernel, then XLA's merge
        seconds = busy or wall
        rows.append({"pages": sizes.pages_per_compute_block, "splits": sizes.num_splits,
                     "warps": sizes.num_warps, "stages": sizes.num_stages,
                     "default": sizes == default,
                     "ms": seconds * 1e3, "wall_ms": wall * 1e3,
                     "device_ms": None if busy is None else busy * 1e3,
                     "tb_per_s": kv_bytes / seconds / 1e12, "rel_err": err,
                     "kernels_per_call": kernels,
                     "kernels": profile.get("top_kernels")})
        print(f"pages {rows[-1]['pages']:2d} splits {rows[-1]['splits']:3d} warps "
              f"{sizes.num_warps} stages {sizes.num_stages}"
              f"{' (default)' if sizes == default else ''}: {seconds * 1e3:7.3f} ms  "
              f"{rows[-1]['tb_per_s']:5.2f} TB/s  err {err:.1e}"
              f"{'' if kernels is None else f'  {kernels} kernels'}", flush=True)
    best = min(rows, key=lambda r: r["ms"])
    record = {"device": jax.devices()[0].device_kind, "shape": vars(a), "kv_bytes": kv_bytes,
              "rows": rows, "best": best,
              "default_vs_best": next(r["ms"] for r in rows if r["default"]) / best["ms"]}
    write_record(a.out, record)
    return record


if __name__ == "__main__":
    run()
