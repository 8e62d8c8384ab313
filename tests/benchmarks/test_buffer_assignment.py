"""The buffer-assignment digest finds a step's temporary allocation in XLA's dump and names its
largest values with the instructions that define them (read from the `-values` sibling)."""

from __future__ import annotations

import json
import sys

import pytest

from pjinfer.benchmarks import buffer_assignment

ASSIGNMENT = """BufferAssignment:
allocation 0: size 262144, parameter 0, shape |f8e4m3fn[512,512]| at ShapeIndex {}:
 value: <24 w.1 @0> (size=262144,offset=0): f8e4m3fn[512,512]{1,0}
allocation 1: size 16384, output shape is |f32[8,512]|, maybe-live-out:
 value: <13 wrapped_tanh @0> (size=16384,offset=0): f32[8,512]{1,0}
allocation 6: size 1065028, preallocated-temp:
 value: <11 wrapped_add @0> (size=4,offset=1065024): s32[]
 value: <25 wrapped_convert @0> (size=1048576,offset=64): f32[512,512]{1,0}
 value: <27 wide.arg_tuple.0{} (phi) @0> (size=24,offset=0): (s32[], f32[8,512]{1,0})
 value: <12 ynn_fusion @0> (size=16384,offset=1048640): f32[8,512]{1,0}

Total bytes used: 1359952 (1.30MiB)
"""
VALUES = """Used values:
<25 wrapped_convert @0>
 positions:
  wrapped_convert
 from instruction: %wrapped_convert = f32[512,512]{1,0} fusion(%w.1), kind=kLoop
<12 ynn_fusion @0>
 positions:
  ynn_fusion
 from instruction: %ynn_fusion = f32[8,512]{1,0} fusion(%x, %wrapped_convert), kind=kCustom
"""


def test_digest_lists_the_temp_allocation_largest_first():
    d = buffer_assignment.digest(ASSIGNMENT + VALUES, top=2)
    assert d["temp_bytes"] == 1065028
    assert [a["index"] for a in d["allocations"]] == [6, 0]
    assert [(v["name"], v["bytes"]) for v in d["largest_temp_values"]] == [
        ("wrapped_convert", 1048576), ("ynn_fusion", 16384)]
    assert d["largest_temp_values"][0]["instruction"].startswith("%wrapped_convert = f32")


def test_cli_reads_each_dump_with_its_values(tmp_path, monkeypatch):
    dump = tmp_path / "module_0008.jit_loop.after_optimizations-buffer-assignment.txt"
    dump.write_text(ASSIGNMENT)
    (tmp_path / "module_0008.jit_loop.after_optimizations-buffer-assignment-values.txt"
     ).write_text(VALUES)
    out = tmp_path / "digest.json"
    monkeypatch.setattr(sys, "argv", ["buffer_assignment", str(tmp_path), "--out", str(out)])
    buffer_assignment.main()
    (entry,) = json.loads(out.read_text()).values()
    assert entry["largest_temp_values"][0]["instruction"].startswith("%wrapped_convert")


def test_cli_says_what_is_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["buffer_assignment", str(tmp_path)])
    with pytest.raises(SystemExit):
        buffer_assignment.main()
    assert "no *buffer-assignment.txt" in capsys.readouterr().err
