"""MoE models: logits against transformers, both checkpoint layouts, dummy weights, the block's
routing and padding, and one clear error per bad input."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.config import ModelConfig
from pjinfer.errors import ModelLoadError
from pjinfer.kernels import ops
from pjinfer.kernels.moe_route import route_reference as route
from pjinfer.models.dense import dense_logits
from pjinfer.models.moe import MoeConfig, expert_ffn, moe_block
from pjinfer.quantization.experts import (
    QuantizedExperts,
    dequantize_experts,
    quantize_experts,
)
from pjinfer.weights import load_model
from tests.kernels.lowering import cuda_module
from tests.kernels.test_grouped_matmul import F32_TOL
from tests.models.test_parity import PROMPTS, _hf_logits, _pad, _rel_err


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_float32_logits_match_transformers(moe_models, name):
    import torch

    cfg, params = load_model(moe_models[name], dtype="float32")
    ids, lengths = _pad(PROMPTS)
    ours = np.asarray(dense_logits(params, cfg, jnp.asarray(ids), jnp.asarray(lengths)))
    theirs, _ = _hf_logits(moe_models[name], PROMPTS, torch.float32)
    for i, ref in enumerate(theirs):
        assert _rel_err(ours[i, : lengths[i]], ref) < 1e-4, (name, i)


def test_config_fields_follow_transformers(moe_models):
    mixtral = ModelConfig.from_pretrained(moe_models["mixtral"]).option("moe")
    qwen2 = ModelConfig.from_pretrained(moe_models["qwen2_moe"]).option("moe")
    qwen3 = ModelConfig.from_pretrained(moe_models["qwen3_moe"]).option("moe")
    assert (mixtral.num_experts, mixtral.top_k, mixtral.norm_topk_prob) == (8, 2, True)
    # decoder_sparse_step 2 -> layers 1 and 3; mlp_only_layers [3] -> layer 1 alone
    assert qwen2.sparse_layers == (False, True, False, False)
    assert (qwen2.norm_topk_prob, qwen2.shared_expert_intermediate_size) == (False, 48)
    assert (qwen3.num_experts, qwen3.norm_topk_prob, qwen3.sparse_layers) == (16, True,
                                                                              (True, True))


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_fused_transformers5_layout_loads_the_same(moe_models, tmp_path, name):
    """The 3-D mlp.experts.gate_up_proj [E, 2I, D] / mlp.experts.down_proj [E, D, I] (and
    Mixtral's router as mlp.gate) that transformers 5 keeps in memory, its state_dict, load
    into the same params."""
    import torch
    import transformers
    from safetensors.torch import save_file

    src = moe_models[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    shutil.copy(src / "config.json", tmp_path / "config.json")
    save_file(state, str(tmp_path / "model.safetensors"))
    _, want = load_model(src, dtype="float32")
    _, got = load_model(tmp_path, dtype="float32")
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_dummy_weights_run(moe_models):
    cfg, params = load_model(moe_models["qwen2_moe"], load_format="dummy", dtype="float32")
    layer = params["layers"][1]
    assert layer["experts_gate_up"].shape == (8, 64, 2, 32)
    assert layer["shared_expert"]["down_proj"].shape == (48, 64)
    assert "router" not in params["layers"][0]
    ids, lengths = _pad(PROMPTS)  # the logits test's shapes: its compiled forward is reused
    logits = dense_logits(params, cfg, jnp.asarray(ids), jnp.asarray(lengths))
    assert np.isfinite(np.asarray(logits)).all()


def _block_params(seed: int, d=16, e=6, i=8):
    rng = np.random.default_rng(seed)
    return {"router": jnp.asarray(rng.normal(size=(d, e)), jnp.float32),
            "experts_gate_up": jnp.asarray(rng.normal(size=(e, d, 2, i)) / 4, jnp.float32),
            "experts_down": jnp.asarray(rng.normal(size=(e, i, d)) / 3, jnp.float32)}


def test_block_equals_per_token_loop_and_expert_shards_sum_to_it():
    """The sorted grouped GEMMs equal a plain loop over each token's experts; the experts
    split in two halves (expert parallelism) give partial sums that add up to it."""
    lp = _block_params(0)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(7, 16)), jnp.float32)
    weights, ids = route(x @ lp["router"], 2, renormalize=True)
    gu, down = np.asarray(lp["experts_gate_up"]), np.asarray(lp["experts_down"])
    want = np.zeros((7, 16), np.float32)
    for t in range(7):
        for w, e in zip(np.asarray(weights[t]), np.asarray(ids[t]), strict=True):
            gate, up = np.asarray(x[t]) @ gu[e, :, 0], np.asarray(x[t]) @ gu[e, :, 1]
            want[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ down[e])
    got = expert_ffn(x, weights, ids, lp["experts_gate_up"], lp["experts_down"])
    np.testing.assert_allclose(got, want, **F32_TOL)
    pallas = expert_ffn(x, weights, ids, lp["experts_gate_up"], lp["experts_down"],
                        backend="pallas")  # the GPU kernel, in interpret mode
    np.testing.assert_allclose(pallas, want, **F32_TOL)
    halves = [expert_ffn(x, weights, ids, lp["experts_gate_up"][s:s + 3],
                         lp["experts_down"][s:s + 3], s) for s in (0, 3)]
    np.testing.assert_allclose(halves[0] + halves[1], want, **F32_TOL)


def test_routed_decode_path_equals_sorted_one():
    """The decode path without a sort (the Pallas kernel in interpret mode): same result as
    the sorted path, with padding tokens and expert shards."""
    lp = _block_params(0)  # 6 experts, top-2: 3 tokens make 6 assignments
    gu, down = lp["experts_gate_up"], lp["experts_down"]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(3, 16)), jnp.float32)
    weights, ids = route(x @ lp["router"], 2, renormalize=True)
    weights = weights.at[2].set(0.0)  # a padding token
    assert ops.prefers_routed_matmul("pallas", 16)
    assert not ops.prefers_routed_matmul("pallas", 2048)
    assert not ops.prefers_routed_matmul("reference", 16)
    want = expert_ffn(x, weights, ids, gu, down)  # sorted, ragged_dot
    got = expert_ffn(x, weights, ids, gu, down, backend="pallas", path="routed")
    np.testing.assert_allclose(got, want, **F32_TOL)
    assert not np.any(np.asarray(got[2]))
    halves = [expert_ffn(x[:1], weights[:1], ids[:1], gu[s:s + 3], down[s:s + 3], s,
                         backend="pallas", path="routed") for s in (0, 3)]
    np.testing.assert_allclose(halves[0] + halves[1], want[:1], **F32_TOL)


def test_k_grouped_fp8_and_int4_experts_on_both_paths():
    """Block-wise fp8 and int4 gate/up experts (scales per channel and K group of 16 rows):
    the sorted grouped kernels and the routed ones (interpret mode) equal the reference over
    the weights the stacks stand for."""
    lp = _block_params(2, d=32)  # gate/up's K 32 in 2 groups of 16, down's in 1 (per channel)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(5, 32)), jnp.float32)
    weights, ids = route(x @ lp["router"], 2, renormalize=True)
    for kind in ("fp8", "int4"):  # int4: gate/up's 2 nibble blocks of 16 + 16 rows
        gu = quantize_experts(lp["experts_gate_up"], kind, 16)
        down = quantize_experts(lp["experts_down"], "fp8", 8)
        assert (gu.k_groups, down.k_groups) == (2, 1)
        want = expert_ffn(x, weights, ids, dequantize_experts(gu), dequantize_experts(down))
        for path in ("sorted", "routed"):
            got = expert_ffn(x, weights, ids, gu, down, backend="pallas", path=path)
            np.testing.assert_allclose(got, want, **F32_TOL, err_msg=f"{kind} {path}")


def test_act_order_int4_experts_permute_x_per_expert():
    """Act-order stacks (rows stored in each expert's own order, `perm`): the layer gathers
    x (and the activation) per assignment into that order, on both paths (kernels in
    interpret mode, and the XLA reference), equal to the stacks' input-order weights."""
    lp = _block_params(5, d=32, i=16)
    rng = np.random.default_rng(6)

    def act_order(w, group):  # 6 experts, each its own row order
        q = quantize_experts(w, "int4", group)
        perm = np.stack([rng.permutation(w.shape[1]) for _ in range(6)])
        return QuantizedExperts(q.values, q.scales, None, jnp.asarray(perm, jnp.int32))
    gu, down = act_order(lp["experts_gate_up"], 16), act_order(lp["experts_down"], 16)
    x = jnp.asarray(rng.normal(size=(5, 32)), jnp.float32)
    weights, ids = route(x @ lp["router"], 2, renormalize=True)
    want = expert_ffn(x, weights, ids, dequantize_experts(gu), dequantize_experts(down))
    plain = expert_ffn(x, weights, ids, dequantize_experts(gu.stored_order()),
                       dequantize_experts(down.stored_order()))
    assert not np.allclose(plain, want)  # the order matters
    for backend, path in (("reference", "sorted"), ("pallas", "sorted"), ("pallas", "routed")):
        got = expert_ffn(x, weights, ids, gu, down, backend=backend, path=path)
        np.testing.assert_allclose(got, want, **F32_TOL, err_msg=f"{backend} {path}")


def test_padding_tokens_do_not_change_real_ones():
    lp = _block_params(1)
    moe = MoeConfig(6, 2, 8, True, (True,))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(5, 16)), jnp.float32)
    full = moe_block(lp, x[:3], moe=moe)
    for backend in ("reference", "pallas"):  # the sorted XLA path, or the routed kernels
        padded = moe_block(lp, x, moe=moe, valid=jnp.arange(5) < 3, backend=backend)
        np.testing.assert_allclose(padded[:3], full, rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(padded[3:]))


