"""A stand-in tokenizer for model folders that hold only a config.json.

Benchmarks with `load_format=dummy` need the model's shapes, not its real tokenizer; the engine
still loads one (to detokenize and to size vocabularies). A word-level tokenizer with exactly
`vocab_size` entries ("<0>", "<1>", ...) costs about what a real one does per token and keeps
every id in range, so random token-id prompts and generated ids decode without errors.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: str | Path) -> bool:
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def synthetic_tokenizer_dir(vocab_size: int, root: str | Path | None = None) -> Path:
    """Folder with a word-level tokenizer of `vocab_size` ids; built once, then reused."""
    root = cache_root(root) / f"tokenizer-vocab{vocab_size}"
    if (root / "tokenizer.json").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    write_atomic(root / "tokenizer.json", json.dumps(_tokenizer_json(vocab_size)))
    write_atomic(root / "tokenizer_config.json", json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<0>",
         "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}))
    return root


def _tokenizer_json(vocab_size: int) -> dict:
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "unk_token": "<0>",
                  "vocab": {f"<{i}>": i for i in range(vocab_size)}},
    }


def cache_root(root: str | Path | None = None) -> Path:
    """Where stand-in tokenizers are kept (built once per vocabulary size)."""
    return Path(root or os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) \
        / "pjinfer-bench"


def write_atomic(path: Path, text: str) -> None:
    """Concurrent runs (server + client) may build the same folder; never expose half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
