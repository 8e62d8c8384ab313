"""Beam search on /v1/completions and /v1/chat/completions (vLLM's `use_beam_search`).

`n` is the beam width. The search runs outside the engine, as `LLM.beam_search` does
(pjinfer.beam_search): every step sends one one-token request per live beam, with the top 2W
log-probabilities, concurrently through the AsyncEngine, and gathers them before the next step.
The answer is the usual OpenAI response with `n` choices, best first, each the generated text
only. Beams are not streamed (vLLM does not stream them either).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pjinfer.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import RequestOutputKind, SamplingParams
from pjinfer.server.protocol import APIError, GenerationRequest, ModelInfo, Summary, usage
from pjinfer.server.streaming import gather_or_cancel
from pjinfer.server.validation import get_field

Parse = Callable[[dict[str, Any], ModelInfo, str], GenerationRequest]

# SamplingParams fields a beam search cannot honour: each must keep its default
_DEFAULTS = SamplingParams()
INCOMPATIBLE = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "stop", "stop_token_ids", "min_tokens", "logprobs",
                "prompt_logprobs", "logit_bias", "structured_outputs", "allowed_token_ids",
                "bad_words")


def with_beam(parse: Parse) -> Parse:
    """A request parser that also reads `use_beam_search` (after every usual check)."""

    def parse_with_beam(body: dict[str, Any], info: ModelInfo, request_id: str
                        ) -> GenerationRequest:
        req = parse(body, info, request_id)
        if req.tools is not None and get_field(body, "use_beam_search", "bool", False):
            raise APIError("tool calls are not supported with use_beam_search; leave tools "
                           "out or set tool_choice to \"none\"", param="tools")
        beam = parse_beam(body, req.params, req.prompts, info)
        return req if beam is None else dataclasses.replace(req, beam=beam)

    return parse_with_beam


def parse_beam(body: dict[str, Any], params: SamplingParams, prompts: list[list[int]],
               info: ModelInfo) -> BeamSearchParams | None:
    """The beam settings of a `use_beam_search` request (None without it); a field the search
    cannot honour is a 400 naming it."""
    if not get_field(body, "use_beam_search", "bool", False):
        return None
    if get_field(body, "stream", "bool", False):
        raise APIError("stream is not supported with use_beam_search: beams are only known "
                       "at the end; leave stream out or false", param="stream")
    if get_field(body, "echo", "bool", False):
        raise APIError("echo is not supported with use_beam_search", param="echo")
    for name in INCOMPATIBLE:
        if getattr(params, name) != getattr(_DEFAULTS, name):
            raise APIError(f"{name} is not supported with use_beam_search (the search keeps "
                           f"the most likely beams); leave it out", param=name)
    room = info.max_model_len - max(map(len, prompts))
    try:
        beam = BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens or room,
            ignore_eos=params.ignore_eos,
            temperature=params.temperature if body.get("temperature") is not None else 0.0,
            length_penalty=get_field(body, "length_penalty", "number", 1.0))
        beam.check_logprobs(info.max_logprobs)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise APIError(f"n (the beam width): {e}" if field == "beam_width" else str(e),
                       param="n" if field == "beam_width" else field) from None
    return beam


async def run(engine: AsyncEngine, req: GenerationRequest) -> list[BeamSearchOutput]:
    """The best `n` beams of every prompt; cancelling this aborts the step's requests."""
    assert req.beam is not None
    search = BeamSearch(req.prompts, req.beam, engine.eos_token_id)
    params = dataclasses.replace(search.sampling_params(),
                                 output_kind=RequestOutputKind.FINAL_ONLY)
    step = 0
    while not search.done:
        outs = await gather_or_cancel([
            _final(engine, tokens, params, f"{req.id}-beam{step}-{i}", req.priority)
            for i, tokens in enumerate(search.requests())])
        search.advance([out.outputs[0].logprobs[0] for out in outs])
        step += 1
    return search.results(None)


async def _final(engine: AsyncEngine, tokens: list[int], params: SamplingParams,
                 request_id: str, priority: int) -> RequestOutput:
    stream = engine.generate(tokens, params, request_id=request_id, priority=priority)
    try:
        async for out in stream:
            if out.finished:
                return out
        raise RuntimeError(f"beam request {request_id} ended without a final output")
    finally:
        await stream.aclose()


def _choices(req: GenerationRequest, results: list[BeamSearchOutput], tokenizer: Any
             ) -> list[tuple[int, str, str | None]]:
    """(index, generated text, finish reason) of every beam, prompt by prompt, best first."""
    skip = req.params.skip_special_tokens
    return [(p * req.params.n + j, tokenizer.decode(seq.output_token_ids,
                                                    skip_special_tokens=skip),
             seq.finish_reason)
            for p, out in enumerate(results) for j, seq in enumerate(out.sequences)]


def summaries(req: GenerationRequest, results: list[BeamSearchOutput]) -> list[Summary]:
    """One per prompt, for usage and the request metrics."""
    return [Summary(prompt, None, [len(s.output_token_ids) for s in out.sequences],
                    [s.finish_reason for s in out.sequences])
            for prompt, out in zip(req.prompts, results, strict=True)]


def completion_response(req: GenerationRequest, results: list[BeamSearchOutput],
                        tokenizer: Any) -> dict[str, Any]:
    choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": reason,
                "stop_reason": None} for i, text, reason in _choices(req, results, tokenizer)]
    return {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage(summaries(req, results))}


def chat_response(req: GenerationRequest, results: list[BeamSearchOutput],
                  tokenizer: Any) -> dict[str, Any]:
    choices = [{"index": i, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": reason, "stop_reason": None}
               for i, text, reason in _choices(req, results, tokenizer)]
    return {"id": req.id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage(summaries(req, results))}
