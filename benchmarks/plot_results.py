"""Regenerate the result plots from the JSON records in benchmarks/results/ (recursively).

  python3 benchmarks/plot_results.py [--results benchmarks/results] [--out benchmarks/results]

Writes serve_throughput_vs_rate.png (output tokens/s and p99 TPOT against request rate, one line
per framework), latency_percentiles.png (median/p90/p99 of TTFT, TPOT and E2E for every
latency run) and throughput_vs_roofline.png (each offline throughput run's output tokens/s over
its roofline; only records of the pipelined-ceiling roofline, which carry
`compute_s_over_elapsed`: older records divided by single-call ceilings and are not
comparable). Needs matplotlib; without it, says so and exits 0 (plots are optional).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(__file__).resolve().parent / "results"


def load_records(folder: Path) -> list[dict[str, Any]]:
    """Every benchmark record under `folder` (files that are not records are skipped)."""
    records = []
    for path in sorted(folder.rglob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and "command" in rec and "results" in rec:
            rec["_path"] = str(path)
            records.append(rec)
    return records


def serve_points(records: list[dict[str, Any]]) -> list[tuple[float, float, float | None]]:
    """(request rate, output tokens/s, p99 TPOT ms) of each finite-rate serve run, by rate."""
    points = []
    for rec in records:
        rate = rec["settings"].get("request_rate")
        if rec["command"] == "serve" and rate not in (None, float("inf")):
            p99 = rec["results"]["tpot_s"]["p99"]
            points.append((rate, rec["results"]["output_throughput"],
                           None if p99 is None else p99 * 1e3))
    return sorted(points)


def latency_rows(records: list[dict[str, Any]]) -> list[tuple[str, dict[str, dict]]]:
    """(label, {metric: summary}) for each latency run, pjinfer and transformers alike."""
    rows = []
    for rec in records:
        if rec["command"] in ("latency", "hf-latency"):
            s = rec["settings"]
            who = "transformers" if rec["command"] == "hf-latency" else "pjinfer"
            label = f"{who} b{s['batch_size']} {s['input_len']}/{s['output_len']}"
            rows.append((label, {k: rec["results"][k] for k in ("ttft_s", "tpot_s", "e2e_s")}))
    return rows


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def roofline_rows(records: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(record name, output tokens/s over the roofline's) of each throughput run whose
    ratios come from the pipelined-ceiling roofline."""
    return [(Path(rec["_path"]).stem, rec["ratios"]["output_tokens_per_s_vs_roofline"])
            for rec in records if rec["command"] == "throughput"
            and "compute_s_over_elapsed" in (rec.get("ratios") or {})]


def plot_roofline(plt: Any, rows: list, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r[1] for r in rows])
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlim(0, 1)
    ax.set_xlabel("output tokens/s over the roofline's")
    ax.set_title("offline throughput vs roofline")
    return _save(fig, out / "throughput_vs_roofline.png")


def plot_serve(plt: Any, points: list, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label="output tokens/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    tpot = [(p[0], p[2]) for p in points if p[2] is not None]
    if tpot:
        ax2 = ax.twinx()
        ax2.plot(*zip(*tpot, strict=True), "s--", color="tab:red", label="p99 TPOT")
        ax2.set_ylabel("p99 TPOT (ms)")
    ax.set_title("pjinfer serve: throughput vs request rate")
    return _save(fig, out / "serve_throughput_vs_rate.png")


def plot_latency(plt: Any, rows: list, out: Path) -> Path:
    metrics = ("ttft_s", "tpot_s", "e2e_s")
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.5 * len(rows) + 2.5))
    for ax, metric in zip(axes, metrics, strict=True):
        for i, (_, summaries) in enumerate(rows):
            s = summaries[metric]
            values = [s[p] * 1e3 if s[p] is not None else 0 for p in ("median", "p90", "p99")]
            ax.barh([i - 0.25, i, i + 0.25], values, height=0.25,
                    color=["tab:blue", "tab:orange", "tab:red"])
        ax.set_yticks(range(len(rows)), [r[0] for r in rows] if metric == "ttft_s" else [])
        ax.set_xscale("log")
        ax.set_title(f"{metric[:-2].upper()} ms (median / p90 / p99)")
    return _save(fig, out / "latency_percentiles.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots made (pip install matplotlib)")
        return 0
    records = load_records(args.results)
    args.out.mkdir(parents=True, exist_ok=True)
    made = []
    if points := serve_points(records):
        made.append(plot_serve(plt, points, args.out))
    if rows := latency_rows(records):
        made.append(plot_latency(plt, rows, args.out))
    if ratios := roofline_rows(records):
        made.append(plot_roofline(plt, ratios, args.out))
    print(f"{len(records)} records in {args.results}; wrote "
          f"{', '.join(map(str, made)) or 'nothing (no serve or latency records)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
