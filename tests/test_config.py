"""config.json from transformers 4.x and 5.x means the same model."""

from __future__ import annotations

import pytest

from pjinfer.config import ModelConfig

LLAMA3_V4 = {  # as Meta-Llama-3.1-8B ships it (transformers 4.x): no head_dim, rope_scaling
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16", "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def test_transformers4_llama31_config():
    cfg = ModelConfig.from_hf_dict(LLAMA3_V4)
    assert cfg.head_dim == 128 and cfg.num_queries_per_kv == 4
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.rope_type == "llama3"
    assert cfg.rope_scaling.original_max_position_embeddings == 8192
    assert cfg.dtype == "bfloat16" and cfg.eos_token_ids == (128001, 128008, 128009)
    assert abs(cfg.num_params() - 8.03e9) < 0.01e9


def test_transformers5_spelling_is_equivalent():
    v5 = {k: v for k, v in LLAMA3_V4.items() if k not in ("rope_theta", "rope_scaling",
                                                          "torch_dtype")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA3_V4["rope_scaling"]}
    v5["dtype"] = "bfloat16"
    assert ModelConfig.from_hf_dict(v5) == ModelConfig.from_hf_dict(LLAMA3_V4)


def test_qwen2_use_sliding_window_false_switches_it_off():
    raw = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "max_position_embeddings": 128, "sliding_window": 4096,
           "use_sliding_window": False, "max_window_layers": 1}
    assert ModelConfig.from_hf_dict(raw).sliding_windows == ()
    on = ModelConfig.from_hf_dict({**raw, "use_sliding_window": True})
    assert on.sliding_windows == (None, 4096)  # layers >= max_window_layers slide
    assert on.qkv_bias and not on.o_bias


def test_mistral_null_window_means_full_attention():
    raw = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 100, "max_position_embeddings": 128, "sliding_window": None}
    assert ModelConfig.from_hf_dict(raw).sliding_windows == ()


@pytest.mark.parametrize("change, match", [
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"torch_dtype": "int4"}, "unknown dtype"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope type"),
    ({"rope_scaling": {"rope_type": "su", "short_factor": [1.0]}}, "long_factor"),
    ({"architectures": []}, "architectures"),
])
def test_bad_configs_name_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**LLAMA3_V4, **change})
