"""On-the-fly fp8 / int8 weights: bounded reconstruction error, the demo model's Zen unchanged."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer import LLM
from pjinfer.config import ModelConfig
from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.weight import QuantizedWeight, dequantize
from pjinfer.weights import load_params
from tests.quantization.conftest import ZEN_GREEDY, ZEN_PROMPTS, first_lines


@pytest.fixture(scope="module")
def demo_float():
    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    return cfg, load_params(DEMO_MODEL_DIR, cfg)


def _pairs(float_params, quant_params):
    for fl, ql in zip(float_params["layers"], quant_params["layers"], strict=True):
        for name, w in ql.items():
            if isinstance(w, QuantizedWeight):
                yield name, np.asarray(fl[name], np.float32), w


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_layer_reconstruction_error_is_bounded(demo_float, method):
    cfg, float_params = demo_float
    quant = load_params(DEMO_MODEL_DIR, cfg, quantization=QuantConfig.on_the_fly(method))
    pairs = list(_pairs(float_params, quant))
    assert len(pairs) == 7 * cfg.num_hidden_layers  # q k v o gate up down in every layer
    for name, w, qw in pairs:
        assert qw.kind == method and qw.scales.shape == (1, w.shape[1])  # per output channel
        scale = np.asarray(qw.scales)  # [1, out]
        err = np.abs(np.asarray(dequantize(qw)) - w)
        if method == "int8":  # round to nearest: half a step
            bound = scale / 2 * (1 + 1e-5)
        else:  # e4m3: 3 mantissa bits (half ulp 2^-4 relative), subnormal steps 2^-9 * scale
            bound = np.abs(w) * 2.0 ** -4 + scale * 2.0 ** -10 + 1e-7
        assert np.all(err <= bound), name
        rel = np.linalg.norm(err) / np.linalg.norm(w)
        assert rel < (0.01 if method == "int8" else 0.05), (name, rel)


@pytest.mark.parametrize("method, tp", [("int8", 1), ("fp8", 2)])
def test_greedy_zen_lines_match_the_bf16_model(bf16_zen, method, tp):
    llm = LLM(dtype="bfloat16", quantization=method, tensor_parallel_size=tp, warmup=False)
    assert llm.engine.quantization_method == method
    assert first_lines(llm.generate(ZEN_PROMPTS, ZEN_GREEDY)) == bf16_zen


def test_quantized_weights_take_less_memory(demo_float):
    cfg, float_params = demo_float
    quant = load_params(DEMO_MODEL_DIR, cfg, dtype="bfloat16",
                        quantization=QuantConfig.on_the_fly("int8"))
    for _, w, qw in _pairs(float_params, quant):
        bf16_bytes = w.size * jnp.dtype(jnp.bfloat16).itemsize
        assert qw.nbytes < 0.6 * bf16_bytes


def test_unknown_or_mismatched_method_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="int3")
    with pytest.raises(ValueError, match="needs a checkpoint quantized with it"):
        LLM(quantization="gptq")


def test_every_architecture_quantizes_its_layers(hf_models):
    """GPT-2 stores Conv1D weights (not transposed), Phi-3 fused ones: both are quantized too."""
    for name in ("gpt2", "phi3"):
        cfg = ModelConfig.from_pretrained(hf_models[name])
        params = load_params(hf_models[name], cfg, quantization=QuantConfig.on_the_fly("int8"))
        layer = params["layers"][0]
        assert all(isinstance(layer[k], QuantizedWeight) for k in layer if k.endswith("_proj"))
