"""The OpenAI endpoints through the official `openai` client: answers are the Zen of Python."""

from __future__ import annotations

import asyncio
import json

import httpx

from pjinfer.demo import zen_of_python
from tests.server.conftest import MODEL

PROMPT = "Beautiful is better than"
QUESTION = [{"role": "user", "content": "What is the Zen of Python?"}]


def test_models_lists_the_served_model(live_server):
    models = live_server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == live_server.engine.max_model_len
    assert models.data[0].quantization == {"method": None, "kv_cache_dtype": "float32"}


def test_completion_greedy(live_server):
    r = live_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == " ugly.\nEx"[: len(r.choices[0].text)]
    assert r.choices[0].text.startswith(" ugly")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_chat_answers_the_whole_zen(live_server):
    r = live_server.client().chat.completions.create(model=MODEL, messages=QUESTION,
                                                     temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip() == zen_of_python().strip()
    assert r.choices[0].finish_reason == "stop"


def test_chat_content_as_text_parts(live_server):
    messages = [{"role": "system", "content": "You answer questions."},
                {"role": "user", "content": [{"type": "text", "text": "What is the Zen "},
                                             {"type": "text", "text": "of Python?"}]}]
    r = live_server.client().chat.completions.create(model=MODEL, messages=messages,
                                                     temperature=0, max_tokens=8)
    plain = live_server.client().chat.completions.create(
        model=MODEL, messages=[messages[0], {"role": "user", "content":
                                             "What is the Zen of Python?"}],
        temperature=0, max_tokens=8)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_streamed_completion_equals_the_whole_one(live_server):
    client = live_server.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_streamed_chat_role_first_then_usage(live_server):
    chunks = list(live_server.client().chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert zen_of_python().startswith(text) and len(text) > 20
    assert chunks[-2].choices[0].finish_reason == "length"


def test_continuous_usage_stats_on_every_chunk(live_server):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its choice's usage so
    far (the role chunk none yet), growing to the final usage chunk's count."""
    client = live_server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=10, stream=True,
        stream_options=options))
    prompt = chat[-1].usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in chat]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-2] == counts[-1] == 10
    assert all(c.usage.prompt_tokens == prompt for c in chat)
    assert all(c.usage.total_tokens == prompt + c.usage.completion_tokens for c in chat)
    chunks = list(client.completions.create(model=MODEL, prompt=[PROMPT, "Simple is"],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options=options))
    last = {}
    for c in chunks[:-1]:
        last[c.choices[0].index] = c.usage.completion_tokens
    assert last == {0: 5, 1: 5} and chunks[-1].usage.completion_tokens == 10
    plain = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                           stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_raw_sse_framing(live_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", live_server.base_url + "/v1/completions", json=body,
                      headers={"Authorization": "Bearer test-key"}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[6:])["object"] == "text_completion"


def test_n2_and_prompt_batch_indices(live_server):
    r = live_server.client().completions.create(
        model=MODEL, prompt=[PROMPT, "Explicit is better than"], n=2, max_tokens=3,
        temperature=0)
    texts = {c.index: c.text for c in r.choices}
    assert sorted(texts) == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[0].startswith(" ugly")
    assert texts[2] == texts[3] and texts[2].startswith(" impl")
    sampled = live_server.client().chat.completions.create(
        model=MODEL, messages=QUESTION, n=2, max_tokens=4, temperature=1.0, seed=7)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert sampled.usage.completion_tokens == 8


def test_stop_string_cuts_and_is_never_streamed(live_server):
    client = live_server.client()
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                  stop=["Explicit"])
    assert r.choices[0].text == " ugly.\n"
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                            temperature=0, stop=["Explicit"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == " ugly.\n"
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                     stop=["Explicit"], extra_body={
                                         "include_stop_str_in_output": True})
    assert kept.choices[0].text == " ugly.\nExplicit"


def test_completion_logprobs(live_server):
    r = live_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                                temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.token_logprobs) == 3 and all(-1.0 < v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])


def test_echo_with_logprobs_covers_the_prompt(live_server):
    r = live_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                                temperature=0, echo=True, logprobs=1)
    assert r.choices[0].text.startswith(PROMPT + " u")
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert len(lp.tokens) == r.usage.prompt_tokens + 2


def test_chat_logprobs(live_server):
    r = live_server.client().chat.completions.create(model=MODEL, messages=QUESTION,
                                                     max_tokens=3, temperature=0,
                                                     logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token
               for t in content)
    assert bytes(content[0].bytes).decode() == content[0].token


def test_64_concurrent_streams(live_server):
    async def one(client, i: int) -> str:
        stream = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6 + i % 3,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def all_of_them() -> list[str]:
        async with live_server.async_client(timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    texts = asyncio.run(all_of_them())
    expected = live_server.client().completions.create(model=MODEL, prompt=PROMPT,
                                                       max_tokens=8, temperature=0)
    for i, text in enumerate(texts):
        assert expected.choices[0].text.startswith(text) and len(text) >= 6, (i, text)
    assert live_server.wait_idle()["pjinfer:kv_blocks_used"] == 0
