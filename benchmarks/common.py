"""What every benchmark shares: the result record, percentiles, progress, the stdout table.

Each run writes one JSON record so a figure in RESULTS.md can always be traced back to the exact
command, software and device that produced it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
PERCENTILES = (50, 90, 99)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def software_versions() -> dict[str, str | None]:
    """Versions read from the modules themselves: the repo may be on PYTHONPATH, not installed."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "pjinfer", "numpy", "transformers", "torch", "httpx"):
        module = sys.modules.get(name)
        out[name] = getattr(module, "__version__", None) if module else None
    return out


def jax_device_info() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "device_count": len(devices)}


def new_record(command: str, argv: Sequence[str], settings: dict[str, Any]) -> dict[str, Any]:
    """The skeleton every JSON result starts from; commands add `device`, `results`, ..."""
    return {"schema_version": SCHEMA_VERSION, "command": command, "argv": list(argv),
            "settings": settings, "started_at": now_iso(), "host": platform.node()}


def finish_record(record: dict[str, Any], path: str | None) -> dict[str, Any]:
    """Stamp versions and the end time (after the run, so lazily imported modules show up)."""
    record["software"] = software_versions()
    record["finished_at"] = now_iso()
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=2, default=_json_default) + "\n")
    return record


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float | int | None]:
    """mean / median / p90 / p99 / min / max of `values * scale` (nearest-rank-free, linear)."""
    xs = sorted(v * scale for v in values)
    if not xs:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None,
                "min": None, "max": None}
    out: dict[str, float | int | None] = {"count": len(xs), "mean": sum(xs) / len(xs)}
    for p in PERCENTILES:
        out["median" if p == 50 else f"p{p}"] = percentile(xs, p)
    out["min"], out["max"] = xs[0], xs[-1]
    return out


def percentile(sorted_xs: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on pre-sorted data."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    k = (len(sorted_xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (k - lo)


class Progress:
    """A tqdm bar on stderr (tqdm is one of pjinfer's dependencies), or none when disabled."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def median_call_seconds(fn, *args, reps: int = 20, repeats: int = 7) -> float:
    """Median seconds per call of a jitted `fn(*args)`: `repeats` samples of `reps`
    back-to-back async calls each, after two warm-up calls."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def print_table(title: str, rows: Sequence[tuple[str, Any]]) -> None:
    """A two-column summary on stdout, like vLLM's benchmark footers (a sweep whose every
    case failed has no rows: its errors are in the record, which is still written)."""
    rows = list(rows) or [("(no case ran; see the record's errors)", None)]
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 16)
    print(f"{line}\n{title.center(len(line))}\n{line}")
    for key, value in rows:
        print(f"{key + ':':<{width}}{_fmt(value):>16}")
    print(line)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) >= 1 else f"{value:.4g}"
    return str(value)


def kernel_bench_parser(doc: str) -> argparse.ArgumentParser:
    """The parser a kernel benchmark starts from: its docstring's first line, --out (the JSON
    record) and --smoke (tiny shapes, to check the plumbing on a CPU)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check)")
    return parser


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, else a usage error naming the value."""
    values = positive_ints(text)
    if len(values) != 1:
        _bad_int(text)
    return values[0]


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated integers >= 1 (e.g. "1,16,64"), else a usage error."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        _bad_int(text)
    return values


def power_of_two(text: str) -> int:
    """argparse type: a kernel tile size, K split or warp count, a power of two >= 1, else a
    usage error."""
    from pjinfer.kernels.common import is_pow2

    value = positive_int(text)
    if not is_pow2(value):
        raise argparse.ArgumentTypeError(
            f"{text!r}: not a power of two (tile sizes are powers of two: 16, 32, 64, ...; "
            "K splits and warp counts: 1, 2, 4, 8, ...)")
    return value


def _bad_int(text: str):
    raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, comma-separated "
                                     "where a list is allowed (e.g. 16 or 1,16,64)")
