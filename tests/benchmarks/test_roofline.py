"""Roofline arithmetic against hand-computed Llama-3-8B figures (PERF_NOTES.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pjinfer.benchmarks.datasets import synthetic_sharegpt
from pjinfer.benchmarks.roofline import (
    Ceilings,
    ModelShape,
    decode_step_bytes,
    decode_step_seconds,
    latency_roofline,
    measure_ceilings,
    throughput_roofline,
)
from pjinfer.config import ModelConfig

LLAMA3_8B = Path(__file__).parents[2] / "configs" / "models" / "llama3-8b"
H200 = Ceilings(hbm_bytes_per_s=4.25e12, matmul_flops_per_s=799e12, source="given")


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    cfg = ModelConfig.from_hf_dict(json.loads((LLAMA3_8B / "config.json").read_text()))
    return ModelShape.from_model_config(cfg)


def test_llama3_8b_sizes(shape):
    assert shape.num_params == 8_030_261_248  # the published 8.03 B
    assert shape.weight_bytes == pytest.approx(16.06e9, rel=1e-3)
    assert shape.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2 == 131_072


def test_batch1_decode_step_is_bandwidth_bound(shape):
    # 16.06 GB / 4.25 TB/s = 3.779 ms; 512 tokens of context add 67 MB = 0.016 ms.
    assert decode_step_bytes(shape, [512]) == shape.weight_bytes + 512 * 131_072
    assert decode_step_seconds(shape, H200, []) * 1e3 == pytest.approx(3.779, abs=1e-3)
    assert decode_step_seconds(shape, H200, [512]) * 1e3 == pytest.approx(3.795, abs=1e-3)
    roof = latency_roofline(shape, H200, batch=1, input_len=512, output_len=512)
    assert roof["tpot_weights_only_s"] * 1e3 == pytest.approx(3.779, abs=1e-3)
    assert 1 / roof["tpot_weights_only_s"] == pytest.approx(265, abs=1)  # tokens/s


def test_large_batch_decode_becomes_compute_bound(shape):
    # 4096 sequences x 2 x 8.03e9 FLOPs = 65.8 PFLOP -> 82 ms at 799 TFLOP/s, over the
    # ~3.8 ms of weights plus 4096 x 16 x 131 KB = 8.6 GB of KV (2.0 ms).
    seconds = decode_step_seconds(shape, H200, [16] * 4096)
    assert seconds == pytest.approx(shape.flops(4096, 4096 * 16) / 799e12)
    assert seconds * 1e3 == pytest.approx(82.3, abs=0.5)


def test_throughput_roofline_w3(shape):
    roof = throughput_roofline(shape, H200, [1024] * 1000, [256] * 1000, max_num_seqs=256)
    # compute: 1000 x 1280 tokens x 2 x 8.03e9 = 20.6 PFLOP (+ attention) -> ~26-27 s
    assert 25.5 < roof["compute_s"] < 28.0
    assert roof["elapsed_s"] == max(roof["compute_s"], roof["memory_s"])
    assert roof["output_tokens_per_s"] == pytest.approx(256_000 / roof["elapsed_s"])


def test_synthetic_sharegpt_means():
    reqs, meta = synthetic_sharegpt(4000, vocab_size=1000, seed=0)
    mean_in = sum(r.prompt_len for r in reqs) / len(reqs)
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    assert mean_in == pytest.approx(202, rel=0.06) and mean_out == pytest.approx(179, rel=0.06)
    assert max(r.prompt_len for r in reqs) <= 2048 and min(r.output_len for r in reqs) >= 1
    assert all(len(r.prompt) == r.prompt_len for r in reqs[:50])
    assert meta["input"]["sigma"] == 0.9


def test_measured_ceilings_are_positive_on_cpu():
    c = measure_ceilings(copy_bytes=8 << 20, matmul_n=128, iters=3, warmup=1)
    assert c.hbm_bytes_per_s > 1e8 and c.matmul_flops_per_s > 1e6
    assert c.source == "measured" and c.details["matmul_n"] == 128
