"""Architecture name (`architectures[0]` of config.json) -> its `ModelSpec`.

Open to users: `register_model("MyForCausalLM", spec)` adds an architecture without touching
pjinfer's source. The built-in specs are named by module path and imported on first use (as
vLLM's registry does): the model modules import pjinfer.config, and pjinfer.config asks this
registry how to parse a config.json, so importing them here eagerly would close a circle.
"""

from __future__ import annotations

from importlib import import_module

from pjinfer.models.spec import ModelSpec

_BUILTIN: dict[str, str] = {  # architecture -> "module:attribute" of its ModelSpec
    "LlamaForCausalLM": "pjinfer.models.llama:LLAMA",
    "MistralForCausalLM": "pjinfer.models.llama:LLAMA",
    "Qwen2ForCausalLM": "pjinfer.models.llama:QWEN2",
    "Qwen3ForCausalLM": "pjinfer.models.llama:QWEN3",
}
_REGISTRY: dict[str, ModelSpec] = {}


def register_model(architecture: str, spec: ModelSpec, *, overwrite: bool = False) -> None:
    """Make `architecture` loadable; refuses to shadow an existing entry unless `overwrite`."""
    if architecture in supported_architectures() and not overwrite:
        raise ValueError(f"architecture {architecture!r} is already registered; "
                         "pass overwrite=True to replace it")
    _REGISTRY[architecture] = spec


def supported_architectures() -> list[str]:
    return sorted({*_REGISTRY, *_BUILTIN})


def get_model_spec(architecture: str) -> ModelSpec:
    if architecture not in _REGISTRY and architecture in _BUILTIN:
        module, attribute = _BUILTIN[architecture].split(":")
        _REGISTRY[architecture] = getattr(import_module(module), attribute)
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())} (or add one with "
            "pjinfer.models.registry.register_model)") from None

