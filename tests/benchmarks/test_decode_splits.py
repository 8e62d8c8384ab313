"""The decode-attention split sweep runs end to end on CPU with tiny shapes (a smoke test)."""

from __future__ import annotations

import json

from pjinfer.benchmarks import decode_splits


def test_smoke_checks_and_times_every_tiling(tmp_path):
    out = tmp_path / "d.json"
    decode_splits.run(["--smoke", "--out", str(out)])
    record = json.loads(out.read_text())
    tilings = {(r["pages"], r["splits"]) for r in record["rows"]}
    assert {(1, 1), (1, 2)} <= tilings and sum(r["default"] for r in record["rows"]) == 1
    assert all(r["rel_err"] < 1e-2 and r["ms"] > 0 for r in record["rows"])
    assert record["default_vs_best"] >= 1.0 and record["kv_bytes"] == 2 * 40 * 2 * 16 * 2 * 2


def test_fp8_cache_counts_one_byte_an_element(tmp_path):
    out = tmp_path / "d8.json"
    decode_splits.run(["--smoke", "--kv-dtype", "float8_e4m3fn", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["kv_bytes"] == 2 * 40 * 2 * 16 * 2 * 1  # K and V, one byte each
    assert record["shape"]["kv_dtype"] == "float8_e4m3fn"
    assert all(r["rel_err"] < 1e-2 for r in record["rows"])  # against the same fp8 cache


def test_stages_are_swept_and_device_time_falls_back_to_wall_time(tmp_path):
    out = tmp_path / "ds.json"
    decode_splits.run(["--smoke", "--stages", "2", "3", "--device-time", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["splits"], r["stages"]) for r in rows if r["pages"] == 1} == {
        (s, st) for s in (1, 2) for st in (2, 3)}
    assert all(r["warps"] == 4 and r["rel_err"] < 1e-2 for r in rows)
    # no device activity in a CPU trace: the wall-clock time stands
    assert all(r["device_ms"] is None and r["ms"] == r["wall_ms"] for r in rows)
    assert all(r["kernels_per_call"] is None and r["kernels"] is None for r in rows)
