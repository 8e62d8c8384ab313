"""LoRA through the OpenAI-compatible server with the `openai` client, on the demo model:
adapters as models, completions and chat equal to peft, run-time load/unload while a stream
runs, 404 / 403 / 400 answers, the lora_requests_info metric."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from pjinfer.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from pjinfer.engine.async_engine import AsyncEngine
from pjinfer.engine.config import EngineConfig
from pjinfer.tokenizer import apply_chat_template
from tests.lora.conftest import ADAPTERS, LoRAModels, build_adapter, peft_greedy
from tests.server.conftest import API_KEY, LiveServer, start_server

N = 6
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def demo_lora(tmp_path_factory) -> LoRAModels:
    root = tmp_path_factory.mktemp("demo_lora")
    return LoRAModels(DEMO_MODEL_DIR, {
        name: build_adapter(DEMO_MODEL_DIR, root, name, *spec, seed=10 + i)
        for i, (name, spec) in enumerate(ADAPTERS.items())})


@pytest.fixture(scope="module")
def lora_server(demo_lora):
    engine = AsyncEngine(EngineConfig(warmup=False, num_kv_blocks=256, max_num_seqs=16,
                                      max_num_batched_tokens=256, enable_lora=True,
                                      max_loras=2, max_lora_rank=16, dtype="float32"))
    modules = tuple((name, str(demo_lora.adapters[name])) for name in ("all7", "qv_rs"))
    server, thread, url = start_server(engine, api_key=API_KEY, drain_timeout=5,
                                       lora_modules=modules, allow_runtime_lora_updating=True)
    yield LiveServer(url, engine), server.config.app.state.server
    server.should_exit = True
    thread.join(timeout=30)


def _expected(demo_lora, tokenizer, name, prompt_ids, n=N):
    tokens, logprobs = peft_greedy(demo_lora, name, prompt_ids, n)
    text = tokenizer.decode(tokens, skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)
    return text, logprobs


def _check(choice_text, choice_logprobs, expected):
    text, logprobs = expected
    assert choice_text == text
    assert max(abs(a - b) for a, b in zip(choice_logprobs, logprobs, strict=True)) < 1e-3


def test_models_lists_adapters_with_parent(lora_server):
    live, _ = lora_server
    models = {m.id: m for m in live.client().models.list().data}
    assert set(models) == {DEMO_MODEL_NAME, "all7", "qv_rs"}
    assert models["all7"].parent == DEMO_MODEL_NAME and models[DEMO_MODEL_NAME].parent is None
    assert live.client().models.retrieve("qv_rs").id == "qv_rs"


def test_concurrent_completions_and_chat_match_peft(lora_server, demo_lora):
    live, _ = lora_server
    tok = live.engine.tokenizer
    prompt = "Beautiful is better than"
    ids = tok.encode(prompt)
    messages = [{"role": "user", "content": "Errors should never pass"}]
    chat_ids = apply_chat_template(tok, messages)

    async def run():
        client = live.async_client()
        completions = [client.completions.create(model=m, prompt=prompt, max_tokens=N,
                                                 temperature=0, logprobs=1, extra_body=NO_EOS)
                       for m in (DEMO_MODEL_NAME, "all7", "qv_rs", "all7")]
        chat = client.chat.completions.create(model="qv_rs", messages=messages, max_tokens=N,
                                              temperature=0, logprobs=True,
                                              extra_body=NO_EOS)
        return await asyncio.gather(*completions, chat)

    *completions, chat = asyncio.run(run())
    for model, out in zip((None, "all7", "qv_rs", "all7"), completions, strict=True):
        c = out.choices[0]
        _check(c.text, c.logprobs.token_logprobs, _expected(demo_lora, tok, model, ids))
    c = chat.choices[0]
    assert chat.model == "qv_rs"
    _check(c.message.content, [t.logprob for t in c.logprobs.content],
           _expected(demo_lora, tok, "qv_rs", chat_ids))


def test_unknown_adapter_is_404(lora_server):
    live, _ = lora_server
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        live.client().completions.create(model="nope", prompt="a", max_tokens=2)


def test_load_serve_unload_reload_while_streaming(lora_server, demo_lora):
    live, _ = lora_server
    tok = live.engine.tokenizer
    prompt = "Now is better than"
    ids = tok.encode(prompt)
    long_n = 40

    async def run():
        client = live.async_client()
        stream = await client.completions.create(model="all7", prompt=prompt, max_tokens=long_n,
                                                 temperature=0, stream=True, logprobs=1,
                                                 extra_body=NO_EOS)
        text, lps, events = "", [], 0
        async for event in stream:
            text += event.choices[0].text
            lps += event.choices[0].logprobs.token_logprobs if event.choices[0].logprobs else []
            events += 1
            if events == 2:  # mid-stream: load, use, unload the one in use, reload
                r = live.post("/v1/load_lora_adapter", json={
                    "lora_name": "mlp16", "lora_path": str(demo_lora.adapters["mlp16"])})
                assert r.status_code == 200, r.text
                out = await client.completions.create(model="mlp16", prompt=prompt,
                                                      max_tokens=N, temperature=0, logprobs=1,
                                                      extra_body=NO_EOS)
                _check(out.choices[0].text, out.choices[0].logprobs.token_logprobs,
                       _expected(demo_lora, tok, "mlp16", ids))
                assert live.post("/v1/unload_lora_adapter",
                                 json={"lora_name": "all7"}).status_code == 200
                with pytest.raises(openai.NotFoundError):
                    await client.completions.create(model="all7", prompt=prompt, max_tokens=2)
                r = live.post("/v1/load_lora_adapter", json={
                    "lora_name": "all7", "lora_path": str(demo_lora.adapters["all7"])})
                assert r.status_code == 200, r.text
        return text, lps

    text, lps = asyncio.run(run())
    _check(text, lps, _expected(demo_lora, tok, "all7", ids, long_n))  # unchanged by it all
    assert live.post("/v1/unload_lora_adapter", json={"lora_name": "mlp16"}).status_code == 200
    assert live.wait_idle()["pjinfer:kv_blocks_used"] == 0


def test_load_errors(lora_server, demo_lora, tmp_path):
    live, app = lora_server
    r = live.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                 "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "not a local folder" in r.json()["error"]["message"]
    r = live.post("/v1/load_lora_adapter", json={"lora_name": "qv_rs",
                                                 "lora_path": str(demo_lora.adapters["qv_rs"])})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = live.post("/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert r.status_code == 404
    app.lora.allow_updates = False
    try:
        r = live.post("/v1/unload_lora_adapter", json={"lora_name": "qv_rs"})
        assert r.status_code == 403 and "--allow-runtime-lora-updating" in r.text
    finally:
        app.lora.allow_updates = True
    out = live.client().completions.create(model="qv_rs", prompt="a", max_tokens=2)
    assert out.choices[0].finish_reason is not None  # still serving


def test_lora_requests_info_metric(lora_server):
    live, _ = lora_server
    text = httpx.get(live.base_url + "/metrics", timeout=10).text
    line = next(s for s in text.splitlines() if s.startswith("pjinfer:lora_requests_info{"))
    assert 'max_lora="2"' in line and "running_lora_adapters=" in line


def test_serve_flags_reach_the_server(monkeypatch):
    """`pjinfer serve --enable-lora --lora-modules a=/x b=/y --max-loras 3 --max-lora-rank 8
    --allow-runtime-lora-updating`, with the engine and uvicorn replaced."""
    from pjinfer import cli

    seen = {}
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setattr("pjinfer.server.pool_config.build_engine",
                        lambda config, dp=1: seen.update(config=config) or "engine")
    monkeypatch.setattr("pjinfer.server.serve.serve",
                        lambda engine, options, **kw: seen.update(options=options))
    assert cli.main(["serve", "--enable-lora", "--lora-modules", "a=/x", "b=/y",
                     "--max-loras", "3", "--max-lora-rank", "8",
                     "--allow-runtime-lora-updating"]) == 0
    assert seen["options"].lora_modules == (("a", "/x"), ("b", "/y"))
    assert seen["options"].allow_runtime_lora_updating
    c = seen["config"]
    assert (c.enable_lora, c.max_loras, c.max_lora_rank) == (True, 3, 8)
    assert cli.main(["serve", "--lora-modules", "no-equals-sign"]) == 2
