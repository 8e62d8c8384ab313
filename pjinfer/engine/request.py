"""One sequence's host-side state, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pjinfer.engine.detokenizer import IncrementalDetokenizer
from pjinfer.outputs import PositionLogprobs
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


@dataclass(eq=False)
class Request:
    """A single sequence: prompt, generated tokens, and how far its KV has been computed.

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
    detokenizer: IncrementalDetokenizer | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    # Asynchronous scheduling: tokens sampled by a launched step that are not on the host yet
    # (0 or 1). They count in num_tokens, so the next step already computes them.
    num_pending_tokens: int = 0
    final_token_pending: bool = False  # the pending token is its last (length limit)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None

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
    def all_token_ids(self) -> list[int]:
        """Every token known on the host (a pending one is not)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def allows_async(self) -> bool:
        """Can its step stay in flight while the next is scheduled? Not when the next step's
        host inputs need this step's tokens (penalty histories, n > 1 forks) or when it
        records prompt logprobs."""
        p = self.params
        return p.n == 1 and not p.uses_penalties and p.prompt_logprobs is None

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
