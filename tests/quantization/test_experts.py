"""Quantized MoE experts: on-the-fly fp8 / int8 and fp8 checkpoints through the engine equal
transformers running the same model with the dequantized weights (float32, greedy 24 tokens,
logits within 1e-3 relative; chunked prefill, prefix caching, tp=2 with and without expert
parallelism); bounded reconstruction error; one clear error per unsupported expert format."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pjinfer import LLM
from pjinfer.config import ModelConfig
from pjinfer.errors import ModelLoadError
from pjinfer.models.spec import get_path
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.experts import (
    QuantizedExperts,
    dequantize_experts,
    quantize_experts,
)
from pjinfer.quantization.loader import device_bytes
from pjinfer.quantization.weight import QuantizedWeight, dequantize
from pjinfer.weights import SafetensorsIndex
from tests.quantization import checkpoints
from tests.quantization.test_checkpoints import ENGINE, _check

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_reconstruction_error_is_bounded(kind):
    """Per expert and output channel: scales [E, *out], values [E, *out, K] as stored."""
    rng = np.random.default_rng(0)
    for shape in ((4, 32, 2, 24), (4, 24, 32)):  # gate/up [E, D, 2, I], down [E, I, D]
        w = rng.normal(size=shape).astype(np.float32) * rng.uniform(0.1, 3.0, size=shape[:1]
                                                                     + (1,) * (len(shape) - 1))
        q = quantize_experts(jnp.asarray(w), kind)
        e, k, *out = shape
        assert q.values.shape == (e, *out, k) and q.scales.shape == (e, *out)
        assert q.kind == kind and q.shape == shape
        scale = np.asarray(q.scales)[:, None]  # [E, 1, *out]
        err = np.abs(np.asarray(dequantize_experts(q)) - w)
        if kind == "int8":  # round to nearest: half a step
            bound = scale / 2 * (1 + 1e-5)
        else:  # e4m3: half an ulp (2^-4 relative), subnormal steps 2^-9 of the scale
            bound = np.abs(w) * 2.0 ** -4 + scale * 2.0 ** -10 + 1e-7
        assert np.all(err <= bound)
        assert np.linalg.norm(err) / np.linalg.norm(w) < (0.01 if kind == "int8" else 0.05)


def test_quantized_experts_take_about_half_the_bf16_bytes(moe_models):
    cfg = ModelConfig.from_pretrained(moe_models["qwen3_moe"])
    stacks = [p for p in cfg.param_specs() if p.path[-1] in ("experts_gate_up", "experts_down")]
    assert stacks
    for method in ("fp8", "int8"):
        for p in stacks:  # a byte a value plus a float32 scale per expert and channel
            values = int(np.prod(p.shape))
            q = device_bytes(p, QuantConfig.on_the_fly(method), 2)
            assert q == values + 4 * values // p.shape[1] < 0.6 * device_bytes(p, None, 2)


def _oracle(folder, params, cfg):
    """transformers' model of `folder` (float32) with every weight pjinfer quantized replaced
    by its dequantized value (expert stacks: transformers 5's fused in-memory tensors)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = model.state_dict()
    for p in cfg.param_specs():
        value = get_path(params, p.path)
        if isinstance(value, QuantizedWeight):
            name, w = p.hf_names[0], np.asarray(dequantize(value)).T  # [out, in]
        elif isinstance(value, QuantizedExperts):
            w = np.asarray(dequantize_experts(value))
            e, k, *out = w.shape  # gate/up [E, D, 2, I] -> [E, 2I, D]; down [E, I, D] -> [E, D, I]
            w = np.moveaxis(w, 1, -1).reshape(e, -1, k)
            kind = "gate_up_proj" if p.path[-1] == "experts_gate_up" else "down_proj"
            name = f"model.layers.{p.path[1]}.mlp.experts.{kind}"
        else:
            continue
        assert name in state and tuple(state[name].shape) == w.shape, name
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    model.load_state_dict(state)
    return model


def _stacks(llm: LLM, kind: str) -> None:
    layer = next(lp for lp in llm.engine.runner.params["layers"] if "router" in lp)
    for name in ("experts_gate_up", "experts_down"):
        assert isinstance(layer[name], QuantizedExperts) and layer[name].kind == kind, name


@pytest.mark.parametrize("arch, method, extra", [
    ("qwen3_moe", "fp8", {}),
    ("mixtral", "int8", {}),
    ("qwen2_moe", "fp8", {}),  # shared expert (Linear weights quantized) and dense layers
    ("qwen3_moe", "int8", dict(tensor_parallel_size=2)),  # experts split over I
    ("qwen3_moe", "fp8", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
])
def test_on_the_fly_experts_match_transformers(moe_models, arch, method, extra):
    llm = LLM(str(moe_models[arch]), quantization=method, **ENGINE, **extra)
    assert llm.engine.quantization_method == method
    _stacks(llm, method)
    _check(llm, _oracle(moe_models[arch], llm.engine.runner.params, llm.engine.model_config))


@pytest.mark.parametrize("name, extra", [
    ("fp8_channel", {}), ("fp8_tensor", dict(tensor_parallel_size=2, enable_expert_parallel=True))])
def test_fp8_checkpoint_experts_load_as_stored(moe_models, tmp_path, name, extra):
    folder = tmp_path / "qwen3_moe-fp8"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, name)
    llm = LLM(str(folder), **ENGINE, **extra)
    assert llm.engine.quantization_method == "fp8"
    _stacks(llm, "fp8")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


@pytest.mark.parametrize("name", ["gptq4_g32_asym_act", "awq_g32"])
def test_int_packed_experts_are_dequantized_at_load(moe_models, tmp_path, caplog, name):
    """GPTQ (act-order, asymmetric) and AWQ experts, which the expert kernels do not read:
    dequantized to the model dtype at load, with a warning; the projections stay packed."""
    folder = tmp_path / f"qwen3_moe-{name}"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, name)
    with caplog.at_level("WARNING", logger="pjinfer"):
        llm = LLM(str(folder), **ENGINE)
    assert "dequantized to the model dtype" in caplog.text
    layer = llm.engine.runner.params["layers"][0]
    assert not isinstance(layer["experts_gate_up"], QuantizedExperts)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


