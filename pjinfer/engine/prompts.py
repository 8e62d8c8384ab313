"""A prompt as the engine runs it: tokenized (or its ids checked), truncated as the request
asks, with room left to generate."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pjinfer.sampling_params import SamplingParams


def prompt_token_ids(prompt: str | Sequence[int], params: SamplingParams | None, *,
                     tokenizer: Any, vocab_size: int, max_model_len: int) -> list[int]:
    """Non-empty, known ids, at most max_model_len - 1 of them after `truncate_prompt_tokens`;
    ValueError saying what to change otherwise."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token ids")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
        if any(t < 0 or t >= vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if not ids:
        raise ValueError("prompt must not be empty")
    if params is not None:
        ids = params.truncate(ids, max_model_len)
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}: "
                         "shorten the prompt (at least one token must be left to generate)")
    return ids
