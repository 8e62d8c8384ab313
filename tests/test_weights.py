"""Loading a model folder: bad input gives a one-line message naming what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.numpy import load_file, save_file

from pjinfer.errors import ModelLoadError
from pjinfer.weights import load_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path, hf_models):
    path = _copy(hf_models["qwen2"], tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(path)


def test_missing_and_misshaped_tensors_are_named(tmp_path, hf_models):
    path = _copy(hf_models["qwen2"], tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    save_file({k: v for k, v in tensors.items() if k != name}, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=name):
        load_model(path)
    tensors[name] = tensors[name][:, :-1]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=f"{name}.*shape"):
        load_model(path)


def test_truncated_shard_is_named(tmp_path, hf_models):
    path = _copy(hf_models["qwen2"], tmp_path / "m")
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors is truncated"):
        load_model(path)


def test_unknown_dtype(hf_models):
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        load_model(hf_models["qwen2"], dtype="int3")


def test_dtype_auto_follows_checkpoint_and_dummy_needs_no_files(tmp_path, hf_models):
    cfg, params = load_model(hf_models["llama"], dtype="auto")
    assert params["embed"].dtype == "float32" and cfg.dtype == "float32"
    path = tmp_path / "shapes-only"
    path.mkdir()
    shutil.copy(hf_models["llama"] / "config.json", path)
    _, dummy = load_model(path, load_format="dummy", dtype="bfloat16")
    assert dummy["layers"][0]["q_proj"].shape == params["layers"][0]["q_proj"].shape
    assert str(dummy["layers"][0]["q_proj"].dtype) == "bfloat16"
