"""Which kernels of an XLA dump take part in programmatic dependent launch (PDL), as JSON.

  XLA_FLAGS="--xla_dump_to=/tmp/dump" python3 benchmarks/step_probe.py ...   # GPU: any step
  python -m pjinfer.benchmarks.pdl_waits /tmp/dump --out pdl_waits.json

XLA turns PDL on by default (`xla_gpu_enable_pdl`): a kernel that starts with
`griddepcontrol.wait` may be launched while the kernel before it drains, which hides part of
each launch at the decode step's ~700 small kernels. Whether the Pallas kernels' custom calls
get that wait as XLA's own fusions do is what this answers: for every `.entry` of every PTX
file in the dump, its `griddepcontrol.wait` and `griddepcontrol.launch_dependents` counts.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pjinfer.benchmarks.common import finish_record, new_record

ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)?\.entry\s+([\w$.]+)\s*\(", re.M)


def ptx_entries(text: str) -> list[dict[str, Any]]:
    """Each kernel of one PTX module: its name and PDL instruction counts (an entry's text
    runs to the next entry, which is all the PTX there is between them)."""
    starts = [(m.start(), m.group(1)) for m in ENTRY.finditer(text)]
    out = []
    for i, (start, name) in enumerate(starts):
        body = text[start:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
        out.append({"kernel": name, "waits": body.count("griddepcontrol.wait"),
                    "launches_dependents": body.count("griddepcontrol.launch_dependents")})
    return out


def scan(dump: Path, expect: Sequence[str] = ()) -> dict[str, Any]:
    """Every PTX file under `dump`: its kernels, how many wait on the grid dependency, and
    which `expect`ed names (substrings: the Pallas kernels' names) no kernel carries, since
    a kernel whose PTX the dump lacks cannot be judged from it."""
    files = {str(p.relative_to(dump)): ptx_entries(p.read_text(errors="replace"))
             for p in sorted(dump.rglob("*.ptx"))}
    kernels = [k for entries in files.values() for k in entries]
    return {"files": files, "num_kernels": len(kernels),
            "num_waiting": sum(k["waits"] > 0 for k in kernels),
            "not_waiting": sorted({k["kernel"] for k in kernels if not k["waits"]}),
            "expected_but_absent": [e for e in expect
                                    if not any(e in k["kernel"] for k in kernels)]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dump", type=Path, help="an --xla_dump_to folder")
    p.add_argument("--expect", nargs="*", default=[], metavar="NAME",
                   help="kernel names (substrings) that should appear, e.g. the Pallas "
                        "kernels' routed_matmul moe_route")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    if not args.dump.is_dir():
        p.error(f"{args.dump} is not a folder: pass the --xla_dump_to folder of a GPU run")
    record = new_record("pdl_waits", argv, {"dump": str(args.dump), "expect": args.expect})
    record["results"] = result = scan(args.dump, args.expect)
    if not result["files"]:
        print(f"no .ptx files under {args.dump}: was it a GPU run with --xla_dump_to?")
    print(f"{result['num_waiting']} of {result['num_kernels']} kernels wait on the grid "
          f"dependency; not waiting: {', '.join(result['not_waiting']) or 'none'}")
    if result["expected_but_absent"]:
        print(f"no kernel named like {', '.join(result['expected_but_absent'])} in the dump's "
              "PTX: those kernels' PTX is not there, so this says nothing about them")
    return finish_record(record, args.out)


if __name__ == "__main__":
    main()
