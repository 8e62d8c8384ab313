"""The server on an engine that decodes several steps per device call (`--num-scheduler-steps`):
streamed completions and chats equal the single-step server's, their per-token logprobs line
up with the streamed text however many tokens a chunk carries, and a client that leaves
mid-stream frees its KV blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from tests.server.conftest import API_KEY, MODEL, NUM_KV_BLOCKS, LiveServer, start_server

PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def multi_step_server() -> Iterator[LiveServer]:
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=NUM_KV_BLOCKS,
                                      max_num_seqs=64, max_num_batched_tokens=512,
                                      num_scheduler_steps=4))
    server, thread, base_url = start_server(engine, api_key=API_KEY, drain_timeout=5)
    yield LiveServer(base_url, engine)
    server.should_exit = True
    thread.join(timeout=30)


def _stream(server: LiveServer) -> tuple[str, list[str], int]:
    """(text, each token's logprob entry, chunks) of a greedy streamed completion."""
    stream = server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=21, temperature=0.0, logprobs=1, stream=True)
    text, tokens, chunks = "", [], 0
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs)
        chunks += 1
    return text, tokens, chunks


def test_streamed_completion_equals_single_steps(live_server, multi_step_server):
    text, tokens, _ = _stream(multi_step_server)
    assert (text, tokens) == _stream(live_server)[:2]
    assert "".join(tokens) == text and len(tokens) == 21


def test_chat_equals_single_steps(live_server, multi_step_server):
    def chat(server: LiveServer) -> str:
        out = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=17,
            temperature=0.0)
        return out.choices[0].message.content
    assert chat(multi_step_server) == chat(live_server)
    assert multi_step_server.engine.engine.runner._multi._compiled, "no multi-step decode ran"


def test_client_leaving_mid_stream_frees_its_blocks(multi_step_server):
    stream = multi_step_server.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    metrics = multi_step_server.wait_idle()
    assert metrics["pjinfer:kv_blocks_used"] == 0
    assert metrics["pjinfer:num_requests_running"] == 0
