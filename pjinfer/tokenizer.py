"""Tokenizer and chat template of a local Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pjinfer.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(model_dir: str | Path, tokenizer: str | Path | None = None) -> Any | None:
    """A transformers fast tokenizer (tokenizer.json, or sentencepiece converted on load).

    A model folder without any tokenizer file (random-weight benchmark shapes, test models)
    gives None: the engine then takes token-id prompts only and returns no text.
    """
    path = Path(tokenizer or model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer folder {str(path)!r} does not exist")
    if tokenizer is None and not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    # only now: importing transformers (and PyTorch, where installed) takes seconds
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path}: it needs tokenizer.json "
                             f"or tokenizer.model with tokenizer_config.json ({e})") from None


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template; `tools`
    (OpenAI function definitions) go to the template, which decides how to show them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions, or pass "
                         "a tokenizer whose tokenizer_config.json defines chat_template")
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)
