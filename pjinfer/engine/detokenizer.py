"""Incremental detokenization of one sequence, with stop-string detection.

Decoding the whole sequence every step is O(n^2) over a generation; instead we decode a short
window: ids[prefix_offset:] against ids[prefix_offset:read_offset]. The text is emitted only when
the window no longer ends in U+FFFD, so a multi-byte character split across byte-level tokens is
never streamed half-done. The prefix gives the decoder left context (SentencePiece drops a
leading space at the start of a decode) so deltas concatenate to the full decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"  # What the decoder yields for an incomplete UTF-8 sequence.
INITIAL_CONTEXT_TOKENS = 5  # Prompt tokens decoded as left context, as vLLM does.


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into text deltas; knows when a stop string hit.

    Without `include_stop_str_in_output`, the last len(longest stop) - 1 characters are held
    back from each delta, so a stop string is never partially streamed before it is cut.
    Call `flush()` when the sequence ends for another reason (eos, length) to get that tail.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skipped = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._ids = [t for t in prompt_token_ids if t not in self._skipped]
        self._ids = self._ids[-INITIAL_CONTEXT_TOKENS:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._stop = stop
        self._max_stop_len = max(map(len, stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._holdback = 0 if include_stop_str_in_output else max(self._max_stop_len - 1, 0)
        self._min_tokens = min_tokens
        self._num_output_tokens = 0
        # Emitted text lives in _parts (joined only on demand: appending to one str each step
        # would copy the whole text every token); _tail keeps its last len(longest stop) - 1
        # characters so a stop string straddling emitted and new text is still found.
        self._parts: list[str] = []
        self._tail = ""
        self._pending = ""  # Decoded but not yet emitted (held back or just decoded).
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        """The text streamed so far: what a client has seen (held-back characters excluded
        until `flush()` or a stop string settles them)."""
        return "".join(self._parts)

    @property
    def num_parts(self) -> int:
        """How many text pieces were emitted: a mark for `text_since`."""
        return len(self._parts)

    def text_since(self, num_parts: int) -> str:
        """Text emitted after the first `num_parts` pieces (a stream's delta, no full join)."""
        return "".join(self._parts[num_parts:])

    @property
    def finished(self) -> bool:
        """True once a stop string appeared; later tokens are ignored."""
        return self.stop_reason is not None

    def add_tokens(self, new_token_ids: Iterable[int]) -> str:
        """Append sampled ids; return the text that is now safe to stream."""
        if self.finished:
            return ""
        num_old_chars = len(self._pending)
        for token_id in new_token_ids:
            self._num_output_tokens += 1
            if token_id not in self._skipped:
                self._pending += self._decode_next(token_id)
        if self._stop and self._num_output_tokens > self._min_tokens:
            self._check_stop(num_old_chars)
        return self._take_delta(final=self.finished)

    def flush(self) -> str:
        """The held-back tail, once the sequence has ended (eos, length, abort)."""
        return self._take_delta(final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        # The Rust tokenizer directly: transformers' decode wrapper costs ~10 us a call here,
        # and this runs twice per token per sequence on the engine's hot path.
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=False)
        return self._tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _decode_next(self, token_id: int) -> str:
        """Prefix/read-offset step (vLLM's detokenize_incrementally): '' while incomplete."""
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        # Drop ids left of the new prefix so windows and the list stay short.
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def _check_stop(self, num_old_chars: int) -> None:
        """Cut at the earliest stop string that ends in this call's new text.

        Like vLLM, a stop string completed while min_tokens was unmet is not acted on later.
        """
        tail, window = len(self._tail), self._tail + self._pending
        new_start = tail + num_old_chars
        hits = [
            (i, stop)
            for stop in self._stop
            if (i := window.find(stop, max(0, new_start - len(stop) + 1))) != -1
        ]
        if not hits:
            return
        index, stop = min(hits)
        cut = index + len(stop) if self._include_stop else index
        self._pending = window[tail : max(cut, tail)]  # Emitted text cannot be taken back.
        self.stop_reason = stop

    def _take_delta(self, final: bool) -> str:
        end = len(self._pending) if final else len(self._pending) - self._holdback
        if end <= 0:
            return ""
        delta, self._pending = self._pending[:end], self._pending[end:]
        self._parts.append(delta)
        if self._max_stop_len > 1:
            self._tail = (self._tail + delta)[-(self._max_stop_len - 1) :]
        return delta
