"""Device ceilings for the roofline, measured in the benchmark's own process by a step's own work.

- bandwidth: weight-streaming batched GEMV, x[l] [rows, hidden] @ W[l] for a stack of
  [hidden, intermediate] matrices totalling `stream_bytes`, which is what a decode step does with
  its weights. 16 GB on an accelerator (at most half its free memory), 16 MiB on a CPU.
  A read+write copy is the wrong yardstick: on the H200 it reads ~3.3 TB/s where the GEMV reads
  ~4.4-4.5, so a copy-based roofline would flatter every decode figure.
- compute: bf16 matmuls of a step's projection shapes (qkv, o, gate+up, down) at `tokens` rows,
  the engine's token budget (at most 16 on a CPU), not one 8192^3 square that no step runs.
Both are pipelined: `calls` calls queued back to back and one sync at the end, so the time is
the device's and not the host's launch gaps (a 2 GiB add timed one call at a time read
2.3-2.95 TB/s on the H200: the JAX records in benchmarks/results/ up to 2026-12-01).
`samples` such runs give a median and a best. The roofline divides by the best,
the least time the device was seen to need; the median is kept beside it because the H200's
clocks drop under sustained load (matmul median ~690 vs best ~805 TFLOP/s).
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ACCELERATOR_STREAM_BYTES = 16 * 10**9
CPU_STREAM_BYTES = 16 << 20  # CPU runs check the plumbing; its bf16 GEMV is slow (~0.5 GB/s)
ACCELERATOR_SAMPLES, CPU_SAMPLES = 30, 5
CPU_MATMUL_ROWS = 16  # an 8B model's shapes at 2048 rows would take ~20 minutes on a CPU


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Device limits; the roofline divides by the first two (best measured, or given)."""

    hbm_bytes_per_s: float  # bytes the GEMV moved (weights + x + out) / time
    matmul_flops_per_s: float
    source: str  # "measured", "given" or "from <json>"
    hbm_bytes_per_s_median: float | None = None
    matmul_flops_per_s_median: float | None = None
    details: dict | None = None


# ---- measuring ---------------------------------------------------------------------------
def measure_ceilings(model: Any, *, tokens: int = 2048, stream_bytes: int | None = None,
                     rows: int = 8, calls: int = 10, samples: int | None = None,
                     warmup: int = 2) -> Ceilings:
    """Both ceilings for `model` (a roofline ModelShape: only its dimensions are used), in JAX.

    `benchmarks/hf_baseline.py` measures the same plans through PyTorch.
    """
    import jax
    import jax.numpy as jnp

    on_cpu = jax.default_backend() == "cpu"
    timing = timing_plan(calls, samples, warmup, on_cpu=on_cpu)
    gemv = gemv_plan(model, stream_bytes or default_stream_bytes(), rows)
    w = _filled((gemv["matrices"], gemv["k"], gemv["n"]), 1)
    x = _filled((gemv["matrices"], rows, gemv["k"]), 2)  # per matrix: a batch dim, no transpose
    bandwidth = gemv | timed_rate(jax.jit(jnp.matmul), (x, w), gemv["bytes_per_call"], timing,
                                  jax.block_until_ready)
    del w, x
    mm = matmul_plan(model, min(tokens, CPU_MATMUL_ROWS) if on_cpu else tokens)
    operands = [(_filled((m, k), 2 * i), _filled((k, n), 2 * i + 1))
                for i, (m, k, n) in enumerate(mm["shapes_mkn"])]
    matmuls = jax.jit(lambda ops: [a @ b for a, b in ops])
    matmul = mm | timed_rate(matmuls, (operands,), mm["flops_per_call"], timing,
                             jax.block_until_ready)
    return ceilings_of(bandwidth, matmul, timing, source="measured")


