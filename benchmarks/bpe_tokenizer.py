"""A byte-level BPE stand-in tokenizer with a real model's vocabulary size.

Structured-output benchmarks on config-only model folders (`load_format=dummy`) need a
vocabulary that can spell JSON: the word-level stand-in (`synthetic_tokenizer`) has only
"<123>" tokens, with which no grammar can make a `{`. This one is a GPT-2-style byte-level BPE:
the 256 bytes, every pair of printable ASCII characters, then triples of the most common
characters until `vocab_size - NUM_SPECIAL` tokens; the last `NUM_SPECIAL` ids are special
tokens (Llama 3's layout: <|begin_of_text|> = 128000, <|eot_id|> = 128009 for 128256 ids).
Its tokens are shorter than a trained vocabulary's (1-3 characters), so grammar masks walk a
vocabulary of the real size but JSON takes a few more tokens than it would with Llama 3's.
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path

from pjinfer.benchmarks.synthetic_tokenizer import cache_root, write_atomic

NUM_SPECIAL = 256
PRINTABLE = string.ascii_letters + string.digits + string.punctuation + " "
# the characters of English text and JSON, most common first: triples are made of these
COMMON = ' etaoinshrdlcumwfgypbvkjxqz"{}:,.0123456789TAISENOR_'
SPECIAL_NAMES = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 9: "<|eot_id|>"}


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-in character for each byte value (index = byte)."""
    direct = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in direct:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def bpe_tokenizer_dir(vocab_size: int, root: str | Path | None = None) -> Path:
    """Folder with the stand-in tokenizer of `vocab_size` ids; built once, then reused."""
    folder = cache_root(root) / f"bpe-tokenizer-vocab{vocab_size}"
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    first_special = vocab_size - NUM_SPECIAL
    specials = [SPECIAL_NAMES.get(i, f"<|reserved_special_token_{i}|>")
                for i in range(NUM_SPECIAL)]
    write_atomic(folder / "tokenizer.json", json.dumps(_tokenizer_json(first_special,
                                                                        specials)))
    write_atomic(folder / "tokenizer_config.json", json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0],
        "eos_token": specials[9], "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False}))
    return folder


def _tokenizer_json(num_regular: int, specials: list[str]) -> dict:
    vocab, merges = _vocab_and_merges(num_regular)
    added = [{"id": num_regular + i, "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for i, s in enumerate(specials)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                  "use_regex": True}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def _vocab_and_merges(size: int) -> tuple[dict[str, int], list[list[str]]]:
    """Bytes, then pairs, then triples (each merged from a pair and a byte)."""
    symbol = byte_symbols()
    tokens = list(symbol)
    merges = []
    printable = [symbol[ord(c)] for c in PRINTABLE]
    common = [symbol[ord(c)] for c in COMMON]
    for a, b in itertools.product(printable, repeat=2):
        tokens.append(a + b)
        merges.append([a, b])
    for a, b, c in itertools.product(common, repeat=3):
        if len(tokens) >= size:
            break
        tokens.append(a + b + c)
        merges.append([a + b, c])
    if len(tokens) < size:
        raise ValueError(f"vocab_size {size + NUM_SPECIAL} is larger than this stand-in can "
                         f"make ({len(tokens) + NUM_SPECIAL})")
    tokens, merges = tokens[:size], merges[:size - 256]
    return {t: i for i, t in enumerate(tokens)}, merges
