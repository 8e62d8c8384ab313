"""The host-launch benchmark's plumbing on CPU."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import host_launch


def test_smoke_record(tmp_path):
    out = tmp_path / "h.json"
    assert host_launch.main(["--smoke", "--counts", "1", "3", "--leaves", "5",
                             "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    for n in (1, 3):
        assert all(res[f"args_{n}"][k] > 0 for k in ("numpy_us", "device_us", "packed_us"))
    assert res["pytree_5_leaves_us"] > 0


def test_bad_counts_are_usage_errors(capsys):
    for argv in (["--counts", "0"], ["--leaves", "x"], ["--calls", "-1"]):
        with pytest.raises(SystemExit):
            host_launch.main(argv)
        assert "give positive integers" in capsys.readouterr().err
