"""Digest of an Nsight Compute report's CSV pages: per profiled launch, the figures that say
what bounds a kernel (time, DRAM throughput, occupancy and its limiters, issue use), where
its warps stall (sampled stall reasons), and the SASS instructions holding the most samples.

`run_h200.sh int4ncu` writes the pages (`ncu -i REPORT --csv --page details | raw | source
--print-source sass`); this reads them back (plain or gzipped) into one JSON:

  python -m pjinfer.benchmarks.ncu_summary --details int4_details.csv --raw int4_raw.csv.gz \
      --sass int4_sass.csv.gz --out ncu_summary.json
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

DETAILS = ("Duration", "Memory Throughput", "DRAM Throughput", "Registers Per Thread",
           "Dynamic Shared Memory Per Block", "Grid Size", "Block Size", "Waves Per SM",
           "Block Limit Registers", "Block Limit Shared Mem", "Theoretical Occupancy",
           "Achieved Occupancy", "Issue Slots Busy", "Warp Cycles Per Issued Instruction",
           "Executed Instructions")
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
TOP_INSTRUCTIONS = 12


def _text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def details(path: str) -> list[dict]:
    """Per launch (in profiling order): {metric: "value unit"} for `DETAILS`; a metric
    listed twice (a percentage and a rate) keeps both."""
    launches: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(_text(path))):
        if row["Metric Name"] in DETAILS:
            got = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})
            value = f"{row['Metric Value']} {row['Metric Unit']}".strip()
            name = row["Metric Name"]
            got[name] = value if name not in got else f"{got[name]}; {value}"
    return [launches[k] for k in sorted(launches, key=int)]


def stalls(path: str) -> list[dict]:
    """Per launch: sampled warp stall reasons (all samples, not only the unissued ones),
    largest first."""
    rows = list(csv.reader(io.StringIO(_text(path))))
    header, data = rows[0], rows[2:]  # the second row holds units
    columns = [(i, h[len(STALL_PREFIX):]) for i, h in enumerate(header)
               if h.startswith(STALL_PREFIX) and not h.endswith("_not_issued")]
    out = []
    for d in data:
        counts = {name: int(float(d[i].replace(",", "") or 0)) for i, name in columns}
        out.append(dict(sorted(((k, v) for k, v in counts.items() if v),
                               key=lambda kv: -kv[1])))
    return out


def sass(path: str) -> list[dict]:
    """Per launch: samples by opcode and the instructions with the most samples (their
    two top stall reasons)."""
    blocks: list[list[str]] = []
    for line in _text(path).split("\n"):
        if line.startswith('"Kernel Name"'):
            blocks.append([])
        elif blocks and line:
            blocks[-1].append(line)
    return [_sass_block(list(csv.reader(b))) for b in blocks]


def _sass_block(rows: list[list[str]]) -> dict:
    header, data = rows[0], rows[1:]
    src, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    reasons = [(i, h[len("stall_"):]) for i, h in enumerate(header)
               if h.startswith("stall_") and "Not Issued" not in h]
    by_op: collections.Counter = collections.Counter()
    rows_out = []
    for d in data:
        words = d[src].split()
        if not words:
            continue
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0])
        n = int(d[samples] or 0)
        by_op[op.split(".")[0]] += n
        top = sorted(((int(d[i] or 0), name) for i, name in reasons), reverse=True)[:2]
        rows_out.append({"sass": d[src].strip(), "samples": n,
                         "reasons": {name: c for c, name in top if c}})
    rows_out.sort(key=lambda r: -r["samples"])
    return {"samples": sum(by_op.values()), "by_opcode": dict(by_op.most_common()),
            "top_instructions": rows_out[:TOP_INSTRUCTIONS]}


def summarize(details_csv: str, raw_csv: str | None, sass_csv: str | None) -> list[dict]:
    """One entry per profiled launch, the three pages side by side."""
    out = details(details_csv)
    for key, pages in (("stall_samples", stalls(raw_csv) if raw_csv else []),
                       ("sass", sass(sass_csv) if sass_csv else [])):
        for launch, page in zip(out, pages, strict=False):
            launch[key] = page
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--details", required=True, help="ncu --page details --csv output")
    p.add_argument("--raw", help="ncu --page raw --csv output")
    p.add_argument("--sass", help="ncu --page source --print-source sass --csv output")
    p.add_argument("--out", required=True, help="JSON path")
    a = p.parse_args(argv)
    summary = summarize(a.details, a.raw, a.sass)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    for n, launch in enumerate(summary):
        stalled = list(launch.get("stall_samples", {}).items())[:4]
        print(f"launch {n}: {launch.get('Duration')}, DRAM {launch.get('DRAM Throughput')}, "
              f"issue {launch.get('Issue Slots Busy')}, top stalls {stalled}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
