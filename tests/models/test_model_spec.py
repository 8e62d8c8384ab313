"""The ModelSpec seam: an architecture registered from outside brings its own MLP, parameter
mapping, config parsing and partition rules, and the generic loader, sharding rules and dense
oracle run it without knowing it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from pjinfer.models import llama
from pjinfer.models.dense import dense_logits
from pjinfer.models.layers import linear
from pjinfer.models.registry import register_model
from pjinfer.models.spec import ParamSpec, fuse, transpose
from pjinfer.sharding.mesh import make_mesh
from pjinfer.sharding.rules import param_shardings
from pjinfer.weights import load_engine_model, load_model

IDS = np.array([[1, 5, 9, 13, 17, 21, 25, 29], [1, 100, 7, 3, 0, 0, 0, 0]], np.int32)
LENGTHS = np.array([8, 4], np.int32)


def fused_mlp(lp: dict, x: jax.Array) -> jax.Array:
    """SwiGLU from one fused gate|up projection [D, 2I]."""
    gate, up = jnp.split(linear(x, lp["gate_up"]), 2, axis=-1)
    return linear(jax.nn.silu(gate) * up, lp["down"])


def fused_mlp_specs(cfg, i: int) -> list[ParamSpec]:
    d, m, hf = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{i}.mlp"
    return [ParamSpec(("layers", i, "gate_up"), (d, 2 * m),
                      hf_names=(f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
                      transform=fuse(axis=1, pre=transpose)),
            ParamSpec(("layers", i, "down"), (m, d), hf_names=(f"{hf}.down_proj.weight",),
                      transform=transpose)]


def parse_toy(raw: dict) -> dict:
    return {**llama.parse_llama(raw), "options": (("toy_flag", raw.get("toy_flag", 0)),)}


TOY = dataclasses.replace(
    llama.LLAMA, forward=partial(llama.forward, mlp=fused_mlp),
    param_specs=partial(llama.param_specs, mlp_specs=fused_mlp_specs),
    partition_rules=(*llama.PARTITION_RULES, (r"gate_up$", ("embed", "mlp")),
                     (r"down$", ("mlp", "embed"))),
    parse_config=parse_toy)


def _as_architecture(src, dst, architecture: str, **extra):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, "architectures": [architecture],
                                                 **extra}))
    return dst


def test_registered_architecture_with_its_own_mlp_matches_llama(hf_models, tmp_path):
    register_model("ToyForCausalLM", TOY, overwrite=True)
    path = _as_architecture(hf_models["llama"], tmp_path / "toy", "ToyForCausalLM", toy_flag=7)
    cfg, params = load_model(path, dtype="float32")
    ref_cfg, ref = load_model(hf_models["llama"], dtype="float32")
    assert cfg.option("toy_flag") == 7 and cfg.num_params() == ref_cfg.num_params()
    assert params["layers"][0]["gate_up"].shape == (64, 256)
    assert "gate_proj" not in params["layers"][0]
    ours = dense_logits(params, cfg, jnp.asarray(IDS), jnp.asarray(LENGTHS))
    theirs = dense_logits(ref, ref_cfg, jnp.asarray(IDS), jnp.asarray(LENGTHS))
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-5, atol=1e-5)
    specs = jax.tree.map(lambda s: s.spec, param_shardings(cfg, make_mesh(2, cfg=cfg)))
    assert specs["layers"][1]["gate_up"] == P(None, "tp")
    assert specs["layers"][1]["down"] == P("tp", None)
    _, sharded, _ = load_engine_model(path, tensor_parallel_size=2, dtype="float32")
    assert sharded["layers"][1]["gate_up"].sharding.spec == P(None, "tp")
    on_mesh = dense_logits(sharded, cfg, jnp.asarray(IDS), jnp.asarray(LENGTHS))
    np.testing.assert_allclose(np.asarray(on_mesh), np.asarray(ours), rtol=1e-5, atol=1e-5)


def int8_specs(cfg) -> list[ParamSpec]:
    """Llama's params plus, per layer, an int8 weight and its float32 scale (kept as stored)."""
    extra = [spec for i in range(cfg.num_hidden_layers) for spec in (
        ParamSpec(("layers", i, "down_q"), (cfg.intermediate_size, cfg.hidden_size), "int8",
                  (f"model.layers.{i}.mlp.down_proj.qweight",), transpose),
        ParamSpec(("layers", i, "down_scale"), (cfg.hidden_size,), "float32",
                  (f"model.layers.{i}.mlp.down_proj.scale",), init="ones"))]
    return llama.param_specs(cfg) + extra


INT8 = dataclasses.replace(llama.LLAMA, param_specs=int8_specs, partition_rules=(
    *llama.PARTITION_RULES, (r"down_q$", ("mlp", "embed")), (r"down_scale$", ("embed",))))


def test_loader_keeps_a_specs_explicit_dtype(hf_models, tmp_path):
    register_model("Int8ToyForCausalLM", INT8, overwrite=True)
    path = _as_architecture(hf_models["mistral"], tmp_path / "int8", "Int8ToyForCausalLM")
    rng = np.random.default_rng(0)
    extra = {}
    for i in range(2):
        extra[f"model.layers.{i}.mlp.down_proj.qweight"] = rng.integers(
            -128, 128, (64, 128), dtype=np.int8)  # HF [out, in]
        extra[f"model.layers.{i}.mlp.down_proj.scale"] = rng.random(64, dtype=np.float32)
    save_file(extra, path / "quant.safetensors")
    _, params = load_model(path, dtype="bfloat16")
    layer = params["layers"][1]
    assert layer["q_proj"].dtype == jnp.bfloat16
    assert layer["down_q"].dtype == jnp.int8 and layer["down_scale"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(layer["down_q"]),
                                  extra["model.layers.1.mlp.down_proj.qweight"].T)
    np.testing.assert_array_equal(np.asarray(layer["down_scale"]),
                                  extra["model.layers.1.mlp.down_proj.scale"])
    _, dummy = load_model(path, dtype="bfloat16", load_format="dummy")
    assert dummy["layers"][0]["down_q"].dtype == jnp.int8
    assert dummy["layers"][0]["down_scale"].dtype == jnp.float32
