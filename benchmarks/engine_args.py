"""Engine arguments on the benchmark command line: the flags of `pjinfer serve`, same generator.

Only the flags given on the command line (laid over a `--config` TOML's engine keys) are passed,
so the engine's defaults stay in force and the JSON records exactly what the user chose.
"""

from __future__ import annotations

import argparse
from typing import Any

from pjinfer import engine_flags
from pjinfer.benchmarks.synthetic_tokenizer import has_tokenizer, synthetic_tokenizer_dir
from pjinfer.plugins import PluginError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every engine flag but --warmup: each benchmark has its own `--engine-warmup` default."""
    engine_flags.add_engine_args(parser, exclude=("warmup",))


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments the user set; a config-only model folder gets a synthetic tokenizer."""
    try:
        kwargs = engine_flags.run_config_from_flags(args).engine_args()
    except PluginError as e:
        raise SystemExit(str(e)) from None
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

    kwargs = {**engine_kwargs(args), "warmup": warmup}
    return LLM(**kwargs), {**kwargs, "config": args.config}
