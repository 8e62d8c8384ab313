"""Server-sent events in OpenAI's exact shape, and the merge of several engine streams.

All streaming lives here. The engine streams DELTA outputs (only what is new per step, text that
a stop string could still cut already held back there), so events are formatted straight from
them; what a final usage chunk and the metrics need (token counts, finish reasons) is summed on
the way. Closing a generator here (client gone) closes the engine streams, which aborts the
requests and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pjinfer.outputs import CompletionOutput, RequestOutput
from pjinfer.server.protocol import (
    GenerationRequest,
    Summary,
    chat_logprobs,
    completion_logprobs,
    error_for,
    token_usage,
    usage,
)
from pjinfer.tool_parsers.base import ToolCallStream

log = logging.getLogger("pjinfer.server")


def release_after(events: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    """`events`, then `release()` when the stream ends, or when it is dropped unstarted (a
    client gone before the first byte): a streamed response outlives its handler, so what it
    holds (an admission ticket, a model lease) goes back then. `release` must be idempotent."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            release()

    stream = guarded()
    weakref.finalize(stream, release)
    return stream
DONE = "data: [DONE]\n\n"
OnFinished = Callable[[Summary], None]
T = TypeVar("T")


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


async def gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    """All results in order; if one fails (or this is cancelled), the others are cancelled
    and awaited before the error goes on, so no engine request is left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def prime(streams: list[AsyncIterator[RequestOutput]]
                ) -> list[AsyncIterator[RequestOutput]]:
    """Wait for every stream's first output before the 200 header goes out, so a rejected
    request (bad prompt, queue full) still gets its proper status code."""
    try:
        firsts = await gather_or_cancel([anext(s) for s in streams])
    except BaseException:
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


async def hide_generated(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Prompt scoring (echo with max_tokens=0): the engine must generate a token, the client
    asked for none, so each choice is shown empty and finished for `length`."""
    try:
        async for out in stream:
            yield replace(out, outputs=[
                CompletionOutput(c.index, logprobs=None if c.logprobs is None else [],
                                 finish_reason="length" if c.finished else None)
                for c in out.outputs])
    finally:
        await stream.aclose()


