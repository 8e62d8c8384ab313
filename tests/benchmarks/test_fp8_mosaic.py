"""The Mosaic GPU fp8 W8A8 GEMV probe on CPU: every kernel config lowers for CUDA at
Llama-3-8B's shapes, every form runs through the timing loop in interpret mode against the
float32 reference, and bad configs say what is wanted. (The kernel's own tests:
tests/kernels/test_fp8_gemv.py.)"""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import fp8_mosaic as fm


def test_every_kernel_config_lowers_for_cuda(tmp_path):
    out = tmp_path / "f.json"
    names = ["W", "X", "E", "E:4:4", "G", "G:6:2:256"]
    fm.main(["--out", str(out), "--configs", *names])
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs] == names
    assert all("skipped" in r for r in runs[:2])
    assert all(r["lowered_for_cuda"] == [list(s) for s in fm.LLAMA3_8B] for r in runs[2:])


def test_every_form_runs_through_the_timing_loop():
    rows = fm.time_forms(["W", "X", "E:2:2", "E", "G:2:2"], [(256, 128)], [3], 2,
                         timing={"calls": 1, "samples": 1, "warmup": 0}, interpret=True)
    assert [r["name"] for r in rows] == ["bf16", "W", "X", "E:2:2", "E", "G:2:2"]
    assert rows[0]["bytes_per_call"] == 2 * 2 * 256 * 128
    assert rows[1]["bytes_per_call"] == 2 * (256 * 128 + 4 * 128)  # e4m3 + float32 scales
    assert rows[1]["rel_err"] < 1e-2 and rows[2]["rel_err"] < 0.03
    for r in rows[3:5]:  # the same W8A8 product as X
        assert abs(r["rel_err"] - rows[2]["rel_err"]) < 1e-3
    assert rows[5]["rel_err"] < 1e-2  # G: the weight-only product, as W


@pytest.mark.parametrize("text", ["F:4:4", "E:4", "E:4:4:128:64", "G:four:4", "E:4:4:64"])
def test_bad_configs_say_what_is_wanted(text):
    with pytest.raises(ValueError, match="stages:splits"):
        fm.parse_config(text)


def test_bad_counts_are_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        fm.main(["--out", str(tmp_path / "f.json"), "--matrices", "0"])
