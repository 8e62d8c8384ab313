"""Quantized MoE experts: on-the-fly fp8 / int8, fp8 checkpoints (per tensor, channel or block)
and symmetric int8 ones through the engine equal
transformers running the same model with the dequantized weights (float32, greedy 24 tokens,
logits within 1e-3 relative; chunked prefill, prefix caching, tp=2 with and without expert
parallelism); bounded reconstruction error; one clear error per unsupported expert format."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.config import ModelConfig
from pjinfer.errors import ModelLoadError
from pjinfer.models.spec import get_path
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.experts import (
    QuantizedExperts,
    dequantize_experts,
    pack_int4_experts,
    quantize_experts,
)
from pjinfer.quantization.loader import device_bytes
from pjinfer.quantization.weight import QuantizedWeight, dequantize, pack_int4_rows
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


@pytest.mark.parametrize("name, extra, zeros", [
    ("gptq4_g32_asym", {}, True),
    ("awq_g32", dict(tensor_parallel_size=2, enable_expert_parallel=True), True),
    ("ct_w4a16_g32", {}, False),  # symmetric: zero 8, no zeros stored
])
def test_int4_checkpoint_experts_load_as_stored(moe_models, tmp_path, name, extra, zeros):
    """4-bit GPTQ, AWQ and compressed-tensors experts keep their nibbles (a quarter of bf16's
    bytes, plus scales and zeros per 32-row group)."""
    folder = tmp_path / f"qwen3_moe-{name}"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, name)
    llm = LLM(str(folder), **ENGINE, **extra)
    _stacks(llm, "int4")
    layer = llm.engine.runner.params["layers"][0]
    gate_up = layer["experts_gate_up"]
    assert gate_up.values.shape[-1] == 32 and gate_up.k_groups == 2  # K 64: bytes, groups
    assert (gate_up.zeros is not None) == zeros
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


@pytest.mark.parametrize("extra", [{}, dict(tensor_parallel_size=2,
                                           enable_expert_parallel=True)])
def test_act_order_int4_experts_load_as_stored(moe_models, tmp_path, extra):
    """GPTQ act-order experts keep their rows sorted by group with each expert's row order
    (`perm` [E, K], gate and up sharing theirs); the MoE layer permutes x per expert."""
    folder = tmp_path / "qwen3_moe-act"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder,
                                    "gptq4_g32_asym_act_shared")
    llm = LLM(str(folder), **ENGINE, **extra)
    _stacks(llm, "int4")
    layer = llm.engine.runner.params["layers"][0]
    perm = np.asarray(layer["experts_gate_up"].perm)  # K 64: 2 groups reordered
    assert perm.shape == (16, 64) and not np.array_equal(perm[0], np.arange(64))
    assert layer["experts_down"].perm is None  # K 32: one group, whose order is no matter
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


@pytest.mark.parametrize("name", ["gptq4_g32_asym_act", "awq_g32",
                                  "gptq4_g32_asym_act_shared"])
def test_int_packed_experts_are_dequantized_at_load(moe_models, tmp_path, caplog, name):
    """Experts the expert kernels cannot read as stored, dequantized to the model dtype at
    load with a warning (the projections stay packed): gate and up stored with different
    act-order row orders (gate/up dequantized, down kept), and down stacks that tp=2 without
    expert parallelism would split along K: int4's one group, act-order's rows."""
    folder = tmp_path / f"qwen3_moe-{name}"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, name)
    extra = {} if name == "gptq4_g32_asym_act" else dict(tensor_parallel_size=2)
    with caplog.at_level("WARNING", logger="pjinfer"):
        llm = LLM(str(folder), **ENGINE, **extra)
    assert "dequantized to the model dtype" in caplog.text
    layer = llm.engine.runner.params["layers"][0]
    assert isinstance(layer["experts_down"], QuantizedExperts) == (not extra)
    assert isinstance(layer["experts_gate_up"], QuantizedExperts) == bool(extra)
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


@pytest.mark.parametrize("name, kind, extra, groups", [
    ("fp8_block", "fp8", {}, (2, 1)),  # blocks [16, 32]: gate/up's K 64 in 2, down's 32 in 1
    ("fp8_block16", "fp8", dict(tensor_parallel_size=2), (4, 2)),  # down's 2 split over tp
    ("fp8_block16", "fp8", dict(tensor_parallel_size=2, enable_expert_parallel=True), (4, 2)),
    ("gptq8_gall_sym", "int8", {}, (1, 1)),  # per channel
    ("ct_w8a16_g16", "int8", dict(tensor_parallel_size=2), (4, 2)),
])
def test_grouped_checkpoint_experts_load_as_stored(moe_models, tmp_path, name, kind, extra,
                                                   groups):
    """Block-wise fp8 and symmetric 8-bit int experts (GPTQ, compressed-tensors) become
    one-byte stacks with scales per output channel and K group [E, G, *out] (one group: per
    channel [E, *out]), as the expert kernels read them."""
    folder = tmp_path / f"qwen3_moe-{name}"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, name)
    llm = LLM(str(folder), **ENGINE, **extra)
    _stacks(llm, kind)
    layer = llm.engine.runner.params["layers"][0]
    assert (layer["experts_gate_up"].k_groups, layer["experts_down"].k_groups) == groups
    # block-wise K-grouped scales span a block's 16 output columns, unless a mesh may cut
    # the blocks (down's one K group here is per channel)
    cols = (16, 1) if name == "fp8_block" else (1, 1)
    assert (layer["experts_gate_up"].scale_cols, layer["experts_down"].scale_cols) == cols
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


def test_block_wise_fp8_experts_whose_groups_do_not_split_are_dequantized(moe_models,
                                                                         tmp_path, caplog):
    """tp=4 without expert parallelism splits down's K (2 groups of 16) four ways: those
    experts load dequantized, with a warning saying why; gate/up's stay fp8."""
    folder = tmp_path / "qwen3_moe-fp8-block16"
    oracle_dir = checkpoints.folder(moe_models["qwen3_moe"], folder, "fp8_block16")
    with caplog.at_level("WARNING", logger="pjinfer"):
        llm = LLM(str(folder), tensor_parallel_size=4, **ENGINE)
    assert "split whole over tensor_parallel_size" in caplog.text
    layer = llm.engine.runner.params["layers"][0]
    assert isinstance(layer["experts_gate_up"], QuantizedExperts)
    assert not isinstance(layer["experts_down"], QuantizedExperts)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    _check(llm, oracle)


