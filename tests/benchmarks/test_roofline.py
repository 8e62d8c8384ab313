"""Roofline accounting against Llama-3-8B figures worked out by hand in the comments, and the
ceiling measurement run for real on CPU at tiny sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pjinfer.benchmarks.ceilings import Ceilings, ceilings_record, load_ceilings, measure_ceilings
from pjinfer.benchmarks.datasets import synthetic_sharegpt
from pjinfer.benchmarks.roofline import (
    ModelShape,
    Work,
    latency_roofline,
    request_work,
    sequence_work,
    step_weights,
    throughput_roofline,
)
from pjinfer.config import ModelConfig
from pjinfer.demo import DEMO_MODEL_DIR

ROOT = Path(__file__).parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# Round ceilings so the hand arithmetic stays readable: 4.5 TB/s, 800 TFLOP/s.
ROUND = Ceilings(hbm_bytes_per_s=4.5e12, matmul_flops_per_s=800e12, source="given")


def _shape(folder: Path) -> ModelShape:
    cfg = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    return ModelShape.from_model_config(cfg)


@pytest.fixture(scope="module")
def shape() -> ModelShape:
    return _shape(ROOT / "configs" / "models" / "llama3-8b")


def test_llama3_8b_parameter_split(shape):
    # Per layer: q 4096x4096 = 16,777,216; k and v 4096x1024 = 4,194,304 each; o 16,777,216
    # -> attention 41,943,040; MLP 3 x 4096 x 14336 = 176,160,768; two norms 8,192
    # -> 218,112,000 per layer, x 32 = 6,979,584,000.
    assert shape.layer_params == 6_979_584_000
    assert shape.lm_head_params == 128_256 * 4096 == 525_336_576
    # + embedding table 525,336,576 + lm_head 525,336,576 + final norm 4,096 = the published 8.03 B
    assert shape.num_params == 8_030_261_248
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert shape.attention_flops_per_pair == 4 * 32 * 32 * 128 == 524_288


def test_batch1_decode_step_bytes_and_flops(shape):
    # A step at 512 cached tokens, bf16: layers 13,959,168,000 + final norm 8,192 + lm_head
    # 1,050,673,152 + one embedding row 8,192 + KV read 512 x 131,072 = 67,108,864 + KV written
    # 131,072 = 15,077,097,472 B (~15.08 GB; the whole checkpoint would be 16.06 GB).
    step = step_weights(shape) + sequence_work(shape, cached=512, new=1, logit_rows=1)
    terms = step.record()
    assert terms["layer_weight_bytes"] == 13_959_168_000
    assert terms["final_norm_bytes"] == 8_192 and terms["embedding_row_bytes"] == 8_192
    assert terms["lm_head_bytes"] == 1_050_673_152
    assert terms["kv_read_bytes"] == 67_108_864 and terms["kv_write_bytes"] == 131_072
    assert terms["total_bytes"] == 15_077_097_472
    # FLOPs: 2 x 6,979,584,000 = 13,959,168,000; attention 513 pairs (512 cached + itself)
    # x 524,288 = 268,959,744; lm_head 2 x 525,336,576 = 1,050,673,152 -> 15,278,800,896.
    assert terms["layer_flops"] == 13_959_168_000
    assert terms["attention_flops"] == 268_959_744
    assert terms["total_flops"] == 15_278_800_896


def test_w1_latency_roofline(shape):
    # 511 decode steps; step j (producing token j + 2) reads 512 + j cached positions, on
    # average 767: 100,532,224 B of K/V. Bytes per step on average: 15,009,849,344 (weights)
    # + 8,192 + 131,072 + 100,532,224 = 15,110,520,832 -> / 4.5 TB/s = 3.35789 ms. Compute is
    # ~15.3 GFLOP -> 0.019 ms at 800 TFLOP/s: every step is bandwidth-bound.
    roof = latency_roofline(shape, ROUND, batch=1, input_len=512, output_len=512)
    assert roof["decode_steps"] == roof["decode_steps_memory_bound"] == 511
    assert roof["tpot_s"] == pytest.approx(15_110_520_832 / 4.5e12, rel=1e-12)
    assert roof["tpot_s"] * 1e3 == pytest.approx(3.3579, abs=1e-4)
    assert roof["tpot_weights_only_s"] * 1e3 == pytest.approx(3.3355, abs=1e-4)  # 15.01 GB
    assert roof["work"]["all_decode_steps"]["total_bytes"] == 511 * 15_110_520_832


def test_w2_prefill_is_compute_bound(shape):
    # 8 x 32 prompt tokens: 256 x 13,959,168,000 = 3,573,547,008,000 FLOPs, attention
    # 8 x 32 x 33 / 2 = 4,224 pairs x 524,288 = 2,214,592,512, lm_head 8 rows x 1,050,673,152
    # = 8,405,385,216 -> 3,584,166,985,728 FLOPs = 4.48 ms at 800 TFLOP/s, above the
    # 15.01 GB + 256 x (8,192 + 131,072) B = 3.34 ms of memory.
    roof = latency_roofline(shape, ROUND, batch=8, input_len=32, output_len=128)
    assert roof["work"]["prefill"]["total_flops"] == 3_584_166_985_728
    assert roof["ttft_s"] == pytest.approx(3_584_166_985_728 / 800e12)


def test_w3_throughput_roofline(shape):
    # Per request: 1024 + 255 = 1279 processed tokens (the last output is never fed back):
    # 1279 x 13,959,168,000 = 17,853,775,872,000 FLOPs; causal pairs 1279 x 1280 / 2 = 818,560
    # x 524,288 = 429,161,185,280; lm_head 256 rows x 1,050,673,152 = 268,972,326,912
    # -> 18,551,909,384,192 per request, x 1000 = 1.8552e16 -> 23.19 s at 800 TFLOP/s.
    work = request_work(shape, 1024, 256)
    assert work.total_flops == 18_551_909_384_192
    # K/V read by the 255 decode steps: 255 x 1024 + (0 + ... + 254) = 293,505 positions.
    assert work.kv_read_bytes == 293_505 * 131_072
    roof = throughput_roofline(shape, ROUND, [1024] * 1000, [256] * 1000, max_num_seqs=512)
    assert roof["compute_s"] == pytest.approx(18.551909384192 / 0.8, rel=1e-12)  # 23.19 s
    # Memory: 500 steps x 15,009,849,344 B + 1000 x (38.47 GB K/V read + ...) = 46.15 TB
    # -> 10.26 s: compute-bound, 256,000 / 23.19 s = 11,039 output tokens/s.
    assert roof["min_steps"] == 500 and roof["memory_s"] == pytest.approx(10.256, abs=1e-3)
    assert roof["elapsed_s"] == roof["compute_s"]
    assert roof["output_tokens_per_s"] == pytest.approx(11_039, abs=1)


def test_work_terms_add_up():
    a = Work(layer_weight_bytes=3, kv_read_bytes=4, attention_flops=5)
    total = (a + a.scaled(2)).record()
    assert total["total_bytes"] == 21 and total["total_flops"] == 15


def test_synthetic_sharegpt_means():
    reqs, meta = synthetic_sharegpt(4000, vocab_size=1000, seed=0)
    mean_in = sum(r.prompt_len for r in reqs) / len(reqs)
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    assert mean_in == pytest.approx(202, rel=0.06) and mean_out == pytest.approx(179, rel=0.06)
    assert max(r.prompt_len for r in reqs) <= 2048 and min(r.output_len for r in reqs) >= 1
    assert all(len(r.prompt) == r.prompt_len for r in reqs[:50])
    assert meta["input"]["sigma"] == 0.9


# ---- the corrected ratios of RESULTS.md, from the committed records --------------------------
H200_BEST = (Ceilings(4.53e12, 809e12, "given"), Ceilings(4.44e12, 803e12, "given"))


def _record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _latency_ratios(shape: ModelShape, name: str) -> list[tuple[float, float]]:
    rec = _record(name)
    s, res = rec["settings"], rec["results"]
    out = []
    for c in H200_BEST:
        roof = latency_roofline(shape, c, s["batch_size"], s["input_len"], s["output_len"])
        out.append((roof["tpot_s"] / res["tpot_s"]["median"],
                    roof["e2e_s"] / res["e2e_s"]["median"]))
    return out


def test_results_md_w1_w2_ratios(shape):
    """RESULTS.md: W1 TPOT 0.73-0.74; W2 E2E 0.72-0.73, TPOT 0.73-0.75 (4.53-4.44 TB/s)."""
    (w1_hi, _), (w1_lo, _) = _latency_ratios(shape, "w1_latency.json")
    assert (round(w1_hi, 2), round(w1_lo, 2)) == (0.73, 0.74)
    (tpot_hi, e2e_hi), (tpot_lo, e2e_lo) = _latency_ratios(shape, "w2_latency.json")
    assert (round(e2e_hi, 2), round(e2e_lo, 2)) == (0.72, 0.73)
    assert (round(tpot_hi, 2), round(tpot_lo, 2)) == (0.73, 0.75)


def test_results_md_w3_w4_ratios(shape):
    """RESULTS.md: W3 0.43 and W4 0.27 of the roofline at the best matmul rate (803-809)."""
    w3, w4 = _record("w3_throughput.json"), _record("w4_throughput.json")
    reqs, _ = synthetic_sharegpt(1000, vocab_size=128_256, seed=0)  # W4's dataset, regenerated
    assert sum(r.output_len for r in reqs) == w4["results"]["output_tokens"] == 178_818
    for c in H200_BEST:
        r3 = throughput_roofline(shape, c, [1024] * 1000, [256] * 1000, 512)
        r4 = throughput_roofline(shape, c, [r.prompt_len for r in reqs],
                                 [r.output_len for r in reqs], 512)
        assert round(w3["results"]["output_tokens_per_s"] / r3["output_tokens_per_s"], 2) == 0.43
        assert round(w4["results"]["output_tokens_per_s"] / r4["output_tokens_per_s"], 2) == 0.27


# ---- measuring -------------------------------------------------------------------------------
def test_ceilings_are_measured_on_cpu(tmp_path):
    demo = _shape(DEMO_MODEL_DIR)
    c = measure_ceilings(demo, tokens=16, stream_bytes=1 << 20, rows=2, calls=2, samples=3,
                         warmup=1)
    assert c.source == "measured"
    assert c.hbm_bytes_per_s >= c.hbm_bytes_per_s_median > 1e6
    assert c.matmul_flops_per_s >= c.matmul_flops_per_s_median > 1e6
    bw, mm = c.details["bandwidth"], c.details["matmul"]
    # demo: hidden 128, intermediate 384 -> 98,304 B per bf16 matrix; 1 MiB holds 10 of them
    assert (bw["k"], bw["n"], bw["matrices"]) == (128, 384, 10)
    assert bw["bytes_per_call"] == 10 * 98_304 + 10 * 2 * 128 * 2 + 10 * 2 * 384 * 2
    # q 4 x 32 = 128, kv 2 x 32 = 64: qkv (16, 128, 256), o (16, 128, 128), gate+up
    # (16, 128, 768), down (16, 384, 128)
    assert mm["shapes_mkn"] == [[16, 128, 256], [16, 128, 128], [16, 128, 768], [16, 384, 128]]
    path = tmp_path / "roofline.json"
    path.write_text(json.dumps({"ceilings": ceilings_record(c)}))
    again = load_ceilings(str(path))
    assert again.hbm_bytes_per_s == c.hbm_bytes_per_s and again.source.startswith("from ")
    assert again.matmul_flops_per_s_median == c.matmul_flops_per_s_median


def test_moe_roofline_counts_experts_read_and_active_flops():
    """Qwen3-30B-A3B: 30.5 G params of which 3.3 G are active per token; one token reads its top-8
    experts per layer, a large step nearly all 128."""
    from pjinfer.config import ModelConfig

    shape = ModelShape.from_model_config(
        ModelConfig.from_pretrained("configs/models/qwen3-30b-a3b"), dtype="bfloat16")
    assert shape.num_params == ModelConfig.from_pretrained(
        "configs/models/qwen3-30b-a3b").num_params()
    assert shape.experts_read(1) == pytest.approx(8)
    assert 127 < shape.experts_read(8192) <= 128
    expert = 3 * 2048 * 768
    active = shape.layer_params + 48 * 8 * expert + 2 * shape.lm_head_params  # + embeddings
    assert 3.3e9 < active < 3.4e9  # the model card's "3.3B activated"
    one = step_weights(shape, 1)
    assert one.expert_weight_bytes == 48 * 8 * expert * 2
    assert sequence_work(shape, 0, 1, 0).layer_flops == 2 * (shape.layer_params
                                                             + 48 * 8 * expert)


def test_loaded_moe_layer_bytes_leave_the_routed_experts_out():
    """The engine-side shape counts the layers' bytes read every step from the loaded params;
    routed experts are `expert_weight_bytes` (only those chosen), never part of them."""
    from types import SimpleNamespace

    import numpy as np

    from pjinfer.benchmarks.offline import model_shape
    from pjinfer.config import ModelConfig

    cfg = ModelConfig.from_pretrained("configs/models/qwen3-30b-a3b")
    layer = {"q_proj": np.zeros((8, 4), np.float32), "router": np.zeros((8, 16), np.float32),
             "experts_gate_up": np.zeros((16, 8, 2, 4), np.float32),
             "experts_down": np.zeros((16, 4, 8), np.float32)}
    runner = SimpleNamespace(params={"layers": [layer, dict(layer)]},
                             act_dtype=np.dtype(np.float32), kv_dtype=np.dtype(np.float32))
    shape = model_shape(SimpleNamespace(runner=runner, model_config=cfg))
    assert shape.layer_weight_bytes == 2 * (8 * 4 + 8 * 16) * 4


def test_quantized_experts_count_as_stored():
    """fp8 experts (a byte a value plus float32 scales): the experts a step reads count those
    bytes, not the model dtype's two a param."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    import numpy as np

    from pjinfer.benchmarks.offline import model_shape
    from pjinfer.config import ModelConfig
    from pjinfer.quantization.experts import quantize_experts

    cfg = ModelConfig.from_pretrained("configs/models/qwen3-30b-a3b")
    layers = [{"experts_gate_up": quantize_experts(jnp.ones((128, 8, 2, 4)), "fp8"),
               "experts_down": quantize_experts(jnp.ones((128, 4, 8)), "fp8")}] * 48
    runner = SimpleNamespace(params={"layers": layers}, act_dtype=np.dtype(jnp.bfloat16),
                             kv_dtype=np.dtype(jnp.bfloat16))
    shape = model_shape(SimpleNamespace(runner=runner, model_config=cfg))
    assert shape.expert_bytes == 8 * 2 * 4 + 4 * 8 + 4 * (2 * 4 + 8)  # values + scales
    assert step_weights(shape, 1).expert_weight_bytes == round(48 * 8 * shape.expert_bytes)
