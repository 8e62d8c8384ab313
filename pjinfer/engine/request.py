"""One sequence's host-side state, from arrival to finish."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pjinfer.engine.sampling_metadata import SamplingRow
from pjinfer.lora.request import LoRARequest
from pjinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_FORK = "waiting_for_fork"  # sibling of an n > 1 request, before the prompt is in
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_TIMEOUT = "timeout"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "timeout")


class TokenIds(Sequence[int]):
    """Read-only view of a request's prompt + output tokens: the scheduler reads a sequence's
    tokens every step (prefix-cache keys of newly full blocks), and copying thousands of ids
    per sequence per step would cost more than the step's other host work."""

    __slots__ = ("_request",)

    def __init__(self, request: Request):
        self._request = request

    def __len__(self) -> int:
        return len(self._request.prompt_token_ids) + len(self._request.output_token_ids)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            return self._request.token_ids_between(start, stop)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        num_prompt = len(self._request.prompt_token_ids)
        if index < num_prompt:
            return self._request.prompt_token_ids[index]
        return self._request.output_token_ids[index - num_prompt]


@dataclass(eq=False)
class Request:
    """A single sequence: prompt, generated tokens, and how far its KV has been computed.

    Token-level state only (the scheduler's); text, logprobs and output formatting live in
    the output processor.

    A request with `n` > 1 becomes n sequences sharing `group_id`; sequence 0 prefills the
    prompt and the others fork its blocks (see Scheduler).
    """

    request_id: str  # unique per sequence: "<group_id>" or "<group_id>#<index>"
    group_id: str
    index: int  # which of the group's n sequences
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_id: int | None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Asynchronous scheduling: tokens sampled by a launched step that are not on the host yet
    # (1, or up to num_scheduler_steps from a multi-step decode). They count in num_tokens,
    # so the next step already computes them.
    num_pending_tokens: int = 0
    final_token_pending: bool = False  # the last pending token is its last (length limit)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None
    stopped_by_token: bool = False  # EOS or a stop token id ended it: not part of the text
    # Structured outputs: this sequence's llguidance matcher, set once its grammar compiled
    grammar: Any = None
    grammar_template: int = 0  # which of the grammar's templates it was copied from
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words, tokenized

    @property
    def lora_key(self) -> tuple | None:
        """Keys its prefix-cache blocks apart from other adapters' and the base model's."""
        return None if self.lora_request is None else self.lora_request.cache_key

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, counting a pending one."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> TokenIds:
        """Every token known on the host (a pending one is not), as a view: no copy."""
        return TokenIds(self)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Known tokens at positions [start, end), without copying the whole sequence."""
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        if end <= num_prompt:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[:end - num_prompt]

    def sampling_row(self, prev_row: int = -1) -> SamplingRow:
        """The sampler's view, taken before the step advances the request; `prev_row`: the
        previous step's row that sampled its pending token."""
        return SamplingRow(self.params, self.prompt_token_ids, self.output_token_ids, self.seed,
                           self.eos_token_id, self.num_pending_tokens, prev_row,
                           self.bad_words_token_ids)

    @property
    def allows_async(self) -> bool:
        """Can its step stay in flight while the next is scheduled? Not when the next step's
        host inputs need this step's tokens (n > 1 forks, the tokens bad_words bans next) or
        when it records prompt logprobs. (Penalty histories get a pending token on the
        device.)"""
        p = self.params
        return p.n == 1 and p.prompt_logprobs is None and not self.bad_words_token_ids

    def outputs_left(self, max_model_len: int, num_output: int) -> int:
        """Tokens it may still sample, having `num_output`, before the one length rule ends
        it: max_tokens outputs, or max_model_len tokens in all (<= 0: reached)."""
        left = max_model_len - self.num_prompt_tokens - num_output
        max_tokens = self.params.max_tokens
        return left if max_tokens is None else min(left, max_tokens - num_output)

    @property
    def allows_multi_step(self) -> bool:
        """Can its decode run several steps in one device call? Not when a step's sampling
        needs the tokens of the steps before it on the host or in a history: penalties, a
        grammar's token mask. (min_tokens only counts steps: `multi_step.row_step_counts`.)"""
        p = self.params
        return self.allows_async and not p.uses_penalties and p.structured_outputs is None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.index == 0

    def finish(self, status: RequestStatus, reason: int | str | None = None) -> None:
        self.status = status
        self.stop_reason = reason
        self.finished_time = time.monotonic()