def test_k_grouped_experts_dequantize_and_count_their_scales(moe_models):
    """Each K group's values times its own scale; memory planning counts G scales a channel."""
    rng = np.random.default_rng(3)
    values = jnp.asarray(rng.normal(size=(3, 5, 2, 8)) * 50, jnp.float8_e4m3fn)  # [E, *out, K]
    scales = jnp.asarray(rng.uniform(0.5, 2, size=(3, 4, 5, 2)), jnp.float32)  # [E, G, *out]
    q = QuantizedExperts(values, scales)  # K 8 in 4 groups of 2
    assert q.shape == (3, 8, 5, 2) and q.k_groups == 4
    w = np.asarray(dequantize_experts(q))  # [E, K, *out]
    for k in range(8):
        want = np.asarray(values[..., k], np.float32) * np.asarray(scales[:, k // 2])
        np.testing.assert_array_equal(w[:, k], want)
    assert q.with_out_shape(10).scales.shape == (3, 4, 10)
    cfg = ModelConfig.from_pretrained(moe_models["qwen3_moe"])
    stack = next(p for p in cfg.param_specs() if p.path[-1] == "experts_gate_up")
    block = QuantConfig.from_hf({"quant_method": "fp8", "weight_block_size": [16, 16]})
    values = int(np.prod(stack.shape))  # K 64: 4 groups
    assert device_bytes(stack, block, 2) == values + 4 * values // 64 * 4


@pytest.mark.parametrize("k, group", [(64, 32), (128, 128), (96, 32)])
def test_int4_stacks_are_linear_weights_nibble_layout(k, group):
    """An int4 stack's values [E, *out, K / 2] are each expert's Linear weight as
    `weight.pack_int4_rows` packs it (what the checkpoint readers give), and dequantize to
    (u - zero) x scale of each K group."""
    rng = np.random.default_rng(k)
    u = rng.integers(0, 16, size=(3, k, 2, 5))  # [E, K, *out]
    packed = np.asarray(pack_int4_experts(jnp.asarray(u, jnp.int32), group))
    for e in range(3):
        want = pack_int4_rows(u[e].reshape(k, 10), k // group)  # [out, K / 2]
        np.testing.assert_array_equal(packed[e].reshape(10, -1), want)
    scales = rng.uniform(0.5, 2, size=(3, k // group, 2, 5)).astype(np.float32)
    zeros = rng.integers(1, 16, size=scales.shape).astype(np.float32)
    q = QuantizedExperts(jnp.asarray(packed), jnp.asarray(scales), jnp.asarray(zeros))
    groups = np.arange(k) // group
    want = (u - zeros[:, groups]) * scales[:, groups]
    np.testing.assert_allclose(np.asarray(dequantize_experts(q)), want, rtol=1e-6)
    assert q.kind == "int4" and q.shape == (3, k, 2, 5)


@pytest.mark.parametrize("qconfig, kind, groups, extra", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
     "int4", (2, 1), {}),
    ({"quant_method": "fp8", "weight_block_size": [16, 16]}, "fp8", (4, 2),
     dict(tensor_parallel_size=2, enable_expert_parallel=True)),
])
def test_dummy_weights_take_a_checkpoint_configs_expert_layout(moe_models, tmp_path, qconfig,
                                                               kind, groups, extra):
    """`load_format="dummy"` under a quantized config.json (the benchmarks' way to run a
    GPTQ-Int4 or block-wise FP8 MoE model without its weights): the experts take the layout
    that checkpoint's would load into, and the engine serves them."""
    import json
    import shutil

    folder = tmp_path / "dummy"
    shutil.copytree(moe_models["qwen3_moe"], folder)
    config = json.loads((folder / "config.json").read_text()) | {"quantization_config": qconfig}
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", **ENGINE, **extra)
    _stacks(llm, kind)
    layer = llm.engine.runner.params["layers"][0]
    assert (layer["experts_gate_up"].k_groups, layer["experts_down"].k_groups) == groups
    out = llm.generate([[1, 5, 9, 4]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("name, share", [("qwen3-30b-a3b-gptq-int4", 0.29),
                                         ("qwen3-30b-a3b-fp8", 0.52)])
def test_quantized_qwen3_benchmark_configs_plan_their_expert_bytes(name, share):
    """The benchmarks' dummy Qwen3-30B-A3B-GPTQ-Int4 and -FP8 configs: memory planning counts
    their experts at a quarter (plus scales and zeros) and half (plus block scales) of bf16."""
    from pjinfer.quantization.config import resolve

    folder = f"configs/models/{name}"
    q = resolve(folder, None)
    stacks = [p for p in ModelConfig.from_pretrained(folder).param_specs()
              if p.path[-1] in ("experts_gate_up", "experts_down")]
    quantized = sum(device_bytes(p, q, 2) for p in stacks)
    assert quantized < share * sum(device_bytes(p, None, 2) for p in stacks)
