"""The Pallas-launch benchmark's plumbing on CPU (the kernel interprets there)."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import pallas_launch


def test_smoke_record(tmp_path):
    out = tmp_path / "p.json"
    assert pallas_launch.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    for form in ("xla_fusion", "triton", "mosaic"):
        assert res[form]["pipelined_us"] > 0 and res[form]["synchronous_us"] > 0
    for backend in ("triton", "mosaic"):
        assert set(res[backend]["extra_us_per_call"]) == {"pipelined_us", "synchronous_us"}


def test_bad_counts_are_usage_errors(capsys):
    for argv in (["--links", "0"], ["--calls", "x"], ["--links", "2,3"]):
        with pytest.raises(SystemExit):
            pallas_launch.main(argv)
        assert "give positive integers" in capsys.readouterr().err
