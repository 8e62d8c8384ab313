"""Engine arguments on the benchmark command line, with vLLM's names, passed to `pjinfer.LLM`.

Only the flags given on the command line are passed, so the engine's (or a `--config` TOML's)
defaults stay in force and the JSON records exactly what the user chose.
"""

from __future__ import annotations

import argparse
from typing import Any

from pjinfer.benchmarks.synthetic_tokenizer import has_tokenizer, synthetic_tokenizer_dir

# flag name -> (type, help); bool flags are store_true.
_ENGINE_FLAGS: dict[str, tuple[Any, str]] = {
    "model": (str, "local Hugging Face model folder (default: the demo model)"),
    "tokenizer": (str, "tokenizer folder (default: the model's, else a synthetic one)"),
    "load-format": (str, "auto | safetensors | dummy (random weights)"),
    "dtype": (str, "auto | bfloat16 | float16 | float32"),
    "seed": (int, "engine seed"),
    "max-model-len": (int, "context limit"),
    "block-size": (int, "KV cache block size (tokens)"),
    "max-num-seqs": (int, "most sequences in one step"),
    "max-num-batched-tokens": (int, "token budget of one step"),
    "gpu-memory-utilization": (float, "fraction of device memory the engine may use"),
    "num-kv-blocks": (int, "fix the KV cache size in blocks"),
    "kv-cache-memory": (int, "bytes for the KV cache"),
    "tensor-parallel-size": (int, "devices to shard the model over"),
    "attention-backend": (str, "attention implementation (auto, ...)"),
    "scheduling-policy": (str, "fcfs | priority"),
    "compilation-cache-dir": (str, "JAX persistent compilation cache folder"),
    "enable-prefix-caching": (bool, "reuse KV blocks of shared prompt prefixes"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine (vLLM names)")
    for flag, (kind, text) in _ENGINE_FLAGS.items():
        if kind is bool:
            group.add_argument(f"--{flag}", action="store_true", default=None, help=text)
        else:
            group.add_argument(f"--{flag}", type=kind, default=None, help=text)
    group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", default=None, help="prefill prompts whole")
    group.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                       default=None, help="finish every step before scheduling the next")
    group.add_argument("--config", default=None, help="TOML run config (flags override it)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set; a config-only model folder gets a synthetic tokenizer."""
    names = [f.replace("-", "_") for f in _ENGINE_FLAGS] + ["enable_chunked_prefill",
                                                             "async_scheduling"]
    kwargs = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    if kwargs.get("model") and not kwargs.get("tokenizer") and not has_tokenizer(kwargs["model"]):
        kwargs["tokenizer"] = str(synthetic_tokenizer_dir(_vocab_size(kwargs["model"])))
    return kwargs


def _vocab_size(model_dir: str) -> int:
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SystemExit(f"--model {model_dir}: no config.json there; pass a Hugging Face model "
                         "folder (for load_format=dummy, config.json alone is enough)")
    return int(json.loads(path.read_text())["vocab_size"])


def build_llm(args: argparse.Namespace, *, warmup: bool) -> tuple[Any, dict[str, Any]]:
    """Construct `pjinfer.LLM` (load + optional compile of every step shape)."""
    from pjinfer import LLM

    kwargs = engine_kwargs(args)
    if kwargs.get("compilation_cache_dir"):
        enable_compilation_cache(kwargs["compilation_cache_dir"])
    config = getattr(args, "config", None)
    llm = LLM(config=config, warmup=warmup, **kwargs)
    return llm, {**kwargs, "config": config, "warmup": warmup}


def enable_compilation_cache(path: str) -> None:
    """Cache every compiled step (no size/time floor), so a warm restart skips XLA entirely.

    Set here as well as by the engine so the start-up benchmark measures the cache even on
    engine versions that only record `compilation_cache_dir`.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
