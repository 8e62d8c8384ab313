"""Architecture name (`architectures[0]` of config.json) -> its `ModelSpec`.

Open to users: `register_model("MyForCausalLM", spec)` adds an architecture without touching
pjinfer's source. The built-in specs are named by module path and imported on first use (as
vLLM's registry does): the model modules import pjinfer.config, and pjinfer.config asks this
registry how to parse a config.json, so importing them here eagerly would close a circle.
"""

from __future__ import annotations

from importlib import import_module

from pjinfer.models.spec import ModelSpec
from pjinfer.registry import Registry

_BUILTIN: dict[str, str] = {  # architecture -> "module:attribute" of its ModelSpec
    "LlamaForCausalLM": "pjinfer.models.llama:LLAMA",
    "MistralForCausalLM": "pjinfer.models.llama:LLAMA",
    "Qwen2ForCausalLM": "pjinfer.models.llama:QWEN2",
    "Qwen3ForCausalLM": "pjinfer.models.llama:QWEN3",
    "GPT2LMHeadModel": "pjinfer.models.gpt2:GPT2",
    "Phi3ForCausalLM": "pjinfer.models.phi3:PHI3",
    "MixtralForCausalLM": "pjinfer.models.moe_models:MIXTRAL",
    "Qwen2MoeForCausalLM": "pjinfer.models.moe_models:QWEN2_MOE",
    "Qwen3MoeForCausalLM": "pjinfer.models.moe_models:QWEN3_MOE",
}
_REGISTRY: Registry[ModelSpec] = Registry("architecture",
                                          "pjinfer.models.registry.register_model", {})


def register_model(architecture: str, spec: ModelSpec, *, overwrite: bool = False) -> None:
    """Make `architecture` loadable; refuses to shadow an existing entry unless `overwrite`."""
    _load_builtin(architecture)
    _REGISTRY.register(architecture, spec, overwrite=overwrite)


def supported_architectures() -> list[str]:
    return sorted({*_REGISTRY.names(), *_BUILTIN})


def get_model_spec(architecture: str) -> ModelSpec:
    _load_builtin(architecture)
    if architecture not in _REGISTRY:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())} (or add one with "
            f"{_REGISTRY.how_to_add})")
    return _REGISTRY.get(architecture)


def _load_builtin(architecture: str) -> None:
    """Import a built-in architecture's module the first time it is asked for."""
    if architecture not in _REGISTRY and architecture in _BUILTIN:
        module, attribute = _BUILTIN[architecture].split(":")
        _REGISTRY.register(architecture, getattr(import_module(module), attribute))
