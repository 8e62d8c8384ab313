"""Server-sent events in OpenAI's exact shape, and the merge of several engine streams.

All streaming lives here. Text deltas are computed from cumulative outputs; while a stop string
may still be forming, its possible prefix is held back so a client never sees text that is
cut later. Closing a generator here (client gone) closes the engine streams, which aborts the
requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pjinfer.outputs import CompletionOutput, RequestOutput
from pjinfer.server.protocol import (
    GenerationRequest,
    chat_logprobs,
    completion_logprobs,
    error_for,
    usage,
)

DONE = "data: [DONE]\n\n"
OnFinished = Callable[[RequestOutput], None]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several engine streams as (stream index, output); closing this aborts all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, s, queue)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(tasks)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(i: int, stream: AsyncIterator[RequestOutput], queue: asyncio.Queue) -> None:
    try:
        async for out in stream:
            queue.put_nowait((i, out))
        queue.put_nowait(None)
    except Exception as e:  # handed to the consumer, which raises it
        queue.put_nowait(e)


async def prime(streams: list[AsyncIterator[RequestOutput]]
                ) -> list[AsyncIterator[RequestOutput]]:
    """Wait for every stream's first output before the 200 header goes out, so a rejected
    request (bad prompt, queue full) still gets its proper status code."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        firsts = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
        raise
    return [_chain(first, s) for first, s in zip(firsts, streams, strict=True)]


async def _chain(first: RequestOutput, rest: AsyncIterator[RequestOutput]
                 ) -> AsyncIterator[RequestOutput]:
    try:
        yield first
        if not first.finished:
            async for out in rest:
                yield out
    finally:
        await rest.aclose()


async def collect(streams: list[AsyncIterator[RequestOutput]],
                  on_finished: OnFinished) -> list[RequestOutput]:
    """The final output of every stream, in stream order."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge(streams):
        if out.finished:
            finals[i] = out
            on_finished(out)
    return [finals[i] for i in range(len(streams))]


@dataclass(slots=True)
class _Sent:
    """How much of one choice the client already has."""

    text: str = ""
    tokens: int = 0
    started: bool = False
    done: bool = False


def _advance(sent: _Sent, c: CompletionOutput) -> tuple[str, int]:
    """(new text, first new token position); updates what was sent."""
    # The engine's text is only what is safe to stream: characters a stop string could still
    # cut are held back there (IncrementalDetokenizer), never sent and taken back.
    text = c.text
    delta = text[len(sent.text):] if text.startswith(sent.text) else ""
    sent.text += delta
    start, sent.tokens = sent.tokens, len(c.token_ids)
    sent.done = c.finished
    return delta, start


async def completion_events(req: GenerationRequest, streams: list[AsyncIterator[RequestOutput]],
                            tokenizer: Any, on_finished: OnFinished) -> AsyncIterator[str]:
    """`text_completion` chunks, one choice each; usage chunk; [DONE]."""
    head = {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model}
    sent: dict[int, _Sent] = {}
    finals: list[RequestOutput] = []
    async with _errors_as_events() as errors:
        async for p, out in merge(streams):
            for c in out.outputs:
                index = p * req.params.n + c.index
                choice = _completion_choice(req, p, out, c, sent.setdefault(index, _Sent()),
                                            tokenizer, index)
                if choice is not None:
                    yield sse({**head, "choices": [choice], **_no_usage(req)})
            if out.finished:
                finals.append(out)
                on_finished(out)
    for event in errors:
        yield event
    if req.include_usage and not errors:
        yield sse({**head, "choices": [], "usage": usage(finals)})
    yield DONE


def _completion_choice(req: GenerationRequest, p: int, out: RequestOutput, c: CompletionOutput,
                       sent: _Sent, tokenizer: Any, index: int) -> dict[str, Any] | None:
    if sent.done:
        return None
    offset = len(sent.text)
    delta, start = _advance(sent, c)
    echo = req.echo_texts[p] if req.echo_texts and not sent.started else ""
    if not (delta or echo or c.finished):
        return None
    logprobs = completion_logprobs(req, out, c, tokenizer, start, offset, with_prompt=bool(echo))
    sent.started = True
    return {"index": index, "text": echo + delta, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


async def chat_events(req: GenerationRequest, stream: AsyncIterator[RequestOutput],
                      tokenizer: Any, on_finished: OnFinished) -> AsyncIterator[str]:
    """`chat.completion.chunk`s: a role delta per choice first, then content deltas."""
    head = {"id": req.id, "object": "chat.completion.chunk", "created": req.created,
            "model": req.model}
    for i in range(req.params.n):
        yield sse({**head, "choices": [{"index": i, "delta": {"role": "assistant",
                                                               "content": ""},
                                        "logprobs": None, "finish_reason": None}],
                   **_no_usage(req)})
    sent = [_Sent() for _ in range(req.params.n)]
    final = None
    async with _errors_as_events() as errors:
        async for _, out in merge([stream]):
            for c in out.outputs:
                choice = _chat_choice(req, c, sent[c.index], tokenizer)
                if choice is not None:
                    yield sse({**head, "choices": [choice], **_no_usage(req)})
            if out.finished:
                final = out
                on_finished(out)
    for event in errors:
        yield event
    if req.include_usage and final is not None:
        yield sse({**head, "choices": [], "usage": usage([final])})
    yield DONE


def _chat_choice(req: GenerationRequest, c: CompletionOutput, sent: _Sent,
                 tokenizer: Any) -> dict[str, Any] | None:
    if sent.done:
        return None
    delta, start = _advance(sent, c)
    if not (delta or c.finished):
        return None
    logprobs = chat_logprobs((c.logprobs or [])[start:] if c.logprobs is not None else None,
                             tokenizer, req.params.logprobs)
    return {"index": c.index, "delta": {"content": delta} if delta else {},
            "logprobs": logprobs, "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason}


def _no_usage(req: GenerationRequest) -> dict[str, Any]:
    """With include_usage, OpenAI sends `usage: null` on every chunk but the last."""
    return {"usage": None} if req.include_usage else {}


@contextlib.asynccontextmanager
async def _errors_as_events() -> AsyncIterator[list[str]]:
    """A failure after the 200 header went out can only be reported as an error event."""
    events: list[str] = []
    try:
        yield events
    except Exception as e:  # noqa: BLE001 - reported to the client, then the stream ends
        events.append(sse(error_for(e).body()))
