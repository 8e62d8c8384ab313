"""The host-step benchmark's plumbing on CPU (the demo model, a few sequences)."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import host_step
from pjinfer.engine.scheduler import Scheduler


def test_record_times_every_phase_and_unwraps(tmp_path):
    out = tmp_path / "h.json"
    schedule = Scheduler.schedule
    host_step.main(["--num-seqs", "6", "--input-len", "5", "--output-len", "4",
                    "--out", str(out)])
    res = json.loads(out.read_text())["results"]
    assert set(res["phases"]) == set(host_step.PHASES)
    for phase in res["phases"].values():
        assert phase["calls"] >= 4 and 0 < phase["median_ms"] <= phase["max_ms"]
    assert res["host_ms_per_step"] == pytest.approx(
        sum(p["mean_ms"] for p in res["phases"].values()))
    assert res["gc_frozen_objects"] > 0
    assert Scheduler.schedule is schedule  # the timing wrappers are gone


def test_bad_sizes_are_usage_errors():
    for argv in (["--num-seqs", "0"], ["--output-len", "x"]):
        with pytest.raises(SystemExit):
            host_step.main(argv)
