"""What the device did during a profiled stretch of steps: kernels per step, busy time, gaps,
the heaviest kernels and one decoder layer's kernels in order.

Reads the Perfetto trace JSON that `jax.profiler.trace(dir, create_perfetto_trace=True)` writes
(`dir/plugins/profile/*/perfetto_trace.json.gz`). Device activity is every complete ("X") event
on a process whose name mentions the device (`/device:GPU:0` and its streams); on a CPU-only
run there is none, and the summary says so.
"""

from __future__ import annotations

import gzip
import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any


def find_trace(log_dir: str | Path) -> Path | None:
    """The newest Perfetto trace under a `jax.profiler.trace` log folder."""
    traces = sorted(Path(log_dir).glob("plugins/profile/*/perfetto_trace.json.gz"))
    return traces[-1] if traces else None


def load_events(path: str | Path) -> list[dict[str, Any]]:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_kernels(events: list[dict[str, Any]], device: str = "GPU") -> list[dict[str, Any]]:
    """Complete events on the device's processes (name metadata mentioning `device`)."""
    pids = {e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"
            and device in str(e.get("args", {}).get("name", ""))}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e]


def summarize(kernels: list[dict[str, Any]], steps: int, top: int = 40) -> dict[str, Any]:
    """Per step: kernel count, busy microseconds (the union of kernel intervals over all
    streams), the window from first start to last end, and idle time inside it; the kernels
    that take the most time."""
    if not kernels:
        return {"steps": steps, "device_events": 0}
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, cur_start, cur_end = 0.0, *intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    window = max(end for _, end in intervals) - intervals[0][0]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e["name"]].append(float(e["dur"]))
    heaviest = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "steps": steps, "device_events": len(kernels),
        "kernels_per_step": len(kernels) / steps,
        "busy_us_per_step": busy / steps, "window_us_per_step": window / steps,
        "idle_us_per_step": (window - busy) / steps,
        "top_kernels": [{"name": name[:120], "calls_per_step": len(d) / steps,
                         "us_per_step": sum(d) / steps} for name, d in heaviest],
        "one_layer": one_layer(kernels),
    }


LAYER_ANCHOR = "attention"  # one paged attention kernel a decoder layer
OP_ARGS = ("hlo_op", "tf_op", "long_name")  # what the profiler may say each kernel runs


def one_layer(kernels: list[dict[str, Any]], anchor: str = LAYER_ANCHOR) -> list[dict]:
    """A middle layer's kernels in launch order, each with its microseconds, the device's idle
    microseconds before it (from the end of every kernel started earlier: what the launch
    left unused), its own microseconds (the part of it after every earlier kernel's end: a
    kernel launched early by programmatic dependent launch sits waiting while the one before
    runs, and its whole span overstates it) and the ops the trace names for it (`OP_ARGS`):
    the kernels from the trace's second attention kernel up to its third (the layer as it
    runs from attention on). Names alone say little about XLA's fusions; the order says
    where each sits in the layer."""
    ordered = sorted(kernels, key=lambda e: float(e["ts"]))
    at = [i for i, e in enumerate(ordered) if anchor in e["name"]]
    if len(at) < 3:
        return []
    ends = list(itertools.accumulate((float(e["ts"]) + float(e["dur"]) for e in ordered), max))
    return [{"name": e["name"][:120], "us": float(e["dur"]),
             "idle_before_us": max(0.0, float(e["ts"]) - ends[i - 1]),
             "own_us": max(0.0, ends[i] - max(float(e["ts"]), ends[i - 1])),
             **{k: str(v)[:200] for k, v in e.get("args", {}).items() if k in OP_ARGS}}
            for i, e in enumerate(ordered[at[1]:at[2]], start=at[1])]


def summarize_dir(log_dir: str | Path, steps: int) -> dict[str, Any]:
    path = find_trace(log_dir)
    if path is None:
        return {"steps": steps, "error": f"no perfetto_trace.json.gz under {log_dir}"}
    events = load_events(path)
    summary = summarize(device_kernels(events), steps)
    if not summary["device_events"]:  # say what the trace did hold
        summary["processes"] = sorted({str(e.get("args", {}).get("name")) for e in events
                                       if e.get("name") == "process_name"})
    return summary


def device_profile(fn, *args, calls: int = 20) -> dict[str, Any]:
    """`summarize_dir` of `calls` back-to-back calls of a jitted `fn(*args)` (compiled and run
    once first): per call, the kernels the device ran and their busy time, without the host's
    dispatch that bounds a small kernel's wall-clock timing."""
    import tempfile

    import jax

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return summarize_dir(log_dir, calls)


def busy_seconds(summary: dict[str, Any]) -> float | None:
    """Device-busy seconds a step of a `summarize_dir` summary; None where the trace holds no
    device activity (CPU)."""
    busy = summary.get("busy_us_per_step")
    return None if not busy else busy * 1e-6


def device_busy_seconds(fn, *args, calls: int = 20) -> float | None:
    """Device-busy seconds per call of `fn(*args)` (`device_profile`, `busy_seconds`)."""
    return busy_seconds(device_profile(fn, *args, calls=calls))
