"""Architecture name (`architectures[0]` of config.json) -> model implementation.

Open to users: `register_model("MyForCausalLM", spec)` adds an architecture without touching
pjinfer's source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pjinfer.models import llama


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The pure functions that make up one architecture."""

    forward: Callable  # (params, cfg, token_ids, positions, kv_caches, md, *, attention, inv_freq)
    compute_logits: Callable  # (params, hidden [N, D]) -> [N, V] float32
    param_shapes: Callable  # (cfg) -> pytree of shape tuples
    hf_weight_names: Callable  # (cfg) -> [(param path, hf tensor name, transpose)]


_LLAMA_FAMILY = ModelSpec(forward=llama.forward, compute_logits=llama.compute_logits,
                          param_shapes=llama.param_shapes, hf_weight_names=llama.hf_weight_names)

_REGISTRY: dict[str, ModelSpec] = {
    "LlamaForCausalLM": _LLAMA_FAMILY,
    "MistralForCausalLM": _LLAMA_FAMILY,
    "Qwen2ForCausalLM": _LLAMA_FAMILY,
    "Qwen3ForCausalLM": _LLAMA_FAMILY,
}


def register_model(architecture: str, spec: ModelSpec, *, overwrite: bool = False) -> None:
    """Make `architecture` loadable; refuses to shadow an existing entry unless `overwrite`."""
    if architecture in _REGISTRY and not overwrite:
        raise ValueError(f"architecture {architecture!r} is already registered; "
                         "pass overwrite=True to replace it")
    _REGISTRY[architecture] = spec


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(architecture: str) -> ModelSpec:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())} (or add one with "
            "pjinfer.models.registry.register_model)") from None
