"""`python -m pjinfer.benchmarks.moe --smoke`: the grouped-matmul benchmark's plumbing on CPU."""

from __future__ import annotations

import json

import pytest

from pjinfer.benchmarks.moe import main, routed_group_sizes


def test_routing_gives_each_token_top_k_distinct_experts():
    sizes = routed_group_sizes(10, 8, 3, seed=0)
    assert sizes.sum() == 30 and sizes.max() <= 10


def test_smoke_record(tmp_path):
    out = tmp_path / "moe.json"
    assert main(["--smoke", "--calls", "1", "--samples", "1", "--block-m", "16",
                 "--band", "all", "2", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["ceilings"]["matmul_flops_per_s"] > 0
    for name in ("gate_up", "down"):
        prefill = rec["prefill"][name]
        diffs = prefill["max_abs_diff_vs_ragged_dot"]
        assert set(diffs) == {"ragged_dot", "auto", "pallas_m16_n128_k64_s1_w4_st3",
                              "pallas_m16_n128_k64_s1_w4_st3_b2"}
        assert max(diffs.values()) < 0.05  # bf16 sums in another order
        assert prefill["auto"]["vs_matmul_rate"] > 0
        assert all(d[name]["auto"]["vs_bandwidth"] > 0 for d in rec["decode"])
    assert [d["tokens"] for d in rec["decode"]] == [1, 4]
    assert rec["decode"][0]["experts_touched"] == 2


def test_prefill_tokens_sets_the_grouped_case_and_its_roofline(tmp_path):
    """--prefill-tokens: a mixed step's few rows an expert, timed against max(FLOPs at the
    matmul rate, touched experts' bytes at the bandwidth)."""
    out = tmp_path / "moe.json"
    assert main(["--smoke", "--calls", "1", "--samples", "1", "--prefill-tokens", "24",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    prefill, c = rec["prefill"], rec["ceilings"]
    assert prefill["tokens"] == 24 and prefill["rows"] == 24 * 2
    assert 0 < prefill["experts_touched"] <= 8
    for name, k, n in (("gate_up", 64, 64), ("down", 32, 64)):
        g = prefill[name]
        m = 24 * 2
        assert g["bytes"] == 2 * (prefill["experts_touched"] * k * n + m * k + m * n)
        assert g["roofline_s"] == pytest.approx(max(g["flops"] / c["matmul_flops_per_s"],
                                                    g["bytes"] / c["hbm_bytes_per_s"]))
        auto = g["auto"]
        assert auto["vs_roofline"] == pytest.approx(g["roofline_s"] / auto["best_s"])


def test_decode_layer_record(tmp_path):
    """--decode-layer: both expert paths and the routed tiling, per number of real tokens."""
    out = tmp_path / "layer.json"
    assert main(["--smoke", "--decode-layer", "--calls", "1", "--samples", "1",
                 "--routed-n", "16", "--routed-k", "16", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["decode_layer"]
    assert [r["real_tokens"] for r in rows] == [1, 4]
    for r in rows:
        assert 0 < r["experts_touched"] <= 2 * r["real_tokens"]
        assert r["max_rel_diff_routed_vs_sorted"] < 2e-2
        for key in ("sorted", "routed", "gate_up_routed_n16_k16"):
            assert r[key]["best_s"] > 0 and r[key]["vs_bandwidth"] > 0


def test_tile_flags_must_be_powers_of_two(capsys):
    for argv, said in ((["--routed-n", "24"], "tile sizes are powers of two"),
                       (["--block-m", "48"], "tile sizes are powers of two"),
                       (["--k-splits", "0"], "give positive integers"),
                       (["--band", "0"], "give a number of tiles >= 1, or 'all'"),
                       (["--band", "x"], "give a number of tiles >= 1, or 'all'")):
        with pytest.raises(SystemExit):
            main(["--smoke", *argv])
        assert said in capsys.readouterr().err
