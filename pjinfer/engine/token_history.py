"""Token histories for the penalties (presence, frequency, repetition), as one padded table.

Only rows that use a penalty carry their prompt + output ids; the others stay PAD, so the width
L covers just those. With asynchronous scheduling a row's newest token may still be on the
device when the table is built: its position and the previous step's row holding it travel in
`pending`, and the sampler fills it in on the device (`SamplingMetadata.with_pending`).
The engine keeps each running sequence's history in a persistent buffer and appends only new
tokens (`HistoryBuffer`); a one-off batch builds the table from its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PAD_TOKEN_ID = -1  # Padding in every token-id table; the sampler drops these scatters.
MIN_HISTORY_BUCKET = 256  # Smallest L: keeps the number of compiled history shapes low.


def bucket(n: int, minimum: int) -> int:
    """0 stays 0 (table absent); otherwise the next power of two, at least `minimum`."""
    if n == 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


@dataclass(frozen=True, slots=True)
class TokenHistory:
    tokens: np.ndarray  # [S, L] i32 prompt then output ids, PAD_TOKEN_ID after
    num_prompt: np.ndarray  # [S] i32: tokens[:, :P] is prompt, the rest output
    pending: np.ndarray  # [S, 2] i32: (position, previous step's row) of a pending token


def empty_history(size: int) -> TokenHistory:
    pending = np.zeros((size, 2), np.int32)
    pending[:, 0] = -1
    return TokenHistory(np.zeros((size, 0), np.int32), np.zeros(size, np.int32), pending)


def _table(lengths: np.ndarray, used: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """An empty [size, L] table sized for `lengths` (pending included), and `pending`."""
    width = bucket(int(max((lengths[i] for i in used), default=0)), MIN_HISTORY_BUCKET)
    pending = np.zeros((size, 2), np.int32)
    pending[:, 0] = -1
    return np.full((size, width), PAD_TOKEN_ID, np.int32), pending


def history_from_rows(rows: Sequence, size: int) -> TokenHistory:
    """The table of a one-off batch of `SamplingRow`s."""
    used = [i for i, r in enumerate(rows) if r.params.uses_penalties]
    known = np.array([len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows] or [0])
    pend = np.array([r.num_pending for r in rows] or [0])
    tokens, pending = _table(known + pend, used, size)
    out = empty_history(size)
    for i in used:
        r = rows[i]
        n = len(r.prompt_token_ids)
        tokens[i, :n] = r.prompt_token_ids
        tokens[i, n:known[i]] = r.output_token_ids
        out.num_prompt[i] = n
        if pend[i]:
            pending[i] = (known[i], r.prev_row)
    return TokenHistory(tokens, out.num_prompt, pending)


class HistoryBuffer:
    """Per-row histories of running sequences, appended to as their tokens arrive."""

    def __init__(self, num_rows: int, max_len: int):
        self._max_len = max_len
        self._tokens: np.ndarray | None = None  # [rows, max_len], allocated on first use
        self._written = np.zeros(num_rows, np.int64)
        self._num_prompt = np.zeros(num_rows, np.int32)

    def free(self, row: int) -> None:
        self._written[row] = 0

    def gather(self, rows: np.ndarray, sampling: Sequence, size: int) -> TokenHistory:
        """The table for this step's `rows` (penalised ones), after appending new tokens."""
        used = [i for i, r in enumerate(sampling) if r.params.uses_penalties]
        if self._tokens is None:
            self._tokens = np.full((len(self._written), self._max_len), PAD_TOKEN_ID, np.int32)
        for i in used:
            self._append(int(rows[i]), sampling[i])
        pend = np.array([r.num_pending for r in sampling] or [0])
        lengths = np.zeros(len(sampling), np.int64)
        lengths[used] = self._written[rows[used]]
        tokens, pending = _table(lengths + pend, used, size)
        width = min(tokens.shape[1], self._max_len)
        tokens[used, :width] = self._tokens[rows[used], :width]
        num_prompt = np.zeros(size, np.int32)
        num_prompt[used] = self._num_prompt[rows[used]]
        for i in used:
            if pend[i]:
                pending[i] = (lengths[i], sampling[i].prev_row)
        return TokenHistory(tokens, num_prompt, pending)

    def _append(self, row: int, r) -> None:
        n = len(r.prompt_token_ids)
        if self._written[row] == 0:
            self._tokens[row, :n] = r.prompt_token_ids
            self._tokens[row, n:] = PAD_TOKEN_ID
            self._num_prompt[row], self._written[row] = n, n
        done = int(self._written[row]) - n
        new = r.output_token_ids[done:]
        self._tokens[row, n + done:n + done + len(new)] = new
        self._written[row] += len(new)
