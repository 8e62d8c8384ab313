"""`python -m pjinfer.benchmarks.pdl_waits DUMP`: PDL instructions per kernel of a PTX dump."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks.pdl_waits import main, ptx_entries

PTX = """//
.version 8.4
.target sm_90a
.address_size 64

.visible .entry loop_add_fusion(
	.param .u64 loop_add_fusion_param_0
)
.reqntid 128, 1, 1
{
	griddepcontrol.wait;
	ld.global.nc.v4.u32 	{%r1, %r2, %r3, %r4}, [%rd1];
	ret;
}
	// .globl	routed_matmul
.visible .entry routed_matmul(
	.param .u64 routed_matmul_param_0
)
{
	ret;
}
.entry input_reduce_fusion(
	.param .u64 p
)
{
	griddepcontrol.wait;
	griddepcontrol.launch_dependents;
	ret;
}
"""


def test_each_entry_counts_its_own_pdl_instructions():
    assert ptx_entries(PTX) == [
        {"kernel": "loop_add_fusion", "waits": 1, "launches_dependents": 0},
        {"kernel": "routed_matmul", "waits": 0, "launches_dependents": 0},
        {"kernel": "input_reduce_fusion", "waits": 1, "launches_dependents": 1}]


def test_a_dump_folder_is_summarised(tmp_path, capsys):
    (tmp_path / "module_0001.step.ptx").write_text(PTX)
    (tmp_path / "module_0001.step.txt").write_text("HloModule step")  # not PTX: skipped
    out = tmp_path / "pdl.json"
    record = main([str(tmp_path), "--expect", "routed_matmul", "moe_route", "--out", str(out)])
    assert record["results"]["num_kernels"] == 3
    assert record["results"]["num_waiting"] == 2
    assert record["results"]["not_waiting"] == ["routed_matmul"]
    assert record["results"]["expected_but_absent"] == ["moe_route"]
    assert json.loads(out.read_text())["results"]["files"].keys() == {"module_0001.step.ptx"}
    printed = capsys.readouterr().out
    assert "2 of 3 kernels wait" in printed and "moe_route" in printed


def test_a_missing_folder_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope")])