def test_missing_expert_parts_are_named(moe_models, tmp_path):
    """An fp8 expert without its scale, a GPTQ expert without its scales: one error each
    naming the tensor."""
    src = moe_models["qwen3_moe"]
    for name, missing in (("fp8_channel", "model.layers.1.mlp.experts.3.down_proj.weight_scale"),
                          ("gptq4_g32_asym_act", "model.layers.0.mlp.experts.5.up_proj.scales")):
        folder = tmp_path / name
        checkpoints.folder(src, folder, name, drop=(missing,))
        with pytest.raises(ModelLoadError, match=missing):
            LLM(str(folder), **ENGINE)


def test_fp8_values_are_kept_as_stored(moe_models, tmp_path):
    """The checkpoint's e4m3 bytes land unchanged in the stack's [E, *out, K] values."""
    folder = tmp_path / "fp8"
    checkpoints.folder(moe_models["qwen3_moe"], folder, "fp8_channel")
    llm = LLM(str(folder), **ENGINE)
    down = llm.engine.runner.params["layers"][0]["experts_down"]
    stored = SafetensorsIndex(folder).get("model.layers.0.mlp.experts.2.down_proj.weight")
    assert stored.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(down.values[2]).view(np.uint8), stored.view(np.uint8))


def test_block_wise_fp8_experts_are_dequantized_at_load(moe_models, tmp_path, caplog):
    """Block scales vary along K, which the expert kernels scale once after it: such experts
    load dequantized (with a warning); the projections keep their block scales as groups."""
    folder = tmp_path / "qwen3_moe-fp8-block"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, "fp8_block")
    with caplog.at_level("WARNING", logger="pjinfer"):
        llm = LLM(str(folder), **ENGINE)
    assert "block-wise fp8 experts are dequantized" in caplog.text
    layer = llm.engine.runner.params["layers"][0]
    assert not isinstance(layer["experts_down"], QuantizedExperts)
    q = layer["q_proj"]
    assert q.kind == "fp8" and q.scales.shape == (64 // checkpoints.FP8_BLOCK[1], 128)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)
