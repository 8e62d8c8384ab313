"""vLLM's `bad_words`: words the output must not contain, banned one token at a time.

Each word becomes token sequences (`bad_words_token_ids`): as written, and with a leading space
(the form it takes after other text) when that tokenizes to as many tokens but another first
token. At each step a one-token sequence's token is banned outright; a longer one's last token
is banned where the output so far ends with all of its tokens but the last
(`banned_tokens`), so the word can never be completed. Only output tokens count, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """The token sequences to ban for `words` (tokenized without special tokens)."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        seqs += [plain] if plain else []
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return tuple(dict.fromkeys(seqs))


def banned_tokens(seqs: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """Tokens the next step may not take: each sequence's last token where the output ends
    with the rest of it."""
    banned = []
    for seq in seqs:
        head = len(seq) - 1
        tail = list(output_ids[len(output_ids) - head:]) if head else []
        if head <= len(output_ids) and tail == list(seq[:-1]):
            banned.append(seq[-1])
    return list(dict.fromkeys(banned))
