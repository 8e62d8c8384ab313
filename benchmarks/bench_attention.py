"""GPU benchmark of the paged attention kernels at Llama-3-8B attention shapes.

Times the Pallas decode kernel and plain XLA attention (gather pages + dot, the
reference) for batch x context combinations, reports KV bytes read / time against a
device copy measured in the same run, tunes the decode tiling at one shape, and times
the ragged prefill kernel. Runs from a source checkout without installation:

    python3 benchmarks/bench_attention.py --out benchmarks/results/attention_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ensure_importable() -> None:
    """Maps `pjinfer.kernels` onto ./kernels like the installed package does."""
    sys.path.insert(0, str(REPO))
    import pjinfer

    if str(REPO) not in pjinfer.__path__:
        pjinfer.__path__.append(str(REPO))


_ensure_importable()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pjinfer.benchmarks.common import median_call_seconds  # noqa: E402
from pjinfer.benchmarks.trace_summary import device_busy_seconds  # noqa: E402
from pjinfer.kernels.common import AttentionParams  # noqa: E402
from pjinfer.kernels.decode_attention import (  # noqa: E402
    DecodeBlockSizes,
    decode_attention,
    decode_attention_reference,
    default_decode_block_sizes,
)
from pjinfer.kernels.metadata import AttentionMetadata  # noqa: E402
from pjinfer.kernels.ragged_attention import (  # noqa: E402
    RaggedBlockSizes,
    ragged_attention,
    ragged_attention_reference,
)
from pjinfer.kernels.rotary_write import to_cache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B attention
DTYPE = jnp.bfloat16
ATTN = AttentionParams(scale=HEAD_DIM**-0.5)


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes read + written per second of a large elementwise device pass (the HBM ceiling)."""
    x = jnp.ones((int(gib * 2**30) // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / median_call_seconds(f, x, reps=10, repeats=5)


def make_decode_inputs(batch: int, context: int, seed: int = 0):
    """Random bf16 cache with shuffled pages; every sequence has `context` tokens."""
    rng = np.random.default_rng(seed)
    pages = context // BLOCK_SIZE
    num_blocks = batch * pages + 1
    key = jax.random.PRNGKey(seed)
    kk, kv, kq = jax.random.split(key, 3)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(kk, shape, DTYPE)
    v_cache = jax.random.normal(kv, shape, DTYPE)
    tables = (rng.permutation(num_blocks - 1) + 1).reshape(batch, pages).astype(np.int32)
    q = jax.random.normal(kq, (batch, HEADS, HEAD_DIM), DTYPE)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k_cache, v_cache, jnp.asarray(tables), lens


def kv_bytes(batch: int, context: int) -> int:
    return batch * context * KV_HEADS * HEAD_DIM * 2 * jnp.dtype(DTYPE).itemsize


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def decode_fn(sizes: DecodeBlockSizes):
    return jax.jit(lambda *a: decode_attention(*a, ATTN, block_sizes=sizes))


XLA_DECODE = jax.jit(lambda *a: decode_attention_reference(*a, ATTN))


def tune_decode(batch: int, context: int, quick: bool) -> list[dict]:
    """Sweeps the decode tiling at one shape; returns rows sorted by time."""
    args = make_decode_inputs(batch, context)
    rows = []
    default = default_decode_block_sizes(batch, KV_HEADS, context // BLOCK_SIZE, BLOCK_SIZE)
    for pages in (2, 4, 8):
        for warps in (4, 8):
            for stages in (2,) if quick else (1, 2, 3):
                for splits in sorted({1, default.num_splits} if quick else {1, 2, 4}):
                    sizes = DecodeBlockSizes(pages, splits, warps, stages)
                    try:
                        t = median_call_seconds(decode_fn(sizes), *args, reps=10, repeats=5)
                    except Exception as e:  # a tiling Triton rejects is a result too
                        print("tune fail", sizes, type(e).__name__, str(e)[:200])
                        continue
                    rows.append(dict(dataclasses.asdict(sizes), time_s=t))
    return sorted(rows, key=lambda r: r["time_s"])


def decode_grid(best: DecodeBlockSizes | None, hbm: float) -> list[dict]:
    rows = []
    for batch in (1, 16, 64, 256):
        for context in (512, 4096, 32768):
            rows.append(decode_row(batch, context, best, hbm))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_row(batch: int, context: int, best: DecodeBlockSizes | None, hbm: float) -> dict:
    args = make_decode_inputs(batch, context)
    sizes = default_decode_block_sizes(batch, KV_HEADS, context // BLOCK_SIZE, BLOCK_SIZE)
    if best is not None:
        sizes = dataclasses.replace(best, num_splits=sizes.num_splits)
    row = dict(batch=batch, context=context, kv_bytes=kv_bytes(batch, context),
               block_sizes=dataclasses.asdict(sizes))
    t = median_call_seconds(decode_fn(sizes), *args)
    row.update(pallas_s=t, pallas_bw=row["kv_bytes"] / t, pallas_frac_hbm=row["kv_bytes"] / t / hbm)
    try:
        tx = median_call_seconds(XLA_DECODE, *args, reps=5, repeats=5)
        row.update(xla_s=tx, xla_bw=row["kv_bytes"] / tx, speedup_vs_xla=tx / t)
    except Exception as e:  # XLA materialises the gathered pages; large shapes may OOM
        row.update(xla_s=None, xla_error=type(e).__name__)
    del args
    return row


def check_correctness() -> dict:
    """bf16 kernels vs references on the GPU before any timing."""
    args = make_decode_inputs(8, 1000 // BLOCK_SIZE * BLOCK_SIZE, seed=1)
    lens = jnp.asarray(np.random.default_rng(2).integers(1, 992, 8), jnp.int32)
    args = (*args[:4], lens)
    ref = decode_attention_reference(*args, ATTN)
    errs = {}
    for splits in (1, 4):
        sizes = DecodeBlockSizes(num_splits=splits)
        out = decode_attention(*args, ATTN, block_sizes=sizes)
        errs[f"decode_splits{splits}"] = rel_err(out, ref)
    window_cap = dataclasses.replace(ATTN, sliding_window=100, soft_cap=30.0)
    out = decode_attention(*args, window_cap)
    ref = decode_attention_reference(*args, window_cap)
    errs["decode_window_cap"] = rel_err(out, ref)
    q, k_cache, v_cache, md = make_prefill_inputs([300, 1, 77], [700, 500, 77], seed=3)
    window = dataclasses.replace(ATTN, sliding_window=128)
    out = ragged_attention(q, k_cache, v_cache, md, window)
    ref = ragged_attention_reference(q, k_cache, v_cache, md, window)
    errs["ragged_window"] = rel_err(out, ref)
    return errs


def make_prefill_inputs(q_lens: list[int], seq_lens: list[int], seed: int = 0,
                        kv_dtype=DTYPE, kv_heads: int = KV_HEADS):
    """Ragged batch: sequence s has seq_lens[s] cached + new tokens, q_lens[s] of them new;
    the caches in `kv_dtype` (fp8: stored as the engine writes them, scale 1), `kv_heads`
    KV heads beside the 32 query heads."""
    rng = np.random.default_rng(seed)
    pages = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(pages) + 1
    perm = rng.permutation(num_blocks - 1) + 1
    tables = np.zeros((len(q_lens), max(pages)), np.int32)
    for s, start in enumerate(np.cumsum([0, *pages[:-1]])):
        tables[s, : pages[s]] = perm[start : start + pages[s]]
    kk, kv, kq = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        slot_mapping=jnp.zeros((int(qsl[-1]),), jnp.int32), block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(seq_lens, jnp.int32), query_start_loc=jnp.asarray(qsl),
    )
    q = jax.random.normal(kq, (int(qsl[-1]), HEADS, HEAD_DIM), DTYPE)
    k, v = (to_cache(jax.random.normal(key, shape, DTYPE), kv_dtype) for key in (kk, kv))
    return q, k, v, md


# Ragged layouts: (name, new tokens per sequence, context per sequence incl. the new ones).
RAGGED_LAYOUTS = (
    ("prefill_1x2048", [2048], [2048]),
    ("prefill_8x512", [512] * 8, [512] * 8),
    # the prompt steps of a 1,024-token throughput run at 8,192 tokens a step
    ("prefill_8x1024", [1024] * 8, [1024] * 8),
    ("prefill_1x8192", [8192], [8192]),  # issue 12's prefill-attention target shape
    # W3's steady state: 255 decodes at 1k context beside one 1,792-token prompt chunk
    ("mixed_255dec1k+1792", [1] * 255 + [1792], [1025] * 255 + [1792]),
    # W4's (synthetic ShareGPT) steps: ~200-token prompts beside decodes at a few hundred
    ("mixed_256dec300+8x220", [1] * 256 + [220] * 8, [300] * 256 + [220] * 8),
)


def cudnn_row(name: str, q_len: int, flops: int, kv_heads: int = KV_HEADS) -> dict:
    """cuDNN flash attention on the same causal single-sequence shape (contiguous K/V, no
    pages): the bar a paged kernel is measured against."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(kq, (1, q_len, HEADS, HEAD_DIM), DTYPE)
    k, v = (jax.random.normal(key, (1, q_len, kv_heads, HEAD_DIM), DTYPE) for key in (kk, kv))
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="cudnn"))
    try:
        t = median_call_seconds(fn, q, k, v, reps=5, repeats=5)
    except Exception as e:
        return dict(layout=name, cudnn_error=f"{type(e).__name__}: {str(e)[:200]}")
    return dict(layout=name, cudnn_s=t, tflops=flops / t / 1e12)


def prefill_rows(quick: bool, layouts: list[str] | None = None, kv_dtype=DTYPE,
                 device_time: bool = False, kv_heads: int = KV_HEADS) -> list[dict]:
    """Ragged kernel over every tiling in the sweep, per layout; FLOPs count causal pairs.
    Single-token sequences are skipped as the engine skips them (`ops.paged_attention` runs
    them through the decode kernel): the sweep times what the ragged kernel is given.
    `device_time`: `pallas_s` is the profiled device-busy time of the call (wall clock, which
    carries the host's dispatch at ~100 us, stays in `wall_s`). `kv_heads`: 8 is Llama-3-8B's
    grouping (4 query heads a KV head), 4 Qwen3-30B-A3B's (8 a KV head: twice the rows a
    tile's dots)."""
    rows = []
    for name, q_lens, seq_lens in RAGGED_LAYOUTS:
        if layouts and name not in layouts:
            continue
        args = make_prefill_inputs(q_lens, seq_lens, kv_dtype=kv_dtype, kv_heads=kv_heads)
        skip = 1 in q_lens
        pairs = [q * (2 * c - q + 1) // 2 for q, c in zip(q_lens, seq_lens, strict=True)]
        flops = 4 * sum(pairs) * HEADS * HEAD_DIM
        kernel_flops = 4 * sum(p for p, q in zip(pairs, q_lens, strict=True) if q > 1 or not skip
                               ) * HEADS * HEAD_DIM
        for bq in (16, 32) if quick else (16, 32, 64):
            for pages in (2, 4, 8):
                for warps in (4, 8):
                    for stages in (2,) if quick else (2, 3):
                        sizes = RaggedBlockSizes(block_q=bq, pages_per_compute_block=pages,
                                                 num_warps=warps, num_stages=stages)
                        fn = jax.jit(lambda *a, s=sizes, k=skip: ragged_attention(
                            *a, ATTN, block_sizes=s, skip_single_tokens=k))
                        try:
                            t = median_call_seconds(fn, *args, reps=5, repeats=5)
                        except Exception as e:
                            print("ragged fail", name, sizes, type(e).__name__, str(e)[:200])
                            continue
                        busy = device_busy_seconds(fn, *args, calls=5) if device_time else None
                        seconds = busy or t  # wall clock where the trace has no device
                        rows.append(dict(layout=name, block_sizes=dataclasses.asdict(sizes),
                                         pallas_s=seconds, wall_s=t, device_s=busy,
                                         tflops=kernel_flops / seconds / 1e12,
                                         skip_single_tokens=skip))
        if len(q_lens) == 1 and q_lens == seq_lens:
            rows.append(cudnn_row(name, q_lens[0], flops, kv_heads))
        xla = jax.jit(lambda *a: ragged_attention_reference(*a, ATTN))
        tx = median_call_seconds(xla, *args, reps=3, repeats=3)
        rows.append(dict(layout=name, xla_s=tx, tflops=flops / tx / 1e12))
        print("ragged", name, "done", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/attention.json")
    parser.add_argument("--skip-tune", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-decode", action="store_true", help="no decode grid")
    parser.add_argument("--quick", action="store_true", help="smaller tuning sweeps")
    parser.add_argument("--layouts", nargs="+", choices=[n for n, _, _ in RAGGED_LAYOUTS],
                        help="ragged layouts to time (default: all)")
    parser.add_argument("--device-time", action="store_true",
                        help="time the ragged sweep by the profiled device-busy time")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float8_e4m3fn"),
                        help="the ragged sweep's cache dtype (the decode parts stay bf16)")
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS, choices=(1, 2, 4, 8, 16, 32),
                        help="the ragged sweep's KV heads (32 query heads; 4: Qwen3-30B-A3B)")
    opts = parser.parse_args()
    result = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                  settings=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                ragged_kv_heads=opts.kv_heads,
                                block_size=BLOCK_SIZE, dtype="bfloat16",
                                ragged_kv_dtype=opts.kv_dtype))
    save = lambda: opts.out.write_text(json.dumps(result, indent=1))  # noqa: E731
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    result["correctness_rel_err"] = check_correctness()
    print("correctness", result["correctness_rel_err"], flush=True)
    result["hbm_copy_bytes_per_s"] = hbm = copy_bandwidth()
    print(f"copy bandwidth {hbm / 1e12:.2f} TB/s", flush=True)
    best = None
    if not opts.skip_tune:
        result["tune_64x4096"] = tune = tune_decode(64, 4096, opts.quick)
        print("tune top5", json.dumps(tune[:5]), flush=True)
        keys = ("pages_per_compute_block", "num_warps", "num_stages")
        top = {k: tune[0][k] for k in keys}
        best = DecodeBlockSizes(num_splits=1, **top)
        save()
    result["decode"] = [] if opts.skip_decode else decode_grid(best, hbm)
    save()
    if not opts.skip_prefill:
        result["prefill"] = prefill_rows(opts.quick, opts.layouts, jnp.dtype(opts.kv_dtype),
                                         opts.device_time, opts.kv_heads)
        save()
    print_table(result)


def print_table(result: dict) -> None:
    print(f"\n{result['device']}  jax {result['jax']}  copy "
          f"{result['hbm_copy_bytes_per_s'] / 1e12:.2f} TB/s")
    print("batch context  pallas_us  TB/s  %HBM   xla_us  speedup")
    for r in result["decode"]:
        xla = f"{r['xla_s'] * 1e6:8.1f} {r['speedup_vs_xla']:6.2f}x" if r.get("xla_s") else "  n/a"
        print(f"{r['batch']:5d} {r['context']:7d} {r['pallas_s'] * 1e6:9.1f} "
              f"{r['pallas_bw'] / 1e12:5.2f} {100 * r['pallas_frac_hbm']:5.1f} {xla}")
    rows = result.get("prefill", [])
    for r in rows:
        for impl in ("xla", "cudnn"):
            if f"{impl}_s" in r:
                print(f"ragged {r['layout']} {impl} {r[f'{impl}_s'] * 1e3:.2f} ms "
                      f"{r['tflops']:.1f} TFLOP/s")
    best = {}
    for r in rows:
        if "pallas_s" in r and (r["layout"] not in best
                                or r["pallas_s"] < best[r["layout"]]["pallas_s"]):
            best[r["layout"]] = r
    for name, r in best.items():
        print(f"ragged {name} pallas best {r['pallas_s'] * 1e3:.3f} ms {r['tflops']:.1f} "
              f"TFLOP/s {r['block_sizes']}")
    # One tiling serves every layout: rank tilings by their summed time over the layouts.
    totals: dict[str, list[float]] = {}
    for r in rows:
        if "pallas_s" in r:
            totals.setdefault(json.dumps(r["block_sizes"], sort_keys=True), []).append(
                r["pallas_s"])
    complete = {k: sum(v) for k, v in totals.items() if len(v) == len(best)}
    for key in sorted(complete, key=complete.get)[:5]:
        print(f"ragged sum over layouts {complete[key] * 1e3:.3f} ms {key}")


if __name__ == "__main__":
    main()
