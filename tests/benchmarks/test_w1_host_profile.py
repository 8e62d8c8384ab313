"""The W1 host-profile benchmark's plumbing on CPU: the demo model with two LoRA adapters, the
Pallas LoRA kernel switched on for the run only."""

from __future__ import annotations

import json

from pjinfer.benchmarks import w1_host_profile as bench
from pjinfer.engine import step as engine_step
from pjinfer.lora.weights import attach


def test_smoke_record_and_the_switch_is_undone(tmp_path):
    out = tmp_path / "w.json"
    assert bench.main(["--smoke", "--mode", "lora", "--lora-kernel", "pallas",
                       "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert res["w1_tpot_s"] > 0 and res["step_calls"] >= 4
    assert 0 < res["in_step_call_s_per_step"] * res["step_calls"] \
        <= res["profiled_s_per_token"] * 4
    assert engine_step.attach_lora is attach