def test_decode_block_lowers_to_three_kernels(monkeypatch):
    """On a GPU a decode step's MoE block is the router GEMM and three Pallas kernels: the
    routing (no top-k sort left to XLA) and the routed gate/up and down GEMMs."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' dispatch
    lp = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _block_params(1, e=128))
    moe = MoeConfig(128, 8, 8, True, (True,))
    text = cuda_module(lambda x, v: moe_block(lp, x, moe=moe, valid=v, backend="auto"),
                       jax.ShapeDtypeStruct((8, 16), jnp.bfloat16),
                       jax.ShapeDtypeStruct((8,), jnp.bool_))
    kernels = re.findall(r'name = "(\w+)", num_stages', text)  # the Triton calls
    assert sorted(kernels) == ["moe_route", "routed_matmul", "routed_matmul"], kernels
    assert "chlo.top_k" not in text and "stablehlo.sort" not in text


# ---- bad input: one clear error each ------------------------------------------------------
def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("name, field", [("mixtral", "num_local_experts"),
                                         ("qwen2_moe", "moe_intermediate_size"),
                                         ("qwen3_moe", "num_experts_per_tok")])
def test_missing_moe_field(moe_models, tmp_path, name, field):
    path = _edit_config(moe_models[name], tmp_path / "m", **{field: None})
    with pytest.raises(ModelLoadError, match=f"needs {field}"):
        ModelConfig.from_pretrained(path)


def test_top_k_above_expert_count(moe_models, tmp_path):
    path = _edit_config(moe_models["mixtral"], tmp_path / "m", num_experts_per_tok=9)
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok \(9\) exceeds the number "
                                             r"of experts \(8\)"):
        ModelConfig.from_pretrained(path)


def test_missing_expert_tensor(moe_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _edit_config(moe_models["mixtral"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model.layers.1.block_sparse_moe"
                                             r".experts.5.w3.weight'"):
        load_model(path)


def test_misshaped_expert_tensor(moe_models, tmp_path):
    from safetensors.numpy import load_file, save_file

    path = _edit_config(moe_models["qwen3_moe"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    tensors[name] = tensors[name][:, :16].copy()
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"do not combine into \('layers', 0, "
                                             r"'experts_down'\)"):
        load_model(path)
