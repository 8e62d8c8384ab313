"""Incremental detokenization: streamed text equals the full decode, stop strings never leak."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pjinfer.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a tiny corpus. Café crème brûlée naïve façade.",
    "日本語のテキストです。世界こんにちは、東京。",
    "emoji 🙂🚀 and more 🙂 text 👩‍💻",
    "The quick brown fox jumps over the lazy dog.",
]
TEXTS = [
    "Café crème brûlée, naïve façade!",
    "世界こんにちは 日本語のテキスト",
    "rocket 🚀 smile 🙂 coder 👩‍💻 done",
    "mixed: héllo 世界 🙂 ok",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE small enough that most non-ASCII characters span several tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    return [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer, text: str, chunk: int) -> None:
    ids = encode(tokenizer, text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no character split: weak test"
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello 世"), True, ())
    deltas = stream(detok, ids, chunk)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == text


def test_special_tokens_follow_skip_flag(tokenizer) -> None:
    ids = [*encode(tokenizer, "a 🙂"), tokenizer.eos_token_id, *encode(tokenizer, " b")]
    skipped = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    assert "".join(stream(skipped, ids)) == "a 🙂 b"
    assert "".join(stream(kept, ids)) == "a 🙂<eos> b"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("Hello world STOP and more", ("STOP",), "Hello world "),
        ("日本語 世界こんにちは tail", ("世界",), "日本語 "),
        ("smile 🙂🚀 rocket", ("xyz", "🙂🚀", " rock"), "smile "),
    ],
)
def test_stop_string_is_cut_and_never_streamed(tokenizer, text, stop, expected) -> None:
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, [1], True, stop)
    deltas = stream(detok, ids)
    assert detok.finished and detok.stop_reason in stop
    assert "".join(deltas) == detok.output_text == expected
    assert detok.add_tokens(encode(tokenizer, "more")) == "" and detok.flush() == ""


def test_stop_string_spanning_tokens_is_held_back(tokenizer) -> None:
    ids = encode(tokenizer, "ok STOP")
    assert all("STOP" not in tokenizer.decode([i]) for i in ids), "stop fits one token"
    detok = IncrementalDetokenizer(tokenizer, [1], True, ("STOP",))
    streamed = ""
    for token_id in ids:
        streamed += detok.add_tokens([token_id])
        assert "S" not in streamed  # "S", "ST", "STO" were decoded but never streamed
    assert streamed == "ok " and detok.stop_reason == "STOP"


def test_include_stop_str_keeps_stop_and_drops_rest(tokenizer) -> None:
    ids = encode(tokenizer, "say 世界 then more text")
    detok = IncrementalDetokenizer(tokenizer, [1], True, ("世界",), include_stop_str_in_output=True)
    assert "".join(stream(detok, ids)) == "say 世界"


def test_false_start_is_released_by_flush(tokenizer) -> None:
    text = "STOCK STOrm ST"
    detok = IncrementalDetokenizer(tokenizer, [1], True, ("STOP",))
    streamed = "".join(stream(detok, encode(tokenizer, text)))
    assert not detok.finished and len(text) - len(streamed) <= 3
    assert streamed + detok.flush() == text


def test_min_tokens_ignores_early_stop_strings(tokenizer) -> None:
    ids = encode(tokenizer, "STOP early, then STOP again")
    detok = IncrementalDetokenizer(tokenizer, [1], True, ("STOP",), min_tokens=5)
    assert "".join(stream(detok, ids)) == "STOP early, then "


class CountingTokenizer:
    """Records every decode window so the test can see that decoding stays incremental."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner, self.windows = inner, []
        self.all_special_ids = inner.all_special_ids

    def decode(self, ids: Sequence[int], **kwargs) -> str:
        self.windows.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_windows_stay_short(tokenizer) -> None:
    ids = encode(tokenizer, " ".join(TEXTS * 10))
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [1, 2, 3], True, ("never-there",))
    text = "".join(stream(detok, ids)) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert len(ids) > 400 and max(counting.windows) <= 10
