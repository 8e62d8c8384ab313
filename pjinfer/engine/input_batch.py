"""The persistent host batch: block tables and sampling settings of running sequences, kept in
NumPy rows across steps and updated by differences.

A decode step of 256 sequences used to rebuild a [256, blocks] table from Python lists and read
seven sampling fields of every request; here a sequence gets a row when it first runs, its
sampling settings are written once, its block table grows by the blocks added since the last
step, and a step gathers its rows with one fancy index. Rows are freed when the scheduler
finishes or preempts a sequence (a preempted one gets new blocks when it comes back).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from pjinfer.engine.inputs import Chunk
from pjinfer.engine.sampling_metadata import SamplingRow, pad_value, row_fields
from pjinfer.engine.token_history import HistoryBuffer, TokenHistory


class InputBatch:
    """Rows of per-sequence host state, keyed by request id."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int):
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), np.int32)
        self.history = HistoryBuffer(max_num_seqs, max_model_len)  # penalties' token ids
        self.num_blocks = np.zeros(max_num_seqs, np.int64)  # table entries written per row
        self.sampling: dict[str, np.ndarray] = {}  # field -> [max_num_seqs, ...]
        self._rows: dict[str, int] = {}
        self._free = list(range(max_num_seqs - 1, -1, -1))

    def free(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self.num_blocks[row] = 0
                self.history.free(row)
                self._free.append(row)

    def rows_for(self, chunks: Sequence[Chunk], sampling: Sequence[SamplingRow], *,
                 refresh: bool = False) -> np.ndarray:
        """The rows of this step's sequences [S], after writing what changed since the last
        step. `refresh` rewrites whole block tables (copy-on-write replaced an entry)."""
        rows = np.fromiter((self._rows.get(c.request_id, -1) for c in chunks), np.int64,
                           len(chunks))
        for i in np.flatnonzero(rows < 0):  # first step of a sequence
            rows[i] = self._add(chunks[i].request_id, sampling[i])
        lens = np.fromiter((len(c.block_table) for c in chunks), np.int64, len(chunks))
        written = np.zeros_like(lens) if refresh else self.num_blocks[rows]
        for i in np.flatnonzero(lens > written):  # a decode adds a block every block_size steps
            self.block_tables[rows[i], written[i]:lens[i]] = chunks[i].block_table[written[i]:]
        self.num_blocks[rows] = np.maximum(lens, written)
        return rows

    def _add(self, request_id: str, sampling: SamplingRow) -> int:
        if not self._free:
            raise RuntimeError("more running sequences than max_num_seqs rows")
        row = self._rows[request_id] = self._free.pop()
        self._write_sampling(row, sampling)
        return row

    def _write_sampling(self, row: int, sampling: SamplingRow) -> None:
        for name, value in row_fields(sampling).items():
            column = self.sampling.get(name)
            if column is None:
                column = self.sampling[name] = np.zeros((len(self.num_blocks), *value.shape),
                                                        value.dtype)
            column[row] = value

    def token_history(self, rows: np.ndarray, sampling: Sequence[SamplingRow],
                      padded: int) -> TokenHistory:
        return self.history.gather(rows, sampling, padded)

    def gather(self, rows: np.ndarray, padded: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Block tables [padded, W] and sampling columns [padded, ...] of `rows`; padding rows
        are zeros: the null block, and greedy sampling with every processor off."""
        tables = np.zeros((padded, self.block_tables.shape[1]), np.int32)
        tables[:len(rows)] = self.block_tables[rows]
        columns = {}
        for name, column in self.sampling.items():
            out = np.full((padded, *column.shape[1:]), pad_value(name), column.dtype)
            out[:len(rows)] = column[rows]
            columns[name] = out
        return tables, columns
