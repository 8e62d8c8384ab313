"""pjinfer: LLM inference and serving on JAX/XLA with paged attention.

The public names load lazily so `import pjinfer` (and `pjinfer --version`) stays cheap.
"""

from importlib import import_module

from pjinfer.source_tree import unshadow_hub_kernels

__version__ = "0.1.0"
unshadow_hub_kernels()

_EXPORTS = {
    "LLM": "pjinfer.llm",
    "generate": "pjinfer.llm",
    "SamplingParams": "pjinfer.sampling_params",
    "StructuredOutputsParams": "pjinfer.sampling_params",
    "RequestOutputKind": "pjinfer.sampling_params",
    "RequestOutput": "pjinfer.outputs",
    "CompletionOutput": "pjinfer.outputs",
    "BeamSearchParams": "pjinfer.beam_search",
    "BeamSearchOutput": "pjinfer.beam_search",
    "LoRARequest": "pjinfer.lora.request",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pjinfer' has no attribute {name!r}")
