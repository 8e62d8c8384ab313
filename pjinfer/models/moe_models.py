"""Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama decoder with `moe.moe_block` as its MLP.

Attention is Llama's (Qwen2-MoE: q/k/v biases per `qkv_bias`; Qwen3-MoE: q/k norms), so are the
norms, rotary setup and attention partition rules. config.json, as transformers reads it:
  Mixtral   num_local_experts, num_experts_per_tok, intermediate_size (per expert); the top-k
            probabilities are always renormalised; every layer is sparse.
  Qwen*-MoE num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob (default
            false in both), decoder_sparse_step (layer i is sparse when (i + 1) % step == 0),
            mlp_only_layers (dense, with intermediate_size); Qwen2-MoE adds a shared expert
            (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate(x)).
The experts' fields have no defaults here: a checkpoint without them is not one of these.

Checkpoints: the Hub's per-expert tensors (`block_sparse_moe.experts.{e}.w1/w3/w2`,
`mlp.experts.{e}.gate_proj/up_proj/down_proj`) are stacked into [E, ...] at load; the fused
3-D `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I] that transformers 5 holds in
memory (and some 5.x versions saved), always under `mlp.` (Mixtral's router too: `mlp.gate`),
are read when the per-expert names are absent.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from pjinfer.config import ModelConfig
from pjinfer.models import llama
from pjinfer.models.moe import MoeConfig, moe_or_dense_mlp, real_tokens
from pjinfer.models.spec import ParamSpec, transpose

# Expert weights: E on the "experts" axis (tp under expert parallelism), I on "expert_mlp"
# (tp otherwise); the router and the shared expert's gate are replicated.
MOE_PARTITION_RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"experts_gate_up$", ("experts", "embed", None, "expert_mlp")),
    (r"experts_down$", ("experts", "expert_mlp", "embed")),
    (r"(router|shared_expert_gate)$", ("embed", None)),
    *llama.PARTITION_RULES,
)


def moe_config(cfg: ModelConfig) -> MoeConfig:
    return cfg.option("moe")


def forward(params, cfg: ModelConfig, token_ids, positions, kv_caches, metadata, *, attention,
            rotary):
    """Llama's forward with each layer's MLP chosen by its params (see `moe_or_dense_mlp`)."""
    mlp = partial(moe_or_dense_mlp, moe=moe_config(cfg),
                  valid=real_tokens(metadata, token_ids.shape[0]),
                  expert_parallel=bool(cfg.option("expert_parallel", False)))
    return llama.forward(params, cfg, token_ids, positions, kv_caches, metadata,
                         attention=attention, rotary=rotary, mlp=mlp)


# ---- checkpoint layouts ----------------------------------------------------------------------
def _gate_up_per_expert(*tensors: np.ndarray) -> np.ndarray:
    """(gate_0, up_0, gate_1, up_1, ...) HF [I, D] each -> [E, D, 2, I]."""
    pairs = zip(tensors[0::2], tensors[1::2], strict=True)
    return np.stack([np.stack([g.T, u.T], axis=1) for g, u in pairs])


def _down_per_expert(*tensors: np.ndarray) -> np.ndarray:
    """down_0, down_1, ... HF [D, I] each -> [E, I, D]."""
    return np.stack([t.T for t in tensors])


def _gate_up_fused(w: np.ndarray) -> np.ndarray:
    """transformers 5's experts.gate_up_proj [E, 2I, D] (gate rows first) -> [E, D, 2, I]."""
    e, two_i, d = w.shape
    return w.reshape(e, 2, two_i // 2, d).transpose(0, 3, 1, 2)


def _down_fused(w: np.ndarray) -> np.ndarray:
    """transformers 5's experts.down_proj [E, D, I] -> [E, I, D]."""
    return w.transpose(0, 2, 1)


@dataclasses.dataclass(frozen=True)
class ExpertNames:
    """Where one architecture's checkpoint keeps a MoE layer (relative to model.layers.{i})."""

    block: str  # "block_sparse_moe" (Mixtral) or "mlp" (Qwen)
    gate: str  # per-expert projection names: w1/w3/w2 or gate_proj/up_proj/down_proj
    up: str
    down: str


MIXTRAL_NAMES = ExpertNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_NAMES = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj")


def _expert_specs(cfg: ModelConfig, i: int, names: ExpertNames) -> list[ParamSpec]:
    moe, d = moe_config(cfg), cfg.hidden_size
    e, inter = moe.num_experts, moe.intermediate_size
    block, fused = f"model.layers.{i}.{names.block}", f"model.layers.{i}.mlp"
    per = [f"{block}.experts.{x}" for x in range(e)]
    gate_up = tuple(n for p in per for n in (f"{p}.{names.gate}.weight", f"{p}.{names.up}.weight"))
    return [
        ParamSpec(("layers", i, "router"), (d, e), hf_names=(f"{block}.gate.weight",),
                  transform=transpose, fallback=((f"{fused}.gate.weight",), transpose)),
        ParamSpec(("layers", i, "experts_gate_up"), (e, d, 2, inter), hf_names=gate_up,
                  transform=_gate_up_per_expert, init_scale=d ** -0.5,
                  fallback=((f"{fused}.experts.gate_up_proj",), _gate_up_fused)),
        ParamSpec(("layers", i, "experts_down"), (e, inter, d),
                  hf_names=tuple(f"{p}.{names.down}.weight" for p in per),
                  transform=_down_per_expert, init_scale=inter ** -0.5,
                  fallback=((f"{fused}.experts.down_proj",), _down_fused)),
    ]


def _shared_expert_specs(cfg: ModelConfig, i: int) -> list[ParamSpec]:
    """Qwen2-MoE's shared expert: a SwiGLU MLP under `shared_expert`, and its gate."""
    d, m = cfg.hidden_size, moe_config(cfg).shared_expert_intermediate_size
    prefix = f"model.layers.{i}.mlp.shared_expert"
    specs = [ParamSpec(("layers", i, "shared_expert", name), shape,
                       hf_names=(f"{prefix}.{name}.weight",), transform=transpose)
             for name, shape in (("gate_proj", (d, m)), ("up_proj", (d, m)),
                                 ("down_proj", (m, d)))]
    return specs + [ParamSpec(("layers", i, "shared_expert_gate"), (d, 1),
                              hf_names=(f"{prefix}_gate.weight",), transform=transpose)]


def _mlp_specs(cfg: ModelConfig, i: int, *, names: ExpertNames) -> list[ParamSpec]:
    moe = moe_config(cfg)
    if not moe.sparse_layers[i]:
        return llama.gated_mlp_specs(cfg, i)
    specs = _expert_specs(cfg, i, names)
    return specs + (_shared_expert_specs(cfg, i) if moe.shared_expert_intermediate_size else [])


def param_specs(cfg: ModelConfig, *, names: ExpertNames) -> list[ParamSpec]:
    return llama.param_specs(cfg, mlp_specs=partial(_mlp_specs, names=names))


# ---- config.json ------------------------------------------------------------------------------
def _require(raw: dict[str, Any], arch: str, *fields: str) -> None:
    missing = [f for f in fields if raw.get(f) is None]
    if missing:
        raise ValueError(f"config.json: {arch} needs {', '.join(missing)} (the experts' shape "
                         "and routing); add the field(s) from the model's original config")


def _with_num_experts(raw: dict[str, Any]) -> dict[str, Any]:
    """Mixtral and Qwen3-MoE configs map num_experts <-> num_local_experts (transformers 5
    saves Qwen3-MoE's as num_local_experts); both spellings mean the same."""
    n = raw.get("num_experts", raw.get("num_local_experts"))
    return {**raw, "num_experts": n, "num_local_experts": n}


def _qwen_sparse_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """transformers' rule: layer i is sparse unless in mlp_only_layers, when
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple(i not in dense and raw["num_experts"] > 0 and (i + 1) % step == 0
                 for i in range(raw["num_hidden_layers"]))


def parse_mixtral(raw: dict[str, Any]) -> dict[str, Any]:
    raw = _with_num_experts(raw)
    _require(raw, "MixtralForCausalLM", "num_local_experts", "num_experts_per_tok")
    moe = MoeConfig(num_experts=raw["num_local_experts"], top_k=raw["num_experts_per_tok"],
                    intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                    sparse_layers=(True,) * raw["num_hidden_layers"])
    return {**llama.parse_llama(raw), "qkv_bias": False, "o_bias": False, "mlp_bias": False,
            "options": (("moe", moe),)}


def _qwen_moe(raw: dict[str, Any], shared: int) -> MoeConfig:
    return MoeConfig(num_experts=raw["num_experts"], top_k=raw["num_experts_per_tok"],
                     intermediate_size=raw["moe_intermediate_size"],
                     norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                     sparse_layers=_qwen_sparse_layers(raw),
                     shared_expert_intermediate_size=shared)


def parse_qwen2_moe(raw: dict[str, Any]) -> dict[str, Any]:
    _require(raw, "Qwen2MoeForCausalLM", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size")
    moe = _qwen_moe(raw, raw["shared_expert_intermediate_size"])
    return {**llama.parse_qwen2(raw), "qkv_bias": bool(raw.get("qkv_bias", True)),
            "mlp_bias": False, "options": (("moe", moe),)}


def parse_qwen3_moe(raw: dict[str, Any]) -> dict[str, Any]:
    raw = _with_num_experts(raw)
    _require(raw, "Qwen3MoeForCausalLM", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size")
    return {**llama.parse_qwen3(raw), "mlp_bias": False,
            "options": (("moe", _qwen_moe(raw, 0)),)}


_BASE = dataclasses.replace(llama.LLAMA, forward=forward, partition_rules=MOE_PARTITION_RULES)
MIXTRAL = dataclasses.replace(_BASE, param_specs=partial(param_specs, names=MIXTRAL_NAMES),
                              parse_config=parse_mixtral)
QWEN2_MOE = dataclasses.replace(_BASE, param_specs=partial(param_specs, names=QWEN_NAMES),
                                parse_config=parse_qwen2_moe)
QWEN3_MOE = dataclasses.replace(_BASE, param_specs=partial(param_specs, names=QWEN_NAMES),
                                parse_config=parse_qwen3_moe)
