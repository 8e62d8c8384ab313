"""`python -m pjinfer.benchmarks.moe_decode_stack --smoke`: the stacked routed-GEMM benchmark's
plumbing on CPU (interpret mode)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pjinfer.benchmarks.moe_decode_stack import main, routing


def test_routing_gives_each_token_top_k_distinct_experts():
    ids = routing(5, 8, 3, np.random.default_rng(0))
    assert ids.shape == (5, 3)
    assert all(len(set(row)) == 3 for row in ids.tolist())


def test_smoke_record(tmp_path):
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "1", "3", "--block-n", "16", "32", "--block-k", "16",
                 "--down-k-splits", "1", "2", "--calls", "1", "--samples", "1",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 3]
    assert rows[0]["experts_read"] == 2 * 2  # 2 layers, top-2 of one token
    for r in rows:
        assert set(r["tilings"]) == {"n16_k16_w4_s3_p128", "n32_k16_w4_s3_p128",
                                     "n16_k16_w4_s3_p128_q1_2", "n32_k16_w4_s3_p128_q1_2"}
        assert all(t["vs_bandwidth"] > 0 for t in r["tilings"].values())
        assert r["best_tiling"] in r["tilings"]


def test_tokens_past_the_routed_kernel_are_a_usage_error():
    with pytest.raises(SystemExit):
        main(["--smoke", "--tokens", "65"])


@pytest.mark.parametrize("dtype", ["fp8", "int8"])
def test_quantized_experts_count_their_stored_bytes(tmp_path, dtype):
    """A byte a value and float32 scales per expert and output channel (tiny: 64 -> 2 x 32)."""
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "2", "--block-n", "16", "--block-k", "16",
                 "--expert-dtype", dtype, "--calls", "1", "--samples", "1",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["expert_dtype"] == dtype
    assert row["bytes"] == row["experts_read"] * (3 * 64 * 32 + 4 * (2 * 32 + 64))
    assert all(t["vs_bandwidth"] > 0 for t in row["tilings"].values())


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_fused_and_separate_activation_side_by_side(tmp_path, dtype):
    """--fused 0 1 2: each tiling timed with XLA's activation kernel between the two GEMMs,
    as `routed_ffn` with it in down's loads, and (for each --swiglu-block-n) with it in
    gate/up's epilogue, under names that tell them apart."""
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "2", "--block-n", "16", "--block-k", "16",
                 "--k-splits", "2", "--fused", "0", "1", "2", "--swiglu-block-n", "16", "32",
                 "--expert-dtype", dtype, "--calls", "1", "--samples", "1",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    name = "n16_k16_w4_s3_p128_q2_1"
    assert set(row["tilings"]) == {name, f"{name}_fused", f"{name}_epilogue16",
                                   f"{name}_epilogue32"}
    assert all(t["vs_bandwidth"] > 0 for t in row["tilings"].values())


def test_one_launch_split_form_beside_the_routed_pair(tmp_path):
    """--fused 3: `routed_ffn_split`, a program an I chunk (--swiglu-block-n), named apart;
    --check: each tiling's first layer against the reference FFN (3 tokens here; one token
    in the test below)."""
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "3", "--block-n", "16", "--block-k", "16",
                 "--fused", "2", "3", "--swiglu-block-n", "16", "32", "--check",
                 "--calls", "1", "--samples", "1", "--out", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        assert set(row["tilings"]) == {f"n16_k16_w4_s3_p128_{form}{n}"
                                       for form in ("epilogue", "split") for n in (16, 32)}
        assert all(t["vs_bandwidth"] > 0 for t in row["tilings"].values())
        assert all(t["relative_error"] < 1e-2 for t in row["tilings"].values())


def test_padded_rows_run_the_engine_bucket_with_idle_rows(tmp_path):
    """--padded-rows 8: one real token in x's 8 rows as the engine's batch-1 step has them, the
    other 7 choosing no expert: the same experts read, every form still equal to the
    reference over all 8 rows."""
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "1", "--padded-rows", "8", "--block-n", "16",
                 "--block-k", "16", "--fused", "0", "2", "3", "--swiglu-block-n", "16",
                 "--check", "--calls", "1", "--samples", "1", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["tokens"], row["rows"], row["experts_read"]) == (1, 8, 2 * 2)
    assert len(row["tilings"]) == 3
    assert all(t["relative_error"] < 1e-2 for t in row["tilings"].values())
    with pytest.raises(SystemExit):
        main(["--smoke", "--padded-rows", "65"])


def test_a_tiling_that_cannot_run_is_recorded_with_its_error(tmp_path):
    """--swiglu-block-n wider than the smoke model's I: the tiling's error is in the record,
    which is still written (the summary has no row to show)."""
    out = tmp_path / "stack.json"
    assert main(["--smoke", "--tokens", "1", "--block-n", "16", "--block-k", "16",
                 "--fused", "2", "--swiglu-block-n", "256", "--calls", "1", "--samples", "1",
                 "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    (tiling,) = row["tilings"].values()
    assert "block_n must divide I" in tiling["error"] and "best_tiling" not in row
