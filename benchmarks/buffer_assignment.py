"""Digest of XLA's buffer-assignment dumps: what a compiled step allocates as it runs.

A step's temporaries live in one `preallocated-temp` allocation whose size XLA's memory
analysis reports (`kv_budget.step_allocation`); when that is larger than the engine reserved
(an out-of-memory at a full batch), this says which values fill it. Dump the step's modules
with `XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_module_re=multi_decode"`, then:

  python -m pjinfer.benchmarks.buffer_assignment DIR --top 25 --out digest.json

Per `*buffer-assignment.txt`: the allocations by kind and size, and the largest logical values
with the instruction that defines each (values of the temp allocation may share bytes; the
largest ones are what a peak is made of).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
VALUE = re.compile(r"^ value: <(\d+) ([^@>]+?) @[^>]*> \(size=(\d+),offset=(\d+)\): (.*)$")
DEFINED = re.compile(r"^ from instruction: (.*)$")
VALUE_HEADER = re.compile(r"^<(\d+) ([^@>]+?) @")


def digest(text: str, top: int) -> dict:
    """The allocations (index, bytes, kind) and the `top` largest values of one dump."""
    allocations, values, defined, current = [], [], {}, None
    for line in text.splitlines():
        if m := ALLOCATION.match(line):  # e.g. ", preallocated-temp:"
            allocations.append({"index": int(m.group(1)), "bytes": int(m.group(2)),
                                "kind": m.group(3).strip(" :,")[:80] or "other"})
        elif (m := VALUE.match(line)) and allocations:
            values.append({"allocation": allocations[-1]["index"], "name": m.group(2),
                           "bytes": int(m.group(3)), "shape": m.group(5)[:120]})
        elif m := VALUE_HEADER.match(line):
            current = m.group(2)
        elif (m := DEFINED.match(line)) and current is not None:
            defined.setdefault(current, m.group(1)[:240])
    temp = {a["index"] for a in allocations if "preallocated-temp" in a["kind"]}
    largest = sorted((v for v in values if v["allocation"] in temp),
                     key=lambda v: -v["bytes"])[:top]
    for v in largest:
        v["instruction"] = defined.get(v["name"], "")
    return {"temp_bytes": sum(a["bytes"] for a in allocations if a["index"] in temp),
            "allocations": sorted(allocations, key=lambda a: -a["bytes"])[:top],
            "largest_temp_values": largest}


def _with_values(dump: Path) -> str:
    """A dump's text and its `-values` sibling's (newer XLA writes each value's defining
    instruction there)."""
    values = dump.with_name(dump.name.replace("assignment.txt", "assignment-values.txt"))
    return dump.read_text() + (values.read_text() if values.exists() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump_dir", help="the --xla_dump_to folder")
    parser.add_argument("--top", type=int, default=25, help="values listed per module")
    parser.add_argument("--out", default=None, help="JSON file (default: print)")
    args = parser.parse_args()
    if args.top < 1:
        parser.error(f"--top must be a positive integer, got {args.top}")
    files = sorted(Path(args.dump_dir).glob("*buffer-assignment.txt"))
    if not files:
        parser.error(f"no *buffer-assignment.txt under {args.dump_dir}: dump with "
                     "XLA_FLAGS=--xla_dump_to=DIR (and --xla_dump_hlo_module_re=NAME)")
    result = {f.name: digest(_with_values(f), args.top) for f in files}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    for name, d in result.items():
        print(f"{name}: temp {d['temp_bytes'] / 2**30:.2f} GiB")
        for v in d["largest_temp_values"][:8]:
            print(f"  {v['bytes'] / 2**20:9.1f} MiB {v['shape'][:60]}  {v['instruction'][:100]}")
    if not args.out:
        print(text)


if __name__ == "__main__":
    main()
