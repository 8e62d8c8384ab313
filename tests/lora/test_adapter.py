"""Reading PEFT folders: fused projections, and a clear error for each kind of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pjinfer.config import ModelConfig
from pjinfer.lora.adapter import LoRALoadError, load_adapter


def _cfg(models) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((models.base / "config.json").read_text()))


def _copy(src: Path, dst: Path, *, config: dict | None = None,
          tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        path = dst / "adapter_model.safetensors"
        save_file(tensors(load_file(path)), path)
    return dst


def test_scaling_folded_into_b(llama_lora):
    """B = lora_B^T * alpha / r (alpha / sqrt(r) with use_rslora), A = lora_A^T."""
    cfg = _cfg(llama_lora)
    raw = load_file(llama_lora.adapters["qv_rs"] / "adapter_model.safetensors")
    a_name = next(k for k in raw if "layers.1.self_attn.v_proj.lora_A" in k)
    adapter = load_adapter("qv_rs", str(llama_lora.adapters["qv_rs"]), cfg, 16)
    a, b = adapter.weights[1, "v_proj"]
    np.testing.assert_array_equal(a, raw[a_name].T)
    np.testing.assert_allclose(b, raw[a_name.replace("lora_A", "lora_B")].T * 8 / 2, rtol=1e-6)
    assert adapter.rank == 4 and (0, "o_proj") not in adapter.weights


def test_fused_qkv_and_gate_up_split_into_parts(llama_lora, tmp_path):
    """A Phi-3-style adapter on qkv_proj / gate_up_proj: A shared, B split by columns."""
    cfg = _cfg(llama_lora)
    q, kv, m = 64, 32, 128  # TINY: 4 heads x 16, 2 kv heads x 16, intermediate 128
    rng = np.random.default_rng(0)
    tensors = {"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight":
               rng.normal(size=(4, 64)).astype(np.float32),
               "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight":
               rng.normal(size=(q + 2 * kv, 4)).astype(np.float32),
               "base_model.model.model.layers.0.mlp.gate_up_proj.lora_A.weight":
               rng.normal(size=(4, 64)).astype(np.float32),
               "base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight":
               rng.normal(size=(2 * m, 4)).astype(np.float32)}
    (tmp_path / "fused").mkdir()
    save_file(tensors, tmp_path / "fused" / "adapter_model.safetensors")
    (tmp_path / "fused" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 4,
         "target_modules": ["qkv_proj", "gate_up_proj"]}))
    adapter = load_adapter("fused", str(tmp_path / "fused"), cfg, 8)
    b_qkv = tensors["base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"].T
    np.testing.assert_array_equal(adapter.weights[0, "k_proj"][1], b_qkv[:, q:q + kv])
    np.testing.assert_array_equal(adapter.weights[0, "v_proj"][1], b_qkv[:, q + kv:])
    b_gu = tensors["base_model.model.model.layers.0.mlp.gate_up_proj.lora_B.weight"].T
    np.testing.assert_array_equal(adapter.weights[0, "up_proj"][1], b_gu[:, m:])
    assert set(adapter.weights) == {(0, p) for p in ("q_proj", "k_proj", "v_proj",
                                                     "gate_proj", "up_proj")}


def _widen_a(tensors):
    return {k: (np.concatenate([v, v], axis=1) if "lora_A" in k else v)
            for k, v in tensors.items()}


BAD = {  # case -> (how to break the all7 adapter, words the error must contain)
    "rank": (dict(config=None), "exceeds max_lora_rank"),
    "unknown_module": (dict(config={"target_modules": ["q_proj", "lm_head"]}),
                       "unknown target module"),
    "another_base": (dict(tensors=_widen_a), "another base model"),
    "dora": (dict(config={"use_dora": True}), "DoRA"),
    "bad_r": (dict(config={"r": "eight"}), "positive integer r"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_say_why(llama_lora, tmp_path, case):
    change, words = BAD[case]
    folder = _copy(llama_lora.adapters["all7"], tmp_path / case, **change)
    max_rank = 4 if case == "rank" else 16
    with pytest.raises(LoRALoadError, match=words):
        load_adapter(case, str(folder), _cfg(llama_lora), max_rank)


def test_missing_and_malformed_files(llama_lora, tmp_path):
    cfg, src = _cfg(llama_lora), llama_lora.adapters["all7"]
    with pytest.raises(LoRALoadError, match="not a local folder"):
        load_adapter("x", str(tmp_path / "nowhere"), cfg, 16)
    no_config = _copy(src, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoRALoadError, match="no adapter_config.json"):
        load_adapter("x", str(no_config), cfg, 16)
    bad_json = _copy(src, tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{r: 8")
    with pytest.raises(LoRALoadError, match="not valid JSON"):
        load_adapter("x", str(bad_json), cfg, 16)
    no_weights = _copy(src, tmp_path / "no_weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRALoadError, match="no adapter_model.safetensors"):
        load_adapter("x", str(no_weights), cfg, 16)
    truncated = _copy(src, tmp_path / "truncated")
    (truncated / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00")
    with pytest.raises(LoRALoadError, match="cannot be read"):
        load_adapter("x", str(truncated), cfg, 16)
