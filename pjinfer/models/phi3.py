"""Phi-3 (`Phi3ForCausalLM`): the Llama decoder with fused checkpoint projections and LongRoPE.

The checkpoint fuses q|k|v into `self_attn.qkv_proj` [(H + 2 KVH) hd, D] and gate|up into
`mlp.gate_up_proj` [2I, D]. They are split at load (each part a view of the memory map), so
the params are Llama's (q_proj, k_proj, v_proj, gate_proj, up_proj) and so are the forward and
the partition rules: a fused column-parallel qkv would put q of one device next to k of another.

LongRoPE (`rope_scaling` type longrope, or its old name su) and `partial_rotary_factor` are
parsed generically (pjinfer.config) and applied by `layers.rope`: the short factors serve
engines whose max_model_len <= original_max_position_embeddings, the long factors longer ones
(transformers switches per forward on the current length, which a paged cache cannot do: keys
already stored keep their rotation; vLLM chooses once the same way). cos and sin are scaled by
sqrt(1 + ln(factor) / ln(original)) in both cases, as in transformers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pjinfer.config import ModelConfig
from pjinfer.models import llama
from pjinfer.models.spec import ParamSpec, part, transpose

PHI3_ORIGINAL_MAX = 4096  # transformers' Phi3Config default for original_max_position_embeddings


def _fused_parts(cfg: ModelConfig, i: int) -> dict[str, tuple[str, int, int]]:
    """Param name -> (checkpoint tensor, first and last column after the transpose)."""
    q, kv, m = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                cfg.intermediate_size)
    qkv, gate_up = f"model.layers.{i}.self_attn.qkv_proj.weight", \
        f"model.layers.{i}.mlp.gate_up_proj.weight"
    return {"q_proj": (qkv, 0, q), "k_proj": (qkv, q, q + kv), "v_proj": (qkv, q + kv, q + 2 * kv),
            "gate_proj": (gate_up, 0, m), "up_proj": (gate_up, m, 2 * m)}


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Llama's params, the fused ones read as column slices of qkv_proj and gate_up_proj."""
    parts = {i: _fused_parts(cfg, i) for i in range(cfg.num_hidden_layers)}
    out = []
    for p in llama.param_specs(cfg):
        fused = parts[p.path[1]].get(p.path[-1]) if p.path[0] == "layers" else None
        if fused is not None:
            name, start, stop = fused
            p = dataclasses.replace(p, hf_names=(name,),
                                    transform=part(start, stop, pre=transpose))
        out.append(p)
    return out


def normalize_phi3(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers' Phi3Config always has a top-level original_max_position_embeddings
    (default 4096) and it wins over the rope dict's; make that explicit for the generic parse."""
    return {"original_max_position_embeddings": PHI3_ORIGINAL_MAX, **raw}


def parse_phi3(raw: dict[str, Any]) -> dict[str, Any]:
    """No biases; `sliding_window` (when set) applies to every layer, as in transformers, which
    also allows no rope scaling but LongRoPE (pjinfer.config maps `su` to longrope)."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "longrope", "su"):
        raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not supported for "
                         "Phi-3; it uses longrope (or su) or none")
    return {**llama.parse_llama(raw), "mlp_bias": False, "qkv_bias": False, "o_bias": False}


PHI3 = dataclasses.replace(llama.LLAMA, param_specs=param_specs, parse_config=parse_phi3,
                           normalize_config=normalize_phi3)