def default_stream_bytes() -> int:
    """The GEMV stream for JAX's first device, from its free memory."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return stream_bytes_for(None)
    stats = device.memory_stats() or {}
    return stream_bytes_for(stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0))


def stream_bytes_for(free_bytes: int | None) -> int:
    """16 GB (a whole model's weights, far past any cache), at most half the free accelerator
    memory; `None` = a CPU, where only the plumbing is checked."""
    if free_bytes is None:
        return CPU_STREAM_BYTES
    return min(ACCELERATOR_STREAM_BYTES, free_bytes // 2) if free_bytes > 0 else 2 << 30


def timing_plan(calls: int, samples: int | None, warmup: int, *, on_cpu: bool) -> dict:
    return {"calls": calls, "warmup": warmup,
            "samples": samples or (CPU_SAMPLES if on_cpu else ACCELERATOR_SAMPLES)}


def gemv_plan(model: Any, stream_bytes: int, rows: int) -> dict[str, Any]:
    """x[l] [rows, hidden] @ W[l] [hidden, intermediate], bf16, for as many l as fit."""
    k, n = model.hidden_size, model.intermediate_size
    matrices = max(1, stream_bytes // (k * n * 2))
    moved = 2 * matrices * (k * n + rows * k + rows * n)  # weights + x read, out written
    return {"kind": "batched GEMV x[l] [rows, k] @ W[l] [k, n] for l < matrices (bf16)",
            "rows": rows, "k": k, "n": n, "matrices": matrices, "bytes_per_call": moved}


def matmul_plan(model: Any, tokens: int) -> dict[str, Any]:
    shapes = model.matmul_shapes(tokens)
    return {"kind": "bf16 matmuls [M, K] x [K, N]", "shapes_mkn": [list(s) for s in shapes],
            "flops_per_call": sum(2 * m * k * n for m, k, n in shapes)}


def ceilings_of(bandwidth: dict, matmul: dict, timing: dict, source: str) -> Ceilings:
    """Ceilings from two measured plans (`timed_rate` merged in): the best divides."""
    return Ceilings(hbm_bytes_per_s=bandwidth["best_per_s"],
                    matmul_flops_per_s=matmul["best_per_s"], source=source,
                    hbm_bytes_per_s_median=bandwidth["median_per_s"],
                    matmul_flops_per_s_median=matmul["median_per_s"],
                    details={"bandwidth": bandwidth, "matmul": matmul, "pipelined": timing})


def timed_rate(fn: Callable, args: tuple, work_per_call: int, timing: dict,
               sync: Callable[[Any], Any]) -> dict:
    """Median and best rate of `fn(*args)` (work per second) over pipelined samples."""
    seconds = pipelined_seconds(fn, args, sync=sync, **timing)
    median, best = statistics.median(seconds), min(seconds)
    return {"median_per_s": work_per_call / median, "best_per_s": work_per_call / best,
            "seconds_per_call": {"median": median, "best": best}}


def pipelined_seconds(fn: Callable, args: tuple, *, calls: int, samples: int, warmup: int,
                      sync: Callable[[Any], Any]) -> list[float]:
    """Per-call seconds of `samples` runs of `calls` queued calls; `sync(result)` waits for the
    device once per run (the device runs calls in order, so the last done means all done)."""
    for _ in range(warmup):
        sync(fn(*args))
    out = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(calls):
            result = fn(*args)
        sync(result)
        out.append((time.perf_counter() - start) / calls)
    return out


@functools.cache
def _filler(shape: tuple[int, ...], seed: int) -> Any:
    """A jitted bf16 array maker: one fused pass, no temporaries (jax.random would need 2x)."""
    import jax
    import jax.numpy as jnp

    def make() -> Any:
        h = jnp.full(shape, seed, jnp.uint32)
        for axis in range(len(shape)):
            h = h * jnp.uint32(0x9E3779B1) + jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        h = (h ^ (h >> 16)) * jnp.uint32(0x7FEB352D)
        h = (h ^ (h >> 15)) * jnp.uint32(0x846CA68B)
        u = (h >> 8).astype(jnp.float32) * (2.0 ** -23) - 1.0  # uniform in [-1, 1)
        return u.astype(jnp.bfloat16)

    return jax.jit(make)


def _filled(shape: tuple[int, ...], seed: int) -> Any:
    """Pseudo-random bf16: zeros would run matmuls ~13% faster on the H200 (less switching)."""
    return _filler(tuple(shape), seed)()


# ---- from the command line and into the record ---------------------------------------------
def add_roofline_args(parser: Any, *, can_measure: bool = True) -> None:
    group = parser.add_argument_group("roofline")
    if can_measure:
        group.add_argument("--no-roofline", action="store_true",
                           help="skip measuring the ceilings and the roofline fields")
    group.add_argument("--ceilings-from", default=None, metavar="JSON",
                       help="take the ceilings from an earlier result record (e.g. a "
                            "`pjinfer bench roofline` JSON) instead of measuring them")
    group.add_argument("--hbm-bandwidth", type=float, default=None, metavar="TB/S",
                       help="use this weight-streaming bandwidth instead of measuring it")
    group.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP/S",
                       help="use this bf16 matmul rate instead of measuring it")


def ceilings_from_args(args: Any, model: Callable[[], Any] | None = None,
                       tokens: int = 2048) -> Ceilings | None:
    """--no-roofline: None; given values; --ceilings-from; else measured for `model()` (a
    callable returning a ModelShape), or None where this command must not measure."""
    if getattr(args, "no_roofline", False):
        return None
    if args.hbm_bandwidth and args.peak_tflops:
        return Ceilings(args.hbm_bandwidth * 1e12, args.peak_tflops * 1e12, source="given")
    if args.ceilings_from:
        return load_ceilings(args.ceilings_from)
    return measure_ceilings(model(), tokens=tokens) if model else None


def load_ceilings(path: str) -> Ceilings:
    """The ceilings of an earlier record; a record from before 2026-12-01 has no medians and
    holds single-call copy / 8192^3 figures, which its source then says."""
    c = json.loads(Path(path).read_text()).get("ceilings")
    if not c:
        raise SystemExit(f"--ceilings-from {path}: the record has no ceilings")
    old = "" if "hbm_bytes_per_s_median" in c else ", old single-call ceilings"
    return Ceilings(c["hbm_bytes_per_s"], c["matmul_flops_per_s"],
                    source=f"from {path} ({c.get('source')}{old})",
                    hbm_bytes_per_s_median=c.get("hbm_bytes_per_s_median"),
                    matmul_flops_per_s_median=c.get("matmul_flops_per_s_median"),
                    details=c.get("details"))


def ceilings_record(c: Ceilings | None) -> dict | None:
    if c is None:
        return None
    return {**asdict(c), "hbm_tb_per_s": c.hbm_bytes_per_s / 1e12,
            "matmul_tflops": c.matmul_flops_per_s / 1e12,
            "roofline_divides_by": "hbm_bytes_per_s and matmul_flops_per_s (the best rates, "
                                   "where measured)"}
