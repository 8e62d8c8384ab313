"""GPT-2 (`GPT2LMHeadModel`): the Llama decoder with LayerNorm, learned positions, plain MLP.

The forward is Llama's with its seams filled differently: `norm` is LayerNorm with bias, the
rotary setup is None (the learned `pos_embed` [n_positions, D] is added to the token
embeddings), the MLP is ungated (`layers.plain_mlp` with `activation_function`), and the
attention scale per layer comes from the config (`ModelConfig.attention_scales`).

Checkpoint: Conv1D weights are stored input-major [in, out] already, so nothing is transposed;
the fused `attn.c_attn` [D, 3D] (and its bias) is split into q/k/v at load (views of the memory
map), so the params and partition rules are Llama's plus the norm biases and `pos_embed`.
The head is tied to `wte` unless tie_word_embeddings is false (then `lm_head.weight`).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from pjinfer.config import ModelConfig
from pjinfer.models import llama
from pjinfer.models.layers import layer_norm_named, plain_mlp
from pjinfer.models.spec import ParamSpec, part, transpose

# The `activation_function`s pjinfer computes for GPT-2 (of transformers' ACT2FN names).
GPT2_ACTIVATIONS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh")


def forward(params, cfg: ModelConfig, token_ids, positions, kv_caches, metadata, *, attention,
            rotary=None):
    """Llama's forward with GPT-2's norm and MLP; see `llama.forward` for the arguments."""
    return llama.forward(params, cfg, token_ids, positions, kv_caches, metadata,
                         attention=attention, rotary=rotary, norm=layer_norm_named,
                         mlp=partial(plain_mlp, act=cfg.hidden_act))


def no_rope(cfg: ModelConfig, max_len: int | None = None) -> None:
    """Positions are learned embeddings: nothing to rotate."""
    return None


# ---- parameters -----------------------------------------------------------------------------
def _param(path: tuple, shape: tuple[int, ...], hf: str, **kw) -> ParamSpec:
    """A norm weight draws ones, a bias zeros, anything else a normal (dummy weights)."""
    init = "zeros" if hf.endswith("bias") else "ones" if ".ln_" in hf else "normal"
    return ParamSpec(path, shape, hf_names=(f"transformer.{hf}",), init=init, **kw)


def _norm(path: tuple, d: int, hf: str) -> list[ParamSpec]:
    return [_param(path, (d,), f"{hf}.weight"),
            _param((*path[:-1], f"{path[-1]}_bias"), (d,), f"{hf}.bias")]


def _layer_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    d, m, h = cfg.hidden_size, cfg.intermediate_size, f"h.{i}"
    specs = [*_norm(("layers", i, "input_norm"), d, f"{h}.ln_1"),
             *_norm(("layers", i, "post_attn_norm"), d, f"{h}.ln_2")]
    for n, name in enumerate(("q", "k", "v")):  # thirds of the fused c_attn
        cols = part(n * d, (n + 1) * d)
        specs += [_param(("layers", i, f"{name}_proj"), (d, d), f"{h}.attn.c_attn.weight",
                         transform=cols),
                  _param(("layers", i, f"{name}_bias"), (d,), f"{h}.attn.c_attn.bias",
                         transform=cols)]
    table = [("o_proj", (d, d), "attn.c_proj.weight"), ("o_bias", (d,), "attn.c_proj.bias"),
             ("up_proj", (d, m), "mlp.c_fc.weight"), ("up_bias", (m,), "mlp.c_fc.bias"),
             ("down_proj", (m, d), "mlp.c_proj.weight"), ("down_bias", (d,), "mlp.c_proj.bias")]
    return specs + [_param(("layers", i, name), shape, f"{h}.{hf}") for name, shape, hf in table]


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter with its checkpoint tensor (Conv1D weights already [in, out])."""
    d = cfg.hidden_size
    specs = [ParamSpec(("embed",), (cfg.vocab_size, d), hf_names=("transformer.wte.weight",),
                       init_scale=0.02),
             ParamSpec(("pos_embed",), (cfg.max_position_embeddings, d),
                       hf_names=("transformer.wpe.weight",), init_scale=0.02),
             *_norm(("final_norm",), d, "ln_f")]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), (d, cfg.vocab_size), hf_names=("lm_head.weight",),
                               transform=transpose))
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i)
    return specs


# ---- config.json ------------------------------------------------------------------------------
def normalize_gpt2(raw: dict[str, Any]) -> dict[str, Any]:
    """GPT-2's names for the generic fields (transformers' GPT2Config.attribute_map)."""
    d = raw["n_embd"]
    return {**raw, "hidden_size": d, "num_attention_heads": raw["n_head"],
            "num_hidden_layers": raw["n_layer"], "max_position_embeddings": raw["n_positions"],
            "intermediate_size": raw.get("n_inner") or 4 * d,
            "rms_norm_eps": raw.get("layer_norm_epsilon", 1e-5),
            "hidden_act": raw.get("activation_function", "gelu_new"),
            "tie_word_embeddings": raw.get("tie_word_embeddings", True)}


def _attention_scales(raw: dict[str, Any], head_dim: int) -> tuple[float, ...]:
    """q.k multiplier per layer: 1/sqrt(hd) unless scale_attn_weights is false, divided by
    layer + 1 with scale_attn_by_inverse_layer_idx (transformers' GPT2Attention.scaling)."""
    base = head_dim ** -0.5 if raw.get("scale_attn_weights", True) else 1.0
    by_layer = bool(raw.get("scale_attn_by_inverse_layer_idx", False))
    return tuple(base / (i + 1) if by_layer else base for i in range(raw["n_layer"]))


def parse_gpt2(raw: dict[str, Any]) -> dict[str, Any]:
    """Biases on every projection; MHA; reorder_and_upcast_attn needs nothing: pjinfer's
    attention always computes q.k and the softmax in float32, which is what it asks for."""
    act = raw.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ValueError(f"config.json: activation_function {act!r} is not supported; "
                         f"GPT-2 models use one of {', '.join(GPT2_ACTIVATIONS)}")
    return dict(qkv_bias=True, o_bias=True, mlp_bias=True, num_key_value_heads=raw["n_head"],
                attention_scales=_attention_scales(raw, raw["n_embd"] // raw["n_head"]))


# Llama's rules, plus the learned positions and the LayerNorm biases (replicated).
PARTITION_RULES = (*llama.PARTITION_RULES, (r"pos_embed$", (None, "embed")),
                   (r"norm_bias$", ("embed",)))
GPT2 = dataclasses.replace(llama.LLAMA, forward=forward, param_specs=param_specs,
                           partition_rules=PARTITION_RULES, rotary=no_rope,
                           parse_config=parse_gpt2, normalize_config=normalize_gpt2)
