"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as pure functions over a param pytree.

Params layout (weights input-major, i.e. transposed from HF's [out, in]):
  embed [V, D]; final_norm [D]; lm_head [D, V] (absent when tied)
  layers[i]: input_norm [D]; q_proj [D, H*hd]; k_proj/v_proj [D, KVH*hd]; o_proj [H*hd, D];
             optional q_bias/k_bias/v_bias, o_bias, q_norm/k_norm [hd] (Qwen3);
             post_attn_norm [D]; then the MLP's own params, for `gated_mlp`
             gate_proj/up_proj [D, I]; down_proj [I, D] (+ optional biases)
Layers are a Python list, unrolled under jit: with one cache array per layer XLA updates each in
place, where a `lax.scan` over stacked caches copied them every step (Llama-3-8B on one H200:
11.7 ms/token with the scan, 4.26 ms/token unrolled).

The MLP is an argument (`forward(..., mlp=...)` with its `param_specs(..., mlp_specs=...)`), so a
MoE block or an adapter replaces it without touching the attention path; every matmul with a
weight goes through `layers.linear` (or `layers.linears` for the projections sharing an
input). The end of the module declares the architecture for the
registry: config.json parsing, partition rules, rotary setup, one `ModelSpec` per variant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pjinfer.config import ModelConfig, sliding_window_layers
from pjinfer.kernels.rotary_write import QKTransform
from pjinfer.models.layers import (
    Rope,
    gated_mlp,
    linear,
    linears,
    qk_transform,
    rms_norm_named,
    rope,
    rope_angles,
)
from pjinfer.models.spec import ModelSpec, ParamSpec, transpose

Params = dict[str, Any]
# attention(layer, q [T,H,hd], k [T,KVH,hd], v [T,KVH,hd], qk, cache, metadata)
#   -> (out [T,H,hd], cache); q and k as projected, `qk` (a QKTransform) still to apply
AttentionFn = Callable[..., tuple[jax.Array, Any]]
MlpFn = Callable[[Params, jax.Array], jax.Array]  # (layer params, x [T, D]) -> [T, D]
MlpSpecsFn = Callable[[ModelConfig, int], list[ParamSpec]]  # (cfg, layer) -> its MLP's params
# (params holding the norm's weight [and bias], its name, x [T, D], eps) -> [T, D]
NormFn = Callable[[Params, str, jax.Array, float], jax.Array]
Angles = tuple[jax.Array, jax.Array]  # RoPE cos and sin [T, R/2] (`layers.rope_angles`)


def _project_qkv(lp: Params, cfg: ModelConfig, h: jax.Array,
                 angles: Angles | None) -> tuple[jax.Array, jax.Array, jax.Array, QKTransform]:
    """q [T, H, hd], k and v [T, KVH, hd] as projected, and what still turns q and k into
    attention's (Qwen3's per-head norm, RoPE): the attention function applies it, so a paged
    backend can do that and the cache write in one kernel."""
    t, hd = h.shape[0], cfg.head_dim
    q, k, v = (y.reshape(t, -1, hd) for y in linears(
        h, [lp["q_proj"], lp["k_proj"], lp["v_proj"]],
        [lp.get("q_bias"), lp.get("k_bias"), lp.get("v_bias")]))
    norms = (lp["q_norm"], lp["k_norm"]) if cfg.qk_norm else (None, None)
    return q, k, v, qk_transform(angles, *norms, cfg.rms_norm_eps)


def decoder_layer(lp: Params, cfg: ModelConfig, x: jax.Array, angles: Angles | None,
                  attend: Callable, mlp: MlpFn = gated_mlp,
                  norm: NormFn = rms_norm_named) -> tuple[jax.Array, Any]:
    """One pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). x [T, D]; `angles`: the
    step's RoPE cos and sin (`layers.rope_angles`), None without RoPE."""
    h = norm(lp, "input_norm", x, cfg.rms_norm_eps)
    out, cache = attend(*_project_qkv(lp, cfg, h, angles))
    x = x + linear(out.reshape(x.shape[0], -1), lp["o_proj"], lp.get("o_bias"))
    x = x + mlp(lp, norm(lp, "post_attn_norm", x, cfg.rms_norm_eps))
    return x, cache


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            kv_caches: list, metadata: Any, *, attention: AttentionFn, rotary: Rope | None,
            mlp: MlpFn = gated_mlp, norm: NormFn = rms_norm_named) -> tuple[jax.Array, list]:
    """Hidden states [T, D] of a flat (ragged) batch of tokens, and the updated per-layer caches.

    `attention` decides how keys are stored and read (paged cache, or dense for the oracle);
    `rotary` is what `rotary()` returns (None: no rope, the params' learned `pos_embed` [P, D]
    is added to the token embeddings instead); `mlp` and `norm` are the block's pieces.
    """
    x = params["embed"][token_ids]  # [T, D]
    if "pos_embed" in params:
        x = x + params["pos_embed"][positions]
    angles = None if rotary is None else rope_angles(rotary, positions)
    new_caches = []
    for i, lp in enumerate(params["layers"]):
        def attend(q, k, v, qk, i=i):
            return attention(i, q, k, v, qk, kv_caches[i], metadata)
        x, cache = decoder_layer(lp, cfg, x, angles, attend, mlp, norm)
        new_caches.append(cache)
    return norm(params, "final_norm", x, cfg.rms_norm_eps), new_caches