async def collect(streams: list[AsyncIterator[RequestOutput]],
                  on_finished: OnFinished) -> list[RequestOutput]:
    """The final output of every stream (FINAL_ONLY: whole), in stream order."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in merge(streams):
        if out.finished:
            finals[i] = out
            on_finished(Summary.of(out))
    return [finals[i] for i in range(len(streams))]


@dataclass(slots=True)
class _Sent:
    """What one choice has sent so far."""

    text_len: int = 0
    tokens: int = 0
    started: bool = False
    finish_reason: str | None = None
    tools: ToolCallStream | None = None  # a chat choice read as tool calls


class _Tally:
    """Per stream: its choices' progress, and the prompt logprobs of its first output."""

    def __init__(self) -> None:
        self.choices: dict[int, _Sent] = {}
        self.prompt_logprobs: Any = None

    def see(self, out: RequestOutput) -> RequestOutput:
        """Remember the prompt logprobs (only the first DELTA output has them); returns `out`
        with them, for an echo whose choice starts later."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        return replace(out, prompt_logprobs=self.prompt_logprobs)

    def choice(self, index: int) -> _Sent:
        return self.choices.setdefault(index, _Sent())

    def summary(self, out: RequestOutput) -> Summary:
        sents = [self.choices[i] for i in sorted(self.choices)]
        return Summary(out.prompt_token_ids, out.metrics, [s.tokens for s in sents],
                       [s.finish_reason for s in sents])


async def completion_events(req: GenerationRequest, streams: list[AsyncIterator[RequestOutput]],
                            tokenizer: Any, on_finished: OnFinished) -> AsyncIterator[str]:
    """`text_completion` chunks, one choice each; usage chunk; [DONE]."""
    head = {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model}
    tallies = [_Tally() for _ in streams]
    finals: list[Summary] = []
    async with _errors_as_events(req.id) as errors:
        async for p, out in merge(streams):
            out = tallies[p].see(out)
            for c in out.outputs:
                index = p * req.params.n + c.index
                sent = tallies[p].choice(c.index)
                choice = _completion_choice(req, p, out, c, sent, tokenizer, index)
                if choice is not None:
                    yield sse({**head, "choices": [choice],
                               **_chunk_usage(req, req.prompts[p], sent.tokens)})
            if out.finished:
                finals.append(tallies[p].summary(out))
                on_finished(finals[-1])
    for event in errors:
        yield event
    if req.include_usage and not errors:
        yield sse({**head, "choices": [], "usage": usage(finals)})
    yield DONE


def _advance(sent: _Sent, c: CompletionOutput) -> int:
    """Count a delta as sent; returns the text offset it starts at."""
    offset = sent.text_len
    sent.text_len += len(c.text)
    sent.tokens += len(c.token_ids)
    sent.finish_reason = c.finish_reason
    return offset


def _completion_choice(req: GenerationRequest, p: int, out: RequestOutput, c: CompletionOutput,
                       sent: _Sent, tokenizer: Any, index: int) -> dict[str, Any] | None:
    offset = _advance(sent, c)
    echo = req.echo_texts[p] if req.echo_texts and not sent.started else ""
    if not (c.text or echo or c.finished):
        return None
    logprobs = completion_logprobs(req, out, c, tokenizer, 0, offset, with_prompt=bool(echo))
    sent.started = True
    sent.text_len += len(echo)  # later text offsets count the echoed prompt
    return {"index": index, "text": echo + c.text, "logprobs": logprobs,
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
                   **_chunk_usage(req, req.prompts[0], 0)})
    tally, final = _Tally(), None
    async with _errors_as_events(req.id) as errors:
        async for _, out in merge([stream]):
            for c in out.outputs:
                sent = tally.choice(c.index)
                choice = _chat_choice(req, c, sent, tokenizer)
                if choice is not None:
                    yield sse({**head, "choices": [choice],
                               **_chunk_usage(req, req.prompts[0], sent.tokens)})
            if out.finished:
                final = tally.summary(out)
                on_finished(final)
    for event in errors:
        yield event
    if req.include_usage and final is not None:
        yield sse({**head, "choices": [], "usage": usage([final])})
    yield DONE


def _chat_choice(req: GenerationRequest, c: CompletionOutput, sent: _Sent,
                 tokenizer: Any) -> dict[str, Any] | None:
    _advance(sent, c)
    delta, finish_reason = ({"content": c.text} if c.text else {}), c.finish_reason
    held = False  # text the tool parser holds back: its tokens' logprobs still go out
    if req.tools is not None:  # content and tool call deltas, from the text so far
        sent.tools = sent.tools or req.tools.stream()
        delta = sent.tools.feed(c.text, c.finished)
        finish_reason = req.tools.finish_reason(c.finish_reason, sent.tools.called)
        held = req.params.logprobs is not None and bool(c.logprobs)
    if not (delta or c.finished or held):
        return None
    logprobs = chat_logprobs(c.logprobs, tokenizer, req.params.logprobs,
                             req.return_tokens_as_token_ids)
    return {"index": c.index, "delta": delta, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": c.stop_reason}


def _chunk_usage(req: GenerationRequest, prompt: list[int], tokens: int) -> dict[str, Any]:
    """With include_usage, OpenAI sends `usage: null` on every chunk but the last; with
    vLLM's continuous_usage_stats too, each chunk has its choice's usage so far."""
    if not req.include_usage:
        return {}
    if not req.continuous_usage:
        return {"usage": None}
    return {"usage": token_usage(len(prompt), tokens)}


@contextlib.asynccontextmanager
async def _errors_as_events(request_id: str) -> AsyncIterator[list[str]]:
    """A failure after the 200 header went out can only be reported as an error event; an
    internal fault (no error code) is also logged, once, with the request id."""
    events: list[str] = []
    try:
        yield events
    except Exception as e:  # noqa: BLE001 - reported to the client, then the stream ends
        error = error_for(e)
        if error.status >= 500 and error.code is None:
            log.error("request %s failed while streaming", request_id, exc_info=e)
        events.append(sse(error.body()))
