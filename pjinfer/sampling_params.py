"""How one request wants its tokens chosen: vLLM's `SamplingParams`, validated where it enters.

Every field keeps vLLM's name and default so OpenAI/vLLM clients map onto it one to one. The
object is frozen: `stop`, `stop_token_ids` and `allowed_token_ids` are normalised to tuples
and `logit_bias` is copied, so a caller mutating its own list or dict later cannot change a
running request.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pjinfer.structured_output.params import StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs; also bounds the sampler's static top-K.
MAX_N = 128  # Sequences per request; each one is a full sequence in the batch.
GREEDY_TEMPERATURE = 1e-5  # Below this vLLM samples greedily: dividing by it overflows f32.
_PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for presence/frequency penalties.
# The sampler's device arrays are int32 and float32: a value they cannot hold would overflow
# inside the engine thread (killing it for every request), so it is refused here instead.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


class RequestOutputKind(enum.Enum):
    """Which outputs `LLMEngine.step()` returns for a request (vLLM's names)."""

    CUMULATIVE = "cumulative"  # every step that changes it: everything generated so far
    DELTA = "delta"  # every step that changes it: only what is new since the last output
    FINAL_ONLY = "final_only"  # only the finished output (offline batches: no per-step copies)


def _is_int(value: Any) -> bool:
    """`bool` is an `int` subclass; `True` as a token count is a caller bug, not a 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and 0 <= value <= INT32_MAX


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _require_int(name: str, value: Any, *, upper: int = INT32_MAX) -> None:
    """An int that fits its device array (int32 unless `upper` says otherwise)."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value > upper:
        raise ValueError(f"{name} must be at most {upper}, got {value}")


def _require_float(name: str, value: Any) -> float:
    """A finite number as the device will see it: rounded to float32 (so 1e39 is refused, and
    a positive 1e-50 that would become 0 fails the caller's range check)."""
    if not _is_number(value) or not math.isfinite(value) or abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number (float32: at most {FLOAT32_MAX:.4g} "
                         f"in magnitude), got {value!r}")
    return float(np.float32(value))


def _require_range(name: str, value: float, lo: float, hi: float, interval: str) -> None:
    """`interval` is how the range reads in the message, e.g. '(0, 1]'."""
    lo_ok = value > lo if interval[0] == "(" else value >= lo
    hi_ok = value < hi if interval[-1] == ")" else value <= hi
    if not (lo_ok and hi_ok):
        raise ValueError(f"{name} must be in {interval}, got {value}")


def _normalise_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop must not contain the empty string; remove it")
    return tuple(stop)


def _normalise_bad_words(words: Any) -> tuple[str, ...]:
    if words is None:
        return ()
    if isinstance(words, str) or not isinstance(words, list | tuple) or not all(
            isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"bad_words must be a list of words (non-blank strings), got {words!r}")
    return tuple(words)


def _normalise_token_ids(name: str, ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple) or not all(_is_token_id(t) for t in ids):
        raise ValueError(f"{name} must be a list of token ids in [0, 2**31), got {ids!r}")
    return tuple(ids)


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    for token_id, value in bias.items():
        if not _is_token_id(token_id):
            raise ValueError(f"logit_bias keys must be token ids in [0, 2**31), got {token_id!r}")
        _require_float(f"logit_bias value for token {token_id}", value)
    return {int(t): float(v) for t, v in bias.items()}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling settings; invalid values raise `ValueError` naming field and fix."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled (normalised to 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None  # normalised to tuple[str, ...]
    stop_token_ids: list[int] | tuple[int, ...] | None = None  # normalised to tuple[int, ...]
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N of the raw distribution; 0: only the chosen token
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None  # only these may be sampled
    bad_words: list[str] | tuple[str, ...] | None = None  # words the output may not contain
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: max_model_len
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice...

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_probabilities()
        self._check_penalties()
        self._check_logprobs()
        self._check_flags()
        if self.seed is not None:
            _require_int("seed", self.seed, upper=2**64)
            _require_range("seed", self.seed, -(2**63), 2**64, "[-2**63, 2**64)")
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        ids = _normalise_token_ids("stop_token_ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        object.__setattr__(self, "logit_bias", _normalise_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            ids = _normalise_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not ids:
                raise ValueError("allowed_token_ids must not be empty: list the token ids "
                                 "the output may use, or leave it None")
            object.__setattr__(self, "allowed_token_ids", tuple(dict.fromkeys(ids)))
        object.__setattr__(self, "bad_words", _normalise_bad_words(self.bad_words))

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        _require_range("n", self.n, 1, MAX_N, f"[1, {MAX_N}]")
        if self.max_tokens is not None:
            _require_int("max_tokens", self.max_tokens)
            if self.max_tokens <= 0:
                raise ValueError(f"max_tokens must be at least 1 (or None), got {self.max_tokens}")
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.truncate_prompt_tokens is not None:
            _require_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1:
                raise ValueError("truncate_prompt_tokens must be >= 1 (keep the prompt's last "
                                 "k tokens) or -1 (keep max_model_len), got "
                                 f"{self.truncate_prompt_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > "
                f"max_tokens={self.max_tokens}; lower min_tokens or raise max_tokens"
            )

    def _check_probabilities(self) -> None:
        if _require_float("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _require_range("top_p", _require_float("top_p", self.top_p), 0.0, 1.0, "(0, 1]")
        _require_range("min_p", _require_float("min_p", self.min_p), 0.0, 1.0, "[0, 1]")
        _require_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        object.__setattr__(self, "top_k", max(self.top_k, 0))

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _require_range(name, _require_float(name, getattr(self, name)), *_PENALTY_RANGE,
                           "[-2, 2]")
        if _require_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}"
            )

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value)
                _require_range(name, value, 0, MAX_LOGPROBS, f"[0, {MAX_LOGPROBS}]")

    def _check_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{self.structured_outputs!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        """Greedy rows take the argmax and skip temperature/top-k/top-p/min-p entirely."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def truncate(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine runs it: its last `truncate_prompt_tokens` tokens (-1:
        max_model_len), as vLLM truncates (from the left, so the newest text is kept)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        if keep > max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len "
                             f"({max_model_len}), or -1 to keep max_model_len tokens")
        keep = max_model_len if keep == -1 else keep
        return prompt_ids[-keep:]

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids can only be range-checked once the model is known; call at admission."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be < vocab_size={vocab_size}, got {bad}")
