"""The engine-argument table: every engine argument, once, with vLLM's name, help and TOML place.

Each EngineConfig field is declared with `arg(...)`, which records its help text, its TOML
section (and key, where it is not the field name) and its choices; its flag is `--field-name`.
The `pjinfer serve|generate|bench` flags (pjinfer.engine_flags) and the TOML run-config keys
(pjinfer.run_config) are generated from ENGINE_ARGS, so a new engine argument is added here and
nowhere else. This module stays free of JAX: `pjinfer --help` imports it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pjinfer.config import DTYPES
from pjinfer.engine.scheduling_policy import scheduling_policies
from pjinfer.kernels.backends import BACKENDS
from pjinfer.quantization.config import QUANTIZATION_NAMES

# auto = orbax when the folder holds a `pjinfer convert` checkpoint, else safetensors
LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
SECTIONS = ("model", "parallel", "cache", "scheduler", "compilation")  # TOML tables
INT_LIST = tuple[int, ...]  # the type of a list-valued argument (a flag of several integers)


def arg(default: Any, help: str, section: str, *, key: str | None = None,
        choices: tuple[str, ...] | None = None) -> Any:
    """An EngineConfig field that also carries what its flag and its TOML key need."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {', '.join(SECTIONS)}, got {section!r}")
    return dataclasses.field(default=default, metadata={
        "help": help, "section": section, "key": key, "choices": choices})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that shapes an engine; `EngineConfig.from_kwargs` rejects unknown names."""

    model: str | None = arg(None, "local Hugging Face model folder (default: the embedded "
                            "demo model)", "model", key="path")
    tokenizer: str | None = arg(None, "tokenizer folder (default: the model folder)", "model")
    hf_config_path: str | None = arg(None, "folder whose config.json describes the model "
                                     "(default: the model folder's, or a GGUF file's metadata): "
                                     "e.g. the original model's for a GGUF file", "model")
    served_model_name: str | None = arg(None, "model name clients send (default: the model "
                                        "folder's name)", "model")
    dtype: str = arg("auto", "weight and activation dtype; auto = the checkpoint's", "model",
                     choices=("auto", *DTYPES))
    load_format: str = arg("auto", "dummy = random weights (config.json alone is enough); auto "
                           "= orbax for a `pjinfer convert` folder, else safetensors", "model",
                           choices=LOAD_FORMATS)
    quantization: str | None = arg(None, "weight quantization: default = the checkpoint's "
                                   "(config.json quantization_config); fp8 or int8 quantize a "
                                   "float checkpoint at load", "model",
                                   choices=QUANTIZATION_NAMES)
    seed: int = arg(0, "seed of the engine's random state", "model")
    max_model_len: int | None = arg(None, "longest prompt + completion, in tokens (default: the "
                                    "model's max_position_embeddings)", "model")
    block_size: int = arg(16, "tokens per KV cache block, a power of two <= 256", "cache")
    max_num_seqs: int = arg(256, "most sequences in one step", "scheduler")
    max_num_batched_tokens: int = arg(2048, "token budget of one step", "scheduler")
    gpu_memory_utilization: float = arg(0.9, "fraction of accelerator memory pjinfer may use, "
                                        "in (0, 1]", "cache")
    num_kv_blocks: int | None = arg(None, "fix the KV cache size in blocks, on any device",
                                    "cache")
    kv_cache_memory: int | None = arg(None, "bytes for the KV cache (default: what "
                                      "--gpu-memory-utilization leaves; 256 MiB on CPU)", "cache")
    kv_cache_dtype: str = arg("auto", "KV cache dtype: auto = the model dtype; fp8 (e4m3) "
                              "holds twice the tokens; fp8_e5m2 too, float16's range, "
                              "coarser", "cache", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = arg(False, "reuse KV blocks of shared prompt prefixes",
                                      "cache")
    enable_chunked_prefill: bool = arg(True, "split long prompts over steps", "scheduler")
    tensor_parallel_size: int = arg(1, "devices each replica spans", "parallel")
    enable_expert_parallel: bool = arg(False, "MoE models: place whole experts on the tensor-"
                                       "parallel devices (one all-reduce per MoE layer) "
                                       "instead of splitting each expert", "parallel")
    scheduling_policy: str = arg("fcfs", "order of the waiting queue (and, reversed, of "
                                 "preemption): fcfs, priority (lower value first) or sjf "
                                 "(shortest prompt first, with aging); plugins add more",
                                 "scheduler")
    max_waiting_requests: int = arg(4096, "queue length past which new requests are "
                                    "refused with HTTP 503", "scheduler")
    request_timeout: float | None = arg(None, "seconds a request may live from arrival "
                                        "(default: no limit)", "scheduler")
    enable_lora: bool = arg(False, "serve LoRA adapters: requests pick one (lora_request, or "
                            "its name as the API's model)", "model")
    max_loras: int = arg(1, "most distinct LoRA adapters in one step (their device slots)",
                         "model")
    max_lora_rank: int = arg(16, "largest LoRA rank r an adapter may have", "model")
    max_cpu_loras: int | None = arg(None, "LoRA adapters kept loaded in host memory (default: "
                                    "max_loras)", "model")
    max_logprobs: int = arg(20, "largest logprobs/top_logprobs a request may ask", "model")
    attention_backend: str = arg("auto", "attention kernels: auto = Pallas on GPU, pure JAX "
                                 "(reference) elsewhere", "compilation", choices=BACKENDS)
    num_scheduler_steps: int = arg(1, "decode steps per device call when every scheduled "
                                   "sequence is decoding (vLLM's multi-step scheduling): one "
                                   "launch and one copy back per N tokens; sequences with "
                                   "penalties or structured outputs run one step at a time",
                                   "scheduler")
    async_scheduling: bool = arg(True, "schedule and build step t+1 while step t runs on the "
                                 "device; off runs every step to completion first", "scheduler")
    cuda_graph_sizes: INT_LIST | None = arg(
        None, "padded batch sizes (sequences a step) that steps are compiled for, vLLM's "
        "CUDA graph sizes: a step runs at the smallest one holding its sequences, so smaller "
        "sizes pad low-concurrency decodes less and compile more executables (default 8, 32, "
        "128, ... up to max_num_seqs, and 2 in front for a dense int4 model on one device; a size "
        "below 2 counts as 2, max_num_seqs is always one; "
        "one value is one size, not vLLM's pattern up to it)", "compilation")
    warmup: bool = arg(True, "compile every step shape at start-up (a model under 64 MiB: "
                       "the smallest ones, the others on first use)", "compilation")
    compilation_cache_dir: str | None = arg(None, "folder of the persistent compilation cache: "
                                            "a restart loads the step executables from it "
                                            "(pjinfer serve|generate default: "
                                            "$XDG_CACHE_HOME/pjinfer or ~/.cache/pjinfer, or "
                                            "$PJINFER_COMPILATION_CACHE_DIR; '' turns it off)",
                                            "compilation")

    def __post_init__(self) -> None:
        _check_types_and_choices(self)
        if self.scheduling_policy not in scheduling_policies():
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(scheduling_policies())}, got {self.scheduling_policy!r}")
        _positive_ints(self, "block_size", "max_num_seqs", "max_num_batched_tokens",
                       "tensor_parallel_size", "max_waiting_requests", "num_scheduler_steps")
        _positive_ints(self, *(n for n in ("max_model_len", "num_kv_blocks", "kv_cache_memory")
                               if getattr(self, n) is not None))
        _positive_ints(self, "max_loras", "max_lora_rank")
        if self.max_cpu_loras is not None and not (
                isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {self.max_cpu_loras!r}")
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            raise ValueError(f"block_size must be a power of two <= 256, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_num_batched_tokens < self.max_num_seqs and not self.enable_chunked_prefill:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if self.model is not None and not Path(self.model).exists():
            raise ValueError(f"model: {self.model!r} is not a local folder; pjinfer loads "
                             "Hugging Face model folders from disk (nothing is downloaded)")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", _sizes(self.cuda_graph_sizes))
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Like the constructor, but an unknown argument names the valid ones."""
        unknown = sorted(set(kwargs) - set(ENGINE_ARGS))
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(ENGINE_ARGS))}")
        return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One row of the table, as the flag and TOML generators read it."""

    name: str  # the EngineConfig field
    type: Any  # str, int, float, bool or INT_LIST; for a field that may be None, the other type
    default: Any
    help: str
    section: str  # TOML table
    key: str  # TOML key
    flag: str  # command-line flag
    choices: tuple[str, ...] | None

    @classmethod
    def of(cls, f: dataclasses.Field, hint: Any) -> EngineArg:
        """The row of field `f`, whose type annotation evaluates to `hint`."""
        meta = f.metadata
        return cls(f.name, _non_none(hint), f.default, meta["help"], meta["section"],
                   meta["key"] or f.name, "--" + f.name.replace("_", "-"), meta["choices"])


def _non_none(hint: Any) -> type:
    """`int | None` -> int: the type a flag parses and a TOML value must have."""
    if isinstance(hint, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not types.NoneType)
    return hint


_HINTS = typing.get_type_hints(EngineConfig)
ENGINE_ARGS: dict[str, EngineArg] = {f.name: EngineArg.of(f, _HINTS[f.name])
                                     for f in dataclasses.fields(EngineConfig)}


def _check_types_and_choices(cfg: EngineConfig) -> None:
    """Every bool is a bool (`async_scheduling='no'` is not true) and every choice is valid."""
    for a in ENGINE_ARGS.values():
        value = getattr(cfg, a.name)
        if a.type is bool and not isinstance(value, bool):
            raise ValueError(f"{a.name} must be true or false, got {value!r}")
        if a.choices is not None and value not in a.choices and value is not None:
            raise ValueError(f"{a.name} must be one of {', '.join(a.choices)}, got {value!r}")


def _sizes(value: Any) -> tuple[int, ...]:
    """cuda_graph_sizes as a sorted tuple of distinct positive integers."""
    if not (isinstance(value, list | tuple) and value and all(map(_is_positive_int, value))):
        raise ValueError(f"cuda_graph_sizes must be a non-empty list of positive integers "
                         f"(e.g. --cuda-graph-sizes 2 8 32), got {value!r}")
    return tuple(sorted(set(value)))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_ints(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not _is_positive_int(value):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
