"""Mesh validation errors, and the partition table applied to every Llama-family param."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pjinfer.config import ModelConfig
from pjinfer.models.spec import shape_tree
from pjinfer.sharding.mesh import make_mesh
from pjinfer.sharding.placement import expand_kv_heads
from pjinfer.sharding.rules import kv_cache_sharding, layout_config, param_shardings
from pjinfer.weights import load_params


def param_shapes(cfg):
    return shape_tree(cfg.param_specs())


def test_mesh_axes_and_devices(gqa8_model):
    cfg = ModelConfig.from_pretrained(gqa8_model)
    mesh = make_mesh(4, 2, cfg=cfg)
    assert mesh.axis_names == ("dp", "tp") and dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]


@pytest.mark.parametrize("tp, dp, message", [
    (3, 1, r"tensor_parallel_size \(3\) must divide num_attention_heads \(8\).*\[1, 2, 4, 8\]"),
    (16, 1, r"needs 16 devices but only 8 are visible; lower tensor_parallel_size to at most 8"),
    (4, 4, r"x data_parallel_size \(4\) needs 16 devices"),
])
def test_bad_parallelism_raises_clear_errors(gqa8_model, tp, dp, message):
    cfg = ModelConfig.from_pretrained(gqa8_model)
    with pytest.raises(ValueError, match=message):
        make_mesh(tp, dp, cfg=cfg)


def test_engine_rejects_tp_that_does_not_divide_heads(gqa8_model):
    import pjinfer

    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        pjinfer.LLM(str(gqa8_model), tensor_parallel_size=3)


def _specs(cfg, tp):
    shardings = param_shardings(layout_config(cfg, tp), make_mesh(tp, cfg=cfg))
    return jax.tree.map(lambda s: s.spec, shardings)


def test_megatron_layout_for_every_param(hf_models):
    cfg = ModelConfig.from_pretrained(hf_models["llama_tied"])  # MHA, biases, tied embedding
    specs = _specs(cfg, 4)
    assert set(specs) == set(param_shapes(cfg))
    assert specs["embed"] == P("tp", None) and specs["final_norm"] == P(None)
    layer = specs["layers"][1]
    assert set(layer) == set(param_shapes(cfg)["layers"][1])
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        assert layer[name] == P(None, "tp"), name  # column-parallel
    for name in ("o_proj", "down_proj"):
        assert layer[name] == P("tp", None), name  # row-parallel
    for name in ("q_bias", "k_bias", "v_bias", "gate_bias", "up_bias"):
        assert layer[name] == P("tp"), name  # follow their column split
    for name in ("o_bias", "down_bias", "input_norm", "post_attn_norm"):
        assert layer[name] == P(None), name  # added after the all-reduce


def test_untied_head_is_vocab_parallel(hf_models):
    cfg = ModelConfig.from_pretrained(hf_models["qwen3"])
    specs = _specs(cfg, 2)
    assert specs["lm_head"] == P(None, "tp")
    assert specs["layers"][0]["q_norm"] == P(None) and specs["layers"][0]["k_norm"] == P(None)


def test_kv_heads_are_duplicated_when_tp_exceeds_them(gqa8_model):
    cfg = ModelConfig.from_pretrained(gqa8_model)  # 8 heads, 2 kv heads, head_dim 8
    assert layout_config(cfg, 2) is cfg
    lcfg = layout_config(cfg, 8)
    assert lcfg.num_key_value_heads == 8
    assert param_shapes(lcfg)["layers"][0]["k_proj"] == (64, 64)
    assert kv_cache_sharding(lcfg, make_mesh(8, cfg=cfg)).spec == P(None, None, "tp", None)
    w = np.arange(2 * 16, dtype=np.float32).reshape(2, 16)  # 2 heads of 8 columns
    out = np.asarray(expand_kv_heads(w, 4, 8))
    heads = [out[:, 8 * j:8 * j + 8] for j in range(8)]
    for j, h in enumerate(heads):  # copy j of the layout is head j // 4
        np.testing.assert_array_equal(h, w[:, 8 * (j // 4):8 * (j // 4) + 8])


def test_sharded_dummy_weights_equal_unsharded(gqa8_model):
    cfg = ModelConfig.from_pretrained(gqa8_model)
    mesh = make_mesh(4, cfg=cfg)
    sharded = load_params(None, cfg, load_format="dummy", dtype="float32", seed=3, mesh=mesh)
    plain = load_params(None, cfg, load_format="dummy", dtype="float32", seed=3)
    q = sharded["layers"][1]["q_proj"]
    assert q.sharding.spec == P(None, "tp") and q.addressable_shards[0].data.shape == (64, 16)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(plain["layers"][1]["q_proj"]))
    np.testing.assert_array_equal(
        np.asarray(sharded["layers"][0]["v_proj"]),
        np.asarray(expand_kv_heads(plain["layers"][0]["v_proj"], 2, cfg.head_dim)))
