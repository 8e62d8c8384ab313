"""From sampled tokens to `RequestOutput`s: detokenizing, stop strings, logprobs, output kinds.

The scheduler decides token-level facts (which tokens a request accepted, EOS, length); this
module owns everything about text and formatting. Outputs come in vLLM's three kinds:
CUMULATIVE (everything so far, every step), DELTA (only what is new since the last output:
what a stream sends, with no diffing downstream) and FINAL_ONLY (one output at the end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pjinfer.engine.detokenizer import IncrementalDetokenizer
from pjinfer.engine.metrics import EngineMetrics
from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.scheduler import NewTokens, SchedulerOutput
from pjinfer.engine.step_handles import StepResult
from pjinfer.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pjinfer.sampling_params import RequestOutputKind


@dataclass(eq=False)
class _Sequence:
    """One sequence's text and logprobs, and (DELTA) how much of them was already sent."""

    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0
    sent_parts: int = 0  # text pieces of the detokenizer already sent
    sent_finish: bool = False

    def text(self, delta: bool) -> str:
        if self.detokenizer is None:
            return ""
        return self.detokenizer.text_since(self.sent_parts if delta else 0)


@dataclass(eq=False)
class _Group:
    """A request's n sequences and its prompt logprobs."""

    seqs: list[_Sequence]
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    sent_prompt_logprobs: bool = False

    @property
    def head(self) -> Request:
        return self.seqs[0].request

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.seqs)


