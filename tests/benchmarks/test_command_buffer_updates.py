"""The command-buffer update benchmark's plumbing on CPU, and its log parser on XLA's lines."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks import command_buffer_updates as cbu

XLA_LINES = """\
CASE_BEGIN fresh_output
I1202 04:19:02.063848 1802 command_buffer_thunk.cc:336] [0] Create/Update command buffer ...
I1202 04:19:02.065219 1802 command_buffer_thunk.cc:362] [0] Updated command buffer in 1348 μs; n
I1202 04:19:02.065954 1802 command_buffer_thunk.cc:362] [0] Updated command buffer in 36 μs; n
CASE_END fresh_output {"issue_us": 150.0, "pipelined_us": 300.0}
I1202 04:19:02.068153 1802 command_buffer_thunk.cc:362] [0] Updated command buffer in 999 μs; n
CASE_BEGIN state_only
CASE_END state_only {"issue_us": 50.0, "pipelined_us": 90.0}
"""


def test_parse_counts_only_the_updates_between_a_cases_markers():
    res = cbu.parse_log(XLA_LINES)
    assert res["fresh_output"] == {"issue_us": 150.0, "pipelined_us": 300.0, "updates": 2,
                                   "update_us": 1384}
    assert res["state_only"]["updates"] == 0 and res["state_only"]["update_us"] == 0


def test_smoke_record_runs_every_case(tmp_path):
    out = tmp_path / "c.json"
    assert cbu.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert sorted(res) == sorted(cbu.CASES)
    assert all(r["issue_us"] > 0 and r["pipelined_us"] >= r["issue_us"] for r in res.values())


def test_bad_arguments_are_usage_errors(capsys):
    for argv in (["--layers", "0"], ["--cases", "nope"], ["--calls", "x"]):
        with pytest.raises(SystemExit):
            cbu.main(argv)
        assert "error" in capsys.readouterr().err
