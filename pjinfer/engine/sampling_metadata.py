"""Per-step sampling inputs as one device pytree, and the host builder that fills it.

Shapes are bucketed so the jitted step compiles a handful of variants: S is the step's sequence
bucket, and the optional tables (token history L, logit bias B, allowed tokens A, suppressed
tokens E: min_tokens' stop ids, bad words) are padded to powers of two, or have width 0 when no
row in the step needs them. Static flags in the pytree's aux data let the step skip the [S, V]
sort, the penalty histograms and the random noise altogether when no row uses them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.engine.bad_words import banned_tokens
from pjinfer.engine.token_history import (
    PAD_TOKEN_ID,
    TokenHistory,
    bucket,
    empty_history,
    history_from_rows,
)
from pjinfer.sampling_params import SamplingParams

MIN_BIAS_BUCKET = 8
MIN_ALLOWED_BUCKET = 8
MIN_SUPPRESS_BUCKET = 4


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """Host view of one sequence to sample from this step.

    `seed` is the request's `SamplingParams.seed`, or, for unseeded requests, a seed the engine
    drew once when the request arrived (so its sampling still never depends on batch mates).
    For n > 1 the engine derives one seed per sequence (e.g. seed + index).
    The PRNG step is `num_output_tokens`: recomputation after preemption replays the same key.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    seed: int
    eos_token_id: int | None = None
    num_pending: int = 0  # output tokens sampled by a step whose result is not on the host yet
    prev_row: int = -1  # with num_pending: the previous step's row that sampled it
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences it may not complete

    @property
    def num_output_tokens(self) -> int:
        """Index of the token being sampled: the PRNG step and the min_tokens count."""
        return len(self.output_token_ids) + self.num_pending


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """Device arrays for one step, padded to S sequences; padding rows are greedy no-ops."""

    temperature: jax.Array  # [S] f32, 0 = greedy
    top_k: jax.Array  # [S] i32, 0 = off
    top_p: jax.Array  # [S] f32, 1 = off
    min_p: jax.Array  # [S] f32, 0 = off
    presence_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    seed_data: jax.Array  # [S, 2] u32, threefry key data (hi, lo words of the 64-bit seed)
    steps: jax.Array  # [S] i32, folded into the key
    token_history: jax.Array  # [S, L] i32 prompt then output ids, PAD_TOKEN_ID after
    num_prompt_tokens: jax.Array  # [S] i32, history[:, :P] is prompt, the rest output
    pending: jax.Array  # [S, 2] i32 (history position, previous row) of a pending token, or -1
    bias_token_ids: jax.Array  # [S, B] i32
    bias_values: jax.Array  # [S, B] f32
    allowed_token_ids: jax.Array  # [S, A] i32, PAD after; a row with none is unrestricted
    suppress_token_ids: jax.Array  # [S, E] i32: stop/eos ids until min_tokens, bad words' ids
    all_greedy: bool = True  # static: skip temperature, top-k/p, min-p and noise
    needs_sort: bool = False  # static: some row uses top_k or top_p
    needs_penalties: bool = False  # static: some row uses a penalty

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], num_seqs_padded: int,
              columns: dict[str, np.ndarray] | None = None,
              history: Callable[[], TokenHistory] | None = None) -> SamplingMetadata:
        """NumPy-filled metadata for `rows`, padded to `num_seqs_padded` sequences. `columns`
        are the rows' `row_fields` already stacked and padded, `history` makes the penalties'
        token table (the engine's persistent batch keeps both); without them they are built
        from the rows here."""
        if len(rows) > num_seqs_padded:
            raise ValueError(f"{len(rows)} rows do not fit num_seqs_padded={num_seqs_padded}")
        cols = columns if columns is not None else stack_row_fields(rows, num_seqs_padded)
        sampled = cols["temperature"] > 0
        needs_penalties = bool(cols["uses_penalties"].any())
        if not needs_penalties:
            hist = empty_history(num_seqs_padded)
        else:
            hist = history() if history is not None else \
                history_from_rows(rows, num_seqs_padded)
        bias_ids, bias_values = _logit_bias([r.params for r in rows] if cols["has_bias"].any()
                                            else [], num_seqs_padded)
        return cls(
            **{name: cols[name] for name in _SCALAR_FIELDS},
            seed_data=cols["seed_data"],
            steps=_padded([r.num_output_tokens for r in rows], num_seqs_padded, 0, np.int32),
            token_history=hist.tokens,
            num_prompt_tokens=hist.num_prompt,
            pending=hist.pending,
            bias_token_ids=bias_ids,
            bias_values=bias_values,
            allowed_token_ids=_allowed_ids([r.params for r in rows] if cols["has_allowed"].any()
                                           else [], num_seqs_padded),
            suppress_token_ids=_suppressed_ids(
                rows if cols["min_tokens"].any() or cols["has_bad_words"].any() else [],
                num_seqs_padded),
            all_greedy=not sampled.any(),
            needs_sort=bool((sampled & ((cols["top_k"] > 0) | (cols["top_p"] < 1.0))).any()),
            needs_penalties=needs_penalties,
        )

    def with_pending(self, prev_tokens: jax.Array) -> SamplingMetadata:
        """On device: write each penalised row's pending token (sampled by the previous step,
        not on the host when this metadata was built) into its history."""
        if not self.needs_penalties:
            return self
        pos, src = self.pending[:, 0], self.pending[:, 1]
        rows, at = jnp.arange(pos.shape[0]), jnp.maximum(pos, 0)
        value = jnp.where(pos >= 0, prev_tokens[src], self.token_history[rows, at])
        return dataclasses.replace(self, token_history=self.token_history.at[rows, at].set(value))


