"""Engine arguments, with vLLM's names, validated once where they enter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pjinfer.config import DTYPES
from pjinfer.weights import LOAD_FORMATS

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes an engine; `EngineConfig.from_kwargs` rejects unknown names."""

    model: str | None = None  # local HF folder; None = the embedded demo model
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # fixes the cache size (any device)
    kv_cache_memory: int | None = None  # bytes for the KV cache (CPU default: 256 MiB)
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 4096  # past this, add_request raises EngineOverloadedError
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    max_logprobs: int = 20
    attention_backend: str = "auto"
    # Schedule and build step t+1 while step t runs on the device (its sampled tokens are fed
    # on device); False runs every step to completion before the next is scheduled.
    async_scheduling: bool = True
    warmup: bool = True  # compile every step shape at start-up
    compilation_cache_dir: str | None = None  # JAX persistent compilation cache

    def __post_init__(self) -> None:
        _positive_ints(self, "block_size", "max_num_seqs", "max_num_batched_tokens",
                       "tensor_parallel_size", "max_waiting_requests")
        _positive_ints(self, *(n for n in ("max_model_len", "num_kv_blocks", "kv_cache_memory")
                               if getattr(self, n) is not None))
        _bools(self, "enable_prefix_caching", "enable_chunked_prefill", "async_scheduling",
               "warmup")
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, "
                             f"got {self.dtype!r}")
        _choice("load_format", self.load_format, LOAD_FORMATS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.max_num_batched_tokens < self.max_num_seqs and not self.enable_chunked_prefill:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"model: {self.model!r} is not a local folder; pjinfer loads "
                             "Hugging Face model folders from disk (nothing is downloaded)")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but an unknown argument names the valid ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(known))}")
        return cls(**kwargs)


def _positive_ints(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _bools(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(cfg, name)!r}")


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(options)}, got {value!r}")