def compute_logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Logits [N, V] in float32 from hidden states [N, D]; tied models reuse the embedding."""
    head = params.get("lm_head")  # [D, V]
    if head is None:
        head = params["embed"].T  # [V, D] -> [D, V]
    return linear(hidden, head, out_dtype=jnp.float32)


# ---- parameters -----------------------------------------------------------------------------
def _layer_param(i: int, name: str, shape: tuple[int, ...], hf_name: str) -> ParamSpec:
    """A param of layer i: `*_proj` are HF Linear weights (transposed to input-major); the
    dummy loader draws norms as ones and biases as zeros."""
    path, names = ("layers", i, name), (f"model.layers.{i}.{hf_name}",)
    if name.endswith("_proj"):
        return ParamSpec(path, shape, hf_names=names, transform=transpose)
    return ParamSpec(path, shape, hf_names=names, init="ones" if "norm" in name else "zeros")


def _attention_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """Both norms of the block and the attention projections of layer i."""
    d, hd = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    table = [("input_norm", (d,), "input_layernorm.weight"),
             ("q_proj", (d, qd), "self_attn.q_proj.weight"),
             ("k_proj", (d, kvd), "self_attn.k_proj.weight"),
             ("v_proj", (d, kvd), "self_attn.v_proj.weight"),
             ("o_proj", (qd, d), "self_attn.o_proj.weight"),
             ("post_attn_norm", (d,), "post_attention_layernorm.weight")]
    if cfg.qkv_bias:
        table += [(f"{p}_bias", (n,), f"self_attn.{p}_proj.bias")
                  for p, n in (("q", qd), ("k", kvd), ("v", kvd))]
    if cfg.o_bias:
        table.append(("o_bias", (d,), "self_attn.o_proj.bias"))
    if cfg.qk_norm:
        table += [(f"{p}_norm", (hd,), f"self_attn.{p}_norm.weight") for p in ("q", "k")]
    return [_layer_param(i, *row) for row in table]


def gated_mlp_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """The params `gated_mlp` reads in layer i."""
    d, m = cfg.hidden_size, cfg.intermediate_size
    table = [("gate_proj", (d, m), "mlp.gate_proj.weight"),
             ("up_proj", (d, m), "mlp.up_proj.weight"),
             ("down_proj", (m, d), "mlp.down_proj.weight")]
    if cfg.mlp_bias:
        table += [("gate_bias", (m,), "mlp.gate_proj.bias"), ("up_bias", (m,), "mlp.up_proj.bias"),
                  ("down_bias", (d,), "mlp.down_proj.bias")]
    return [_layer_param(i, *row) for row in table]


def param_specs(cfg: ModelConfig, *, mlp_specs: MlpSpecsFn = gated_mlp_specs) -> list[ParamSpec]:
    """Every parameter, with its HF checkpoint tensor: the contract the loader fills."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [ParamSpec(("embed",), (v, d), hf_names=("model.embed_tokens.weight",),
                       init_scale=0.02),
             ParamSpec(("final_norm",), (d,), hf_names=("model.norm.weight",), init="ones")]
    if not cfg.tie_word_embeddings:
        specs.append(ParamSpec(("lm_head",), (d, v), hf_names=("lm_head.weight",),
                               transform=transpose))
    for i in range(cfg.num_hidden_layers):
        specs += _attention_specs(cfg, i) + mlp_specs(cfg, i)
    return specs


# ---- the architecture, for the registry --------------------------------------------------------
# Param path pattern -> logical axis of each dim (Megatron: q/k/v/gate/up column-parallel,
# o/down row-parallel, vocab-parallel embedding and head, norms replicated, biases follow).
PARTITION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed$", ("vocab", "embed")),
    (r"lm_head$", ("embed", "vocab")),
    (r"(final_norm|input_norm|post_attn_norm)$", ("embed",)),
    (r"q_proj$", ("embed", "heads")),
    (r"[kv]_proj$", ("embed", "kv_heads")),
    (r"o_proj$", ("heads", "embed")),
    (r"q_bias$", ("heads",)),
    (r"[kv]_bias$", ("kv_heads",)),
    (r"[qk]_norm$", ("head_dim",)),
    (r"(gate|up)_proj$", ("embed", "mlp")),
    (r"down_proj$", ("mlp", "embed")),
    (r"(gate|up)_bias$", ("mlp",)),
    (r"(o|down)_bias$", ("embed",)),
)


def parse_llama(raw: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: `attention_bias` on q/k/v and o; every layer slides when
    `sliding_window` is set (unless `layer_types` says otherwise)."""
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported; "
                         "Llama-family models use 'silu'")
    bias = bool(raw.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_windows=sliding_window_layers(raw, raw.get("layer_types")))


def _qwen_windows(raw: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen slides only with `use_sliding_window`, then layers >= `max_window_layers`."""
    if not raw.get("use_sliding_window", False):
        return ()
    layer_types = raw.get("layer_types")
    if layer_types is None:
        n = raw["num_hidden_layers"]
        start = raw.get("max_window_layers", n)
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    return sliding_window_layers(raw, layer_types)


def parse_qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen2: biases on q/k/v always, never on o."""
    return {**parse_llama(raw), "qkv_bias": True, "o_bias": False,
            "sliding_windows": _qwen_windows(raw)}


def parse_qwen3(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: per-head RMSNorm on q and k."""
    return {**parse_llama(raw), "qk_norm": True, "sliding_windows": _qwen_windows(raw)}


LLAMA = ModelSpec(forward=forward, compute_logits=compute_logits, param_specs=param_specs,
                  partition_rules=PARTITION_RULES, rotary=rope, parse_config=parse_llama)
QWEN2 = dataclasses.replace(LLAMA, parse_config=parse_qwen2)
QWEN3 = dataclasses.replace(LLAMA, parse_config=parse_qwen3)