_META_FIELDS = ["all_greedy", "needs_sort", "needs_penalties"]  # static: change the trace
jax.tree_util.register_dataclass(
    SamplingMetadata,
    data_fields=[f.name for f in dataclasses.fields(SamplingMetadata)
                 if f.name not in _META_FIELDS],
    meta_fields=_META_FIELDS,
)


def _padded(values: Sequence[float], size: int, fill: float, dtype: type) -> np.ndarray:
    out = np.full(size, fill, dtype=dtype)
    out[: len(values)] = values
    return out


_SCALAR_FIELDS = {  # field -> (its value when off: the padding rows' value, dtype)
    "temperature": (0.0, np.float32), "top_k": (0, np.int32), "top_p": (1.0, np.float32),
    "min_p": (0.0, np.float32), "presence_penalty": (0.0, np.float32),
    "frequency_penalty": (0.0, np.float32), "repetition_penalty": (1.0, np.float32),
}


def row_fields(row: SamplingRow) -> dict[str, np.ndarray]:
    """What a sequence's sampling needs that never changes while it runs: written once into
    the persistent batch. Greedy rows get temperature 0 (the sampler's greedy marker)."""
    p = row.params
    fields = {name: np.asarray(getattr(p, name), dtype)
              for name, (_, dtype) in _SCALAR_FIELDS.items()}
    if p.greedy:
        fields["temperature"] = np.float32(0.0)
    fields["seed_data"] = _seed_data([row], 1)[0]
    fields["uses_penalties"] = np.bool_(p.uses_penalties)
    fields["has_bias"] = np.bool_(bool(p.logit_bias))
    fields["has_allowed"] = np.bool_(p.allowed_token_ids is not None)
    fields["min_tokens"] = np.int32(p.min_tokens)
    fields["has_bad_words"] = np.bool_(bool(row.bad_words))
    return fields


def pad_value(name: str) -> float:
    """A padding row's value of a `row_fields` column: every processor off."""
    return _SCALAR_FIELDS.get(name, (0,))[0]


def stack_row_fields(rows: Sequence[SamplingRow], size: int) -> dict[str, np.ndarray]:
    """`row_fields` of every row, stacked and padded to `size` rows."""
    per_row = [row_fields(r) for r in rows]
    template = row_fields(SamplingRow(SamplingParams(), (), (), 0))
    out = {}
    for name, value in template.items():
        column = np.full((size, *value.shape), pad_value(name), value.dtype)
        if per_row:
            column[:len(per_row)] = np.stack([f[name] for f in per_row])
        out[name] = column
    return out


def _seed_data(rows: Sequence[SamplingRow], size: int) -> np.ndarray:
    """Threefry key data from the full 64-bit seed; jax.random.key(seed) would truncate it to
    32 bits when x64 is off. For 0 <= seed < 2**32 it equals jax.random.key(seed)'s data."""
    seeds = np.array([r.seed % 2**64 for r in rows], dtype=np.uint64)
    out = np.zeros((size, 2), dtype=np.uint32)
    out[: len(rows), 0] = seeds >> np.uint64(32)
    out[: len(rows), 1] = seeds & np.uint64(0xFFFFFFFF)
    return out


def _logit_bias(params: Sequence[SamplingParams], size: int) -> tuple[np.ndarray, np.ndarray]:
    width = bucket(max((len(p.logit_bias or ()) for p in params), default=0), MIN_BIAS_BUCKET)
    ids = np.full((size, width), PAD_TOKEN_ID, dtype=np.int32)
    values = np.zeros((size, width), dtype=np.float32)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids[i, : len(p.logit_bias)] = list(p.logit_bias.keys())
            values[i, : len(p.logit_bias)] = list(p.logit_bias.values())
    return ids, values


def _allowed_ids(params: Sequence[SamplingParams], size: int) -> np.ndarray:
    return _id_table([p.allowed_token_ids or () for p in params], size, MIN_ALLOWED_BUCKET)


def _suppressed_ids(rows: Sequence[SamplingRow], size: int) -> np.ndarray:
    """Stop ids (and eos unless ignore_eos) for rows still short of min_tokens, and the
    tokens that would complete a bad word (`bad_words`), as in vLLM."""
    per_row = [(_stop_ids(r) if r.num_output_tokens < r.params.min_tokens else ())
               + tuple(banned_tokens(r.bad_words, r.output_token_ids)) for r in rows]
    return _id_table(per_row, size, MIN_SUPPRESS_BUCKET)


def _id_table(per_row: Sequence[Sequence[int]], size: int, min_bucket: int) -> np.ndarray:
    """[size, W] i32: each row's ids from column 0, PAD after; W the longest row's length
    bucketed (0 when no row has any)."""
    out = np.full((size, bucket(max(map(len, per_row), default=0), min_bucket)),
                  PAD_TOKEN_ID, dtype=np.int32)
    for i, ids in enumerate(per_row):
        out[i, : len(ids)] = ids
    return out


def _stop_ids(row: SamplingRow) -> tuple[int, ...]:
    eos = () if row.params.ignore_eos or row.eos_token_id is None else (row.eos_token_id,)
    return tuple(dict.fromkeys(row.params.stop_token_ids + eos))
