"""Shared fixtures: tiny random-weight Hugging Face models, built once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

import pjinfer  # noqa: F401  (first: its finder keeps this checkout's kernels/ off `import kernels`)

# Several tests shard over fake CPU devices; the flag must be set before JAX initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `pjinfer serve|generate` keep compiled steps under ~/.cache/pjinfer by default: tests (and the
# CLI subprocesses they start) use a temporary folder of their own instead.
_CACHE_DIR = tempfile.mkdtemp(prefix="pjinfer-test-cache-")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ["PJINFER_COMPILATION_CACHE_DIR"] = _CACHE_DIR
if os.environ["JAX_PLATFORMS"] != "cpu":  # a GPU run (JAX_PLATFORMS=cuda)
    import jax

    # XLA's float32 dots default to TF32 there; the float32 references that kernels and steps
    # are held to must be exact, as on the CPU (Pallas' own float32 dots already are).
    jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# GPT-2 spells the shape its own way (n_embd, n_head ...) and has no GQA or intermediate_size.
GPT2_TINY = dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                 initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
BASES = {"GPT2Config": GPT2_TINY}  # config class -> its TINY (default: TINY)
# LongRoPE: factors for head_dim 16 x partial_rotary_factor 0.5 = 8 rotary dims; short ones
# up to 64 positions, long ones beyond (max_position_embeddings 256: attention factor 1.15).
PHI3_LONGROPE = dict(original_max_position_embeddings=64, partial_rotary_factor=0.5,
                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5],
                                   "long_factor": [1.5, 4.0, 9.0, 20.0]})

# name -> (transformers config class name, overrides, save_pretrained kwargs)
MODEL_VARIANTS = {
    # GQA, Llama-3 rope scaling, sharded checkpoint (index.json + several files)
    "llama": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 32}),
              dict(max_shard_size="60KB")),
    # tied embeddings, MHA, biases everywhere, linear rope scaling
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=4,
                                       attention_bias=True, mlp_bias=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0}), {}),
    "mistral": ("MistralConfig", dict(sliding_window=6, num_key_value_heads=1), {}),
    # every projection in whole 64-row / 128-column tiles (the Hopper fp8 GEMV's)
    "llama_wide": ("LlamaConfig", dict(hidden_size=128, intermediate_size=256), {}),
    # use_sliding_window=False must switch the window off although sliding_window is set
    "qwen2": ("Qwen2Config", dict(use_sliding_window=False, sliding_window=4), {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32, attention_bias=False), {}),
    # tied head, gelu_new, scores divided by layer + 1
    "gpt2": ("GPT2Config", dict(scale_attn_by_inverse_layer_idx=True), {}),
    # untied head, relu, n_inner, no 1/sqrt(hd), float32 upcast flag
    "gpt2_relu": ("GPT2Config", dict(activation_function="relu", n_inner=96,
                                     tie_word_embeddings=False, scale_attn_weights=False,
                                     reorder_and_upcast_attn=True), {}),
    "phi3": ("Phi3Config", PHI3_LONGROPE, {}),  # GQA, partial rotary, longrope (short here)
    "phi3_sw": ("Phi3Config", dict(sliding_window=6, tie_word_embeddings=True), {}),
}
# Mixture of experts (fixture `moe_models`, built only where used): enough experts that top-k
# matters, routers re-drawn wider so routing is far from uniform. Qwen2-MoE: a shared expert,
# decoder_sparse_step 2 and mlp_only_layers leave layer 1 sparse and layers 0, 2, 3 dense;
# Qwen3-MoE has 8 q heads and 16 experts so it shards over tp 1/2/4/8 with or without EP.
MOE_VARIANTS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=32), {}),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=4, num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=32, decoder_sparse_step=2,
                                         mlp_only_layers=[3], shared_expert_intermediate_size=48),
                  {}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_attention_heads=8, head_dim=16, num_experts=16,
                                         num_experts_per_tok=4, moe_intermediate_size=32,
                                         norm_topk_prob=True), {}),
}
ROUTER_STD = 0.3  # logits std ~ 0.3 * sqrt(hidden 64): a few experts clearly preferred


def build_hf_model(root: Path, name: str) -> Path:
    """Save a tiny random model of variant `name` (float32, safetensors) and return its folder."""
    import torch
    import transformers

    cls_name, overrides, save_kwargs = {**MODEL_VARIANTS, **MOE_VARIANTS}[name]
    config = getattr(transformers, cls_name)(**{**BASES.get(cls_name, TINY), **overrides})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms away from 1 so a missing or misplaced weight shows
        for pname, p in model.named_parameters():
            if "norm" in pname or ".ln_" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif pname.endswith("mlp.gate.weight"):  # a MoE router
                p.normal_(0.0, ROUTER_STD)
    path = root / name
    model.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return path


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_models")
    return {name: build_hf_model(root, name) for name in MODEL_VARIANTS}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_models")
    return {name: build_hf_model(root, name) for name in MOE_VARIANTS}


@pytest.fixture
def engine_arg_values(tmp_path) -> dict[str, object]:
    """A valid value, not the default, for every engine argument (model: an existing folder)."""
    from pjinfer.engine.config import ENGINE_ARGS, INT_LIST

    # 32: a power of two, for block_size
    samples = {int: 32, float: 0.5, str: str(tmp_path), INT_LIST: (2, 8)}
    values: dict[str, object] = {}
    for name, arg in ENGINE_ARGS.items():
        if name == "scheduling_policy":  # checked against the (pluggable) policy registry
            values[name] = "sjf"
        elif arg.type is bool:
            values[name] = not arg.default
        elif arg.choices:
            values[name] = next(c for c in reversed(arg.choices) if c != arg.default)
        else:
            values[name] = samples[arg.type]
    return values
