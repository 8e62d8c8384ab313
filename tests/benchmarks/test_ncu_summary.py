"""The Nsight Compute digest reads the three CSV pages as ncu writes them (two launches)."""

from __future__ import annotations

import csv
import gzip
import json

from pjinfer.benchmarks import ncu_summary

DETAIL_COLUMNS = ["ID", "Process ID", "Kernel Name", "Section Name", "Metric Name",
                  "Metric Unit", "Metric Value"]


def _write_details(path):
    rows = [("0", "Duration", "us", "20.93"), ("0", "Memory Throughput", "%", "31.62"),
            ("0", "Memory Throughput", "Tbyte/s", "1.52"), ("0", "SM Frequency", "Ghz", "1.8"),
            ("1", "Duration", "us", "17.63"), ("1", "Registers Per Thread",
                                               "register/thread", "96")]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(DETAIL_COLUMNS)
        for launch, name, unit, value in rows:
            w.writerow([launch, "1", "weight_only_int4_matmul", "s", name, unit, value])


def _write_raw(path):
    header = ["ID", "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
              "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued",
              "smsp__pcsamp_warps_issue_stalled_wait", "smsp__pcsamp_warps_issue_stalled_drain"]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerows([header, ["", "", "", "", ""], ["0", "737", "614", "1,243", "0"],
                     ["1", "376", "300", "227", "17"]])


def _write_sass(path):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
              "stall_wait", "stall_long_sb (Not Issued)"]
    kernels = [[("0x10", "LDG.E.U16 R20, desc[UR8][R20.64]", "9", "0", "9", "0"),
                ("0x20", "STS.U16 [R75+UR4+0x11800], R20", "532", "530", "2", "530")],
               [("0x10", "@P0   BRA 0x7f9f0b7b0b20", "33", "15", "12", "15"),
                ("0x20", "UISETP.GT.AND UP0, UPT, UR5, 0x1, UPT", "326", "323", "2", "323")]]
    with open(path, "w", newline="") as f:
        for rows in kernels:
            f.write('"Kernel Name","weight_only_int4_matmul",\n')
            w = csv.writer(f, quoting=csv.QUOTE_ALL)
            w.writerow(header)
            w.writerows(rows)


def test_digest_per_launch(tmp_path):
    details, raw, sass = tmp_path / "d.csv", tmp_path / "r.csv.gz", tmp_path / "s.csv"
    _write_details(details)
    _write_raw(raw)
    _write_sass(sass)
    out = tmp_path / "summary.json"
    assert ncu_summary.main(["--details", str(details), "--raw", str(raw), "--sass", str(sass),
                             "--out", str(out)]) == 0
    first, second = json.loads(out.read_text())
    assert first["Duration"] == "20.93 us" and "SM Frequency" not in first
    assert first["Memory Throughput"] == "31.62 %; 1.52 Tbyte/s"  # both forms kept
    assert second["Registers Per Thread"] == "96 register/thread"
    # stall reasons, all samples, largest first; empty ones and _not_issued left out
    assert list(first["stall_samples"].items()) == [("wait", 1243), ("long_scoreboard", 737)]
    assert second["stall_samples"] == {"long_scoreboard": 376, "wait": 227, "drain": 17}
    assert first["sass"]["by_opcode"] == {"STS": 532, "LDG": 9}
    assert second["sass"]["by_opcode"] == {"UISETP": 326, "BRA": 33}  # predicate skipped
    top = second["sass"]["top_instructions"][0]
    assert top["samples"] == 326 and top["reasons"] == {"long_sb": 323, "wait": 2}
