"""GPT-2 and Phi-3 specifics: LongRoPE's long factors, both config spellings, the per-layer
attention scale, and the config errors that name their field (parity: test_parity.py)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from pjinfer.config import ModelConfig
from pjinfer.models.dense import dense_logits
from pjinfer.models.registry import get_model_spec
from pjinfer.weights import load_model

LONG_PROMPT = [1] + [(7 * i) % 120 + 3 for i in range(79)]  # 80 tokens > original 64


def _raw(hf_models, name: str) -> dict:
    return json.loads((hf_models[name] / "config.json").read_text())


def test_phi3_long_factors_match_transformers_past_original_length(hf_models):
    import torch
    import transformers

    path = hf_models["phi3"]
    cfg, params = load_model(path, dtype="float32")
    assert cfg.rope_scaling.rope_type == "longrope" and cfg.partial_rotary_factor == 0.5
    assert cfg.rope_scaling.attention_factor == pytest.approx((1 + np.log(4) / np.log(64)) ** .5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([LONG_PROMPT])).logits[0].numpy()
    ours = np.asarray(dense_logits(params, cfg, jnp.asarray([LONG_PROMPT]),
                                   jnp.asarray([len(LONG_PROMPT)])))[0]
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) < 1e-4
    spec = get_model_spec(cfg.architecture)  # the engine's choice: by max_model_len
    short, long = spec.rotary(cfg, 64), spec.rotary(cfg, 65)
    np.testing.assert_allclose(np.asarray(long.inv_freq) * [1.5, 4.0, 9.0, 20.0],
                               np.asarray(short.inv_freq) * [1.0, 1.3, 2.0, 3.5], rtol=1e-6)


def test_phi3_transformers4_spelling_parses_like_5(hf_models):
    v5 = _raw(hf_models, "phi3")
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    rope = v5["rope_parameters"]
    v4 |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": 0.5,
           "rope_scaling": {"type": "su", "short_factor": rope["short_factor"],
                            "long_factor": rope["long_factor"]}}
    assert ModelConfig.from_hf_dict(v4) == ModelConfig.from_hf_dict(v5)


def test_phi3_sliding_window_and_tied_head(hf_models):
    cfg = ModelConfig.from_pretrained(hf_models["phi3_sw"])
    assert cfg.sliding_windows == (6, 6) and cfg.tie_word_embeddings
    assert not any(p.path == ("lm_head",) for p in cfg.param_specs())


def test_gpt2_config_names_and_attention_scales(hf_models):
    cfg = ModelConfig.from_pretrained(hf_models["gpt2"])
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.intermediate_size) == (64, 4, 256)
    assert cfg.max_position_embeddings == 256 and cfg.hidden_act == "gelu_new"
    assert cfg.attention_scales == (16 ** -0.5, 16 ** -0.5 / 2)
    relu = ModelConfig.from_pretrained(hf_models["gpt2_relu"])
    assert relu.attention_scales == (1.0, 1.0) and relu.intermediate_size == 96
    assert not relu.tie_word_embeddings


def test_gpt2_hub_checkpoint_without_transformer_prefix_loads(hf_models, tmp_path):
    """The Hub's GPT-2 files hold GPT2Model's names (h.0..., wte) and causal-mask buffers."""
    path = tmp_path / "gpt2_hub"
    shutil.copytree(hf_models["gpt2"], path)
    tensors = load_file(path / "model.safetensors")
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = np.ones((1, 1, 4, 4), np.float32)
    save_file(bare, path / "model.safetensors")
    _, ours = load_model(path, dtype="float32")
    _, ref = load_model(hf_models["gpt2"], dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, ours, ref)


@pytest.mark.parametrize("name, change, match", [
    ("gpt2", {"activation_function": "gelu_fast"}, "activation_function 'gelu_fast'"),
    ("gpt2", {"activation_function": "swish"}, "activation_function"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("phi3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                  "long_factor": [1.0] * 3}}, "short_factor has 3 entries"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4}},
     "long_factor"),
])
def test_bad_configs_name_the_field(hf_models, name, change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**_raw(hf_models, name), **change})
