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
    from pjinfer.quantization.gguf_file import gguf_path

    gguf = gguf_path(model_dir) if tokenizer is None else None
    if gguf is not None:
        return _gguf_tokenizer(gguf)
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


def _gguf_tokenizer(gguf: Path) -> Any | None:
    """The tokenizer a GGUF file describes in its metadata (None when it has none), built by
    transformers' GGUF converter."""
    from transformers import AutoTokenizer

    from pjinfer.quantization.gguf_file import GGUFIndex

    if "tokenizer.ggml.tokens" not in GGUFIndex(gguf).metadata:
        return None
    try:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                             local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot build a tokenizer from the metadata of {gguf}: {e}; "
                             "pass a tokenizer folder (tokenizer=...)") from None


# apply_chat_template's own arguments: chat_template_kwargs may not set them
_TEMPLATE_ARGUMENTS = ("conversation", "messages", "tools", "documents", "chat_template",
                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                       "truncation", "max_length", "return_tensors", "return_dict",
                       "return_assistant_tokens_mask", "tokenizer_kwargs")


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *,
                        add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        tools: list[dict[str, Any]] | None = None,
                        chat_template: str | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation rendered with the model's own chat template (or
    `chat_template`); `tools` (OpenAI function definitions) go to the template, which decides
    how to show them; `chat_template_kwargs` are more variables for it (e.g. Qwen3's
    `enable_thinking`). `continue_final_message` leaves the last (assistant) message open
    for the model to go on with, as vLLM does. Any error rendering it raises ValueError: the
    messages, the kwargs or a request's template are the caller's."""
    import jinja2

    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions, or pass "
                         "a tokenizer whose tokenizer_config.json defines chat_template")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be "
                         "true: set add_generation_prompt to false to continue the last message")
    last_role = messages[-1].get("role") if messages else None
    if continue_final_message and last_role != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's "
                         f"(the text to continue), got role {last_role!r}")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(k for k in extra if k in _TEMPLATE_ARGUMENTS)
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: pass them as "
                         "the request's own fields")
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, tools=tools, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, **extra)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a template (or its kwargs) failing is the request's
        kind = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
        raise ValueError(f"the chat template failed on these messages: {kind}{e}") from None
    return tokenizer.encode(text, add_special_tokens=False)
