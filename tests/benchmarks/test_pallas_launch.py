"""The Pallas-launch benchmark's plumbing on CPU (the kernel interprets there)."""

from __future__ import annotations

import json

from pjinfer.benchmarks import pallas_launch


def test_smoke_record(tmp_path):
    out = tmp_path / "p.json"
    assert pallas_launch.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    for form in ("xla_fusion", "pallas"):
        assert res[form]["pipelined_us"] > 0 and res[form]["synchronous_us"] > 0
    assert set(res["pallas_extra_us_per_call"]) == {"pipelined_us", "synchronous_us"}
