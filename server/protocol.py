"""The OpenAI wire format: error bodies, validated requests, and engine outputs as JSON.

Request bodies are checked in server.validation; this module holds what both directions share
(`APIError` and the mapping of exceptions to it, the request and model records) and turns
engine outputs into whole responses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from pjinfer.beam_search import BeamSearchParams
from pjinfer.errors import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    ServerShuttingDownError,
)
from pjinfer.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pjinfer.sampling_params import SamplingParams
from pjinfer.tool_parsers.choice import ToolChoice

# Names a SamplingParams message may start with; besides the fields, the body keys they
# come from under another name.
PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)} | {"top_logprobs"}


class APIError(Exception):
    """An error the client sees as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = (
            message, status, param, type, code)
        self.retry_after = retry_after  # seconds, sent as Retry-After (429 and 503)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_for(exc: BaseException) -> APIError:
    """The API error a client sees for an exception from validation or the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), status=503, type="server_overloaded", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status=503, type="server_error", code="engine_dead")
    if isinstance(exc, ServerShuttingDownError):
        return APIError(str(exc), status=503, type="server_error", code="shutting_down")
    if isinstance(exc, RequestFailedError):  # a fault of ours, for this request alone
        return APIError(str(exc), status=500, type="server_error")
    if isinstance(exc, ValueError):
        return APIError(str(exc), param=param_of(str(exc)))
    return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                    type="server_error")


def param_of(message: str) -> str | None:
    """SamplingParams messages start with the field name: point `param` at it."""
    head = message.split(" ", 1)[0].split("/", 1)[0]
    return head if head in PARAM_NAMES else None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    served_model_name: str
    max_model_len: int
    tokenizer: Any
    vocab_size: int
    max_logprobs: int = 20  # the engine's; beam search needs 2 x width of them per step
    # compiles a StructuredOutputsParams (cached by the engine); ValueError if it is invalid
    check_structured: Callable[[Any], None] | None = None
    tool_parser: str | None = None  # --tool-call-parser, with --enable-auto-tool-choice only
    lora_names: Callable[[], Collection[str]] = tuple  # adapters servable now, by name
    chat_template: str | None = None  # --chat-template: instead of the tokenizer's
    trust_request_chat_template: bool = False  # a request may bring its own chat_template


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completions or chat request: token-id prompts plus shared sampling params."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: usage on every chunk
    echo_texts: tuple[str, ...] | None = None  # completions `echo`: one text per prompt
    priority: int = 0
    # echo with max_tokens=0 (prompt scoring): the engine generates one token, never shown
    prompt_only: bool = False
    beam: BeamSearchParams | None = None  # use_beam_search: n is the width (server.beam)
    tools: ToolChoice | None = None  # chat: read the output as tool calls
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"

# ---- responses ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Summary:
    """A finished request as usage and metrics see it (summed over a stream's deltas)."""

    prompt_token_ids: list[int]
    metrics: RequestMetrics | None
    num_tokens: list[int]  # per choice
    finish_reasons: list[str | None]  # per choice

    @classmethod
    def of(cls, out: RequestOutput) -> Summary:
        """From a whole (cumulative or final-only) output."""
        return cls(out.prompt_token_ids, out.metrics, [len(c.token_ids) for c in out.outputs],
                   [c.finish_reason for c in out.outputs])


def usage(finished: list[Summary]) -> dict[str, int]:
    return token_usage(sum(len(s.prompt_token_ids) for s in finished),
                       sum(sum(s.num_tokens) for s in finished))


def token_usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_response(req: GenerationRequest, outputs: list[RequestOutput],
                        tokenizer: Any) -> dict[str, Any]:
    choices = []
    for p, out in enumerate(outputs):
        for c in out.outputs:
            prefix = req.echo_texts[p] if req.echo_texts else ""
            choices.append({
                "index": p * req.params.n + c.index, "text": prefix + c.text,
                "logprobs": completion_logprobs(req, out, c, tokenizer),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices,
            "usage": usage([Summary.of(o) for o in outputs])}


def chat_response(req: GenerationRequest, out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    choices = []
    for c in out.outputs:
        message, finish_reason = ({"role": "assistant", "content": c.text}, c.finish_reason) \
            if req.tools is None else req.tools.message(c.text, c.finish_reason)
        choices.append({
            "index": c.index, "message": message,
            "logprobs": chat_logprobs(c.logprobs, tokenizer, req.params.logprobs,
                                      req.return_tokens_as_token_ids),
            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
    return {"id": req.id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage([Summary.of(out)])}


def completion_logprobs(req: GenerationRequest, out: RequestOutput, c: CompletionOutput,
                        tokenizer: Any, start: int = 0, text_offset: int = 0,
                        with_prompt: bool = True) -> dict[str, Any] | None:
    """OpenAI's legacy {tokens, token_logprobs, top_logprobs, text_offset}, from position
    `start` of the completion; an echoed prompt's positions come first."""
    if req.params.logprobs is None:
        return None
    # (token id, its logprobs, whether its text is in the choice's text)
    positions: list[tuple[int, PositionLogprobs | None, bool]] = []
    special = set(tokenizer.all_special_ids)
    if req.echo_texts and with_prompt:  # the echo is the prompt as sent: no BOS text in it
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        positions += [(tid, lp, tid not in special)
                      for tid, lp in zip(out.prompt_token_ids, prompt_lps, strict=False)]
    skip = req.params.skip_special_tokens
    positions += [(tid, lp, not (skip and tid in special))
                  for tid, lp in zip(c.token_ids[start:], (c.logprobs or [])[start:],
                                     strict=False)]
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    as_ids = req.return_tokens_as_token_ids
    for tid, entry, in_text in positions:
        token = _token_text(tokenizer, tid, entry.get(tid) if entry else None)
        result["tokens"].append(_id_name(tid) if as_ids else token)
        result["token_logprobs"].append(entry[tid].logprob if entry else None)
        result["top_logprobs"].append({_token_name(tokenizer, t, lp, as_ids): lp.logprob
                                       for t, lp in _top(entry, req.params.logprobs)}
                                      if entry else None)
        result["text_offset"].append(text_offset)  # offsets count the text, ids or not
        text_offset += len(token) if in_text else 0
    return result


def chat_logprobs(logprobs: list[PositionLogprobs] | None, tokenizer: Any,
                  top_n: int | None, as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI's chat format: {content: [{token, logprob, bytes, top_logprobs}]}; `as_ids`:
    each token named "token_id:N" (vLLM's return_tokens_as_token_ids)."""
    if top_n is None or logprobs is None:
        return None
    content = []
    for entry in logprobs:
        tid, chosen = next(iter(entry.items()))  # the engine puts the chosen token first
        content.append({**_chat_token(tokenizer, tid, chosen, as_ids), "top_logprobs": [
            _chat_token(tokenizer, t, lp, as_ids) for t, lp in _top(entry, top_n)]})
    return {"content": content}


def _chat_token(tokenizer: Any, tid: int, lp: Logprob, as_ids: bool) -> dict[str, Any]:
    token = _token_name(tokenizer, tid, lp, as_ids)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def _top(entry: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The n most likely tokens by rank (the chosen token only if it is among them)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n),
                  key=lambda item: item[1].rank)[:n]


def _token_name(tokenizer: Any, tid: int, lp: Logprob | None, as_ids: bool) -> str:
    return _id_name(tid) if as_ids else _token_text(tokenizer, tid, lp)


def _id_name(tid: int) -> str:
    return f"token_id:{tid}"  # vLLM's return_tokens_as_token_ids


def _token_text(tokenizer: Any, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])