class OutputProcessor:
    """Per-request output state, from `add` to the request's final output."""

    def __init__(self, tokenizer: Any, metrics: EngineMetrics):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._groups: dict[str, _Group] = {}
        # Groups whose processing raised: the engine fails them (and only them); see `take_failed`
        self._failed: dict[str, Exception] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._groups

    def add(self, group: list[Request]) -> None:
        self._groups[group[0].group_id] = _Group([_Sequence(r, self._detokenizer(r))
                                                  for r in group])

    def take_failed(self) -> dict[str, Exception]:
        """Groups whose text or output building raised since the last call, and why: a fault
        in one request's tokens (a detokenizer bug, a bad logprob) must not end the others."""
        failed, self._failed = self._failed, {}
        return failed

    def drop(self, group_id: str) -> None:
        """Forget a failed group without building its output (that may be what failed)."""
        self._groups.pop(group_id, None)

    def requests(self, group_id: str) -> list[Request]:
        return [s.request for s in self._groups[group_id].seqs]

    def _detokenizer(self, r: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        p = r.params
        return IncrementalDetokenizer(self.tokenizer, r.prompt_token_ids, p.skip_special_tokens,
                                      p.stop, p.include_stop_str_in_output, p.min_tokens)

    # ---- after a step ---------------------------------------------------------------------
    def process(self, sched: SchedulerOutput, new_tokens: Iterable[NewTokens],
                result: StepResult) -> list[tuple[Request, str]]:
        """Record a finished step's prompt logprobs, token logprobs and text. Returns the live
        requests whose text now holds a stop string: the caller ends them."""
        if result.prompt_logprobs is not None:
            self._prompt_logprobs(sched, result.prompt_logprobs)
        stops = []
        for nt in new_tokens:
            seq = self._sequence(nt.request)
            if seq is None or nt.request.group_id in self._failed:
                continue
            try:
                stopped, used = self._detokenize(seq, nt.token_ids)
                if used < len(nt.token_ids):  # a multi-step decode ran past a stop string
                    del nt.request.output_token_ids[used - len(nt.token_ids):]
                    nt = dataclasses.replace(nt, token_ids=nt.token_ids[:used])
                self._token_logprobs(seq, nt, result)
                if stopped:
                    stops.append((nt.request, seq.detokenizer.stop_reason))
            except Exception as e:  # noqa: BLE001 - this request fails, the batch goes on
                self._failed[nt.request.group_id] = e
        return stops

    def _sequence(self, r: Request) -> _Sequence | None:
        group = self._groups.get(r.group_id)
        return group.seqs[r.index] if group is not None else None

    def _token_logprobs(self, seq: _Sequence, nt: NewTokens, result: StepResult) -> None:
        self.metrics.num_generation_tokens += len(nt.token_ids)
        r = seq.request
        if nt.token_ids and len(r.output_token_ids) == len(nt.token_ids):
            self.metrics.on_first_token(r.first_token_time - r.arrival_time)
        # token j of a row comes from the step's j-th decode step (a multi-step decode)
        for j, token in enumerate(nt.token_ids):
            seq.cumulative_logprob += float(result.logprobs[nt.row, j, 0])
            if r.params.logprobs is not None:
                seq.logprobs.append(self._position_logprobs(r.params.logprobs, nt.row, j,
                                                            token, result))

    def _detokenize(self, seq: _Sequence, token_ids: list[int]) -> tuple[bool, int]:
        """Add the text, a token at a time; (a stop string ends a request the scheduler left
        running, the tokens used: all, or those up to the one that completed a stop string).
        A stop string wins over a length stop in the same token, as it did before EOS/ids
        were checked."""
        detok, r = seq.detokenizer, seq.request
        if detok is None:
            return False, len(token_ids)
        shown = token_ids
        if r.stopped_by_token and not r.params.include_stop_str_in_output:
            shown = token_ids[:-1]  # vLLM's rule: the EOS or stop token's text is not shown
        used = len(token_ids)
        for j in range(max(len(shown), 1)):
            detok.add_tokens(shown[j:j + 1])
            if detok.finished:
                used = min(j + 1, used)
                break
        if detok.finished and (used < len(token_ids) or r.status in (
                RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH)):
            if r.is_finished:
                r.finish(RequestStatus.FINISHED_STOPPED, detok.stop_reason)
                return False, used
            return True, used
        if r.is_finished and not detok.finished:
            detok.flush()
        return False, used

    def _position_logprobs(self, k: int, i: int, j: int, token: int,
                           result: StepResult) -> PositionLogprobs:
        """Row i's logprobs at its j-th decode step of the step."""
        entry = {token: Logprob(float(result.logprobs[i, j, 0]), int(result.ranks[i, j]),
                                self._decode(token))}
        for rank, (tid, lp) in enumerate(zip(result.logprob_token_ids[i, j, 1:k + 1],
                                             result.logprobs[i, j, 1:k + 1], strict=True), 1):
            entry.setdefault(int(tid), Logprob(float(lp), rank, self._decode(int(tid))))
        return entry

    def _decode(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def _prompt_logprobs(self, sched: SchedulerOutput, tables: tuple[np.ndarray, ...]) -> None:
        offset = 0
        for c in sched.scheduled:
            group = self._groups.get(c.request.group_id)
            if c.request.wants_prompt_logprobs and group is not None:
                _record_prompt_logprobs(group.prompt_logprobs, c.request, c.num_computed,
                                        c.num_new, offset, tables)
            offset += c.num_new

    # ---- outputs --------------------------------------------------------------------------
    def outputs(self, group_ids: Iterable[str]) -> list[RequestOutput]:
        """The outputs due for these changed groups; finished groups are done with after."""
        outs = []
        for gid in group_ids:
            group = self._groups.get(gid)
            if group is None or gid in self._failed:
                continue
            try:
                out = self._due_output(gid, group)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._failed[gid] = e
                continue
            if out is not None:
                outs.append(out)
            if group.finished:
                self.metrics.on_finished(self.requests(gid))
                del self._groups[gid]
        return outs

    def _due_output(self, gid: str, group: _Group) -> RequestOutput | None:
        kind = group.head.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not group.finished:
            return None
        return self._output(gid, group, delta=kind is RequestOutputKind.DELTA)

    def final_output(self, group_id: str) -> RequestOutput | None:
        """An ended (aborted) group's last output, and forget it."""
        group = self._groups.pop(group_id)
        return self._output(group_id, group,
                            delta=group.head.params.output_kind is RequestOutputKind.DELTA)

    def _output(self, gid: str, group: _Group, *, delta: bool) -> RequestOutput | None:
        outputs = [c for s in group.seqs if (c := _completion(s, delta)) is not None]
        head = group.head
        prompt_lps = None
        if head.wants_prompt_logprobs and not (delta and group.sent_prompt_logprobs):
            prompt_lps = list(group.prompt_logprobs)
            group.sent_prompt_logprobs = delta
        if delta and not outputs and prompt_lps is None:
            return None
        return RequestOutput(
            request_id=gid, prompt=None, prompt_token_ids=head.prompt_token_ids,
            outputs=outputs, finished=group.finished, prompt_logprobs=prompt_lps,
            metrics=_request_metrics(group), num_cached_tokens=head.num_cached_tokens)


def _completion(s: _Sequence, delta: bool) -> CompletionOutput | None:
    """A sequence's output: all of it, or (delta) what is new, None if nothing is."""
    r = s.request
    start = s.sent_tokens if delta else 0
    tokens = r.output_token_ids[start:]
    text = s.text(delta)
    newly_finished = r.is_finished and not s.sent_finish
    if delta and not (tokens or text or newly_finished):
        return None
    wants_lp = r.params.logprobs is not None
    out = CompletionOutput(
        index=r.index, text=text, token_ids=list(tokens),
        cumulative_logprob=s.cumulative_logprob if wants_lp else None,
        logprobs=s.logprobs[start:] if wants_lp else None,
        finish_reason=r.status.value if r.is_finished else None, stop_reason=r.stop_reason)
    if delta:
        s.sent_tokens = len(r.output_token_ids)
        s.sent_parts = s.detokenizer.num_parts if s.detokenizer is not None else 0
        s.sent_finish = r.is_finished
    return out


def _request_metrics(group: _Group) -> RequestMetrics:
    head = group.head
    finished = max((s.request.finished_time or 0) for s in group.seqs) or None
    return RequestMetrics(arrival_time=head.arrival_time,
                          first_scheduled_time=head.first_scheduled_time,
                          first_token_time=head.first_token_time, finished_time=finished)


def _record_prompt_logprobs(out: list[PositionLogprobs | None], r: Request, start: int, n: int,
                            offset: int, tables: tuple[np.ndarray, ...]) -> None:
    """Prompt positions [start, start + n) of one chunk, from the step's per-token tables."""
    chosen, ranks, top_vals, top_ids = tables
    if start == 0 and not out:
        out.append(None)  # nothing predicts the first token
    k = r.params.prompt_logprobs
    for j in range(n):
        pos = start + j
        if pos + 1 >= r.num_prompt_tokens or len(out) > pos + 1:
            continue
        t = offset + j
        entry = {int(r.prompt_token_ids[pos + 1]): Logprob(float(chosen[t]), int(ranks[t]))}
        for v, tid in zip(top_vals[t, :k], top_ids[t, :k], strict=True):
            entry.setdefault(int(tid), Logprob(float(v), len(entry)))
        out.append(entry)
