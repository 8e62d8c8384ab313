"""LoRA adapters in a model pool: they belong to the default model. A request naming an adapter
leases that model and runs with the adapter (peft's tokens); the other model serves without;
/v1/models lists the adapters under their parent; an unknown name's 404 lists models and
adapters; lora_requests_info is labelled with the model whose engine runs LoRA."""

from __future__ import annotations

import httpx
import openai
import pytest

from pjinfer.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from tests.lora.conftest import ADAPTERS, LoRAModels, build_adapter, peft_greedy
from tests.server.conftest import API_KEY, PoolServer, start_server

N = 6
PROMPT = "Beautiful is better than"
GREEDY = dict(max_tokens=N, temperature=0, extra_body={"ignore_eos": True})
ENGINE = dict(warmup=False, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=128, dtype="float32")


@pytest.fixture(scope="module")
def lora_pool(tmp_path_factory):
    from pjinfer.server.model_pool import ModelPool, ModelSpec

    root = tmp_path_factory.mktemp("pool_lora")
    models = LoRAModels(DEMO_MODEL_DIR, {"all7": build_adapter(
        DEMO_MODEL_DIR, root, "all7", *ADAPTERS["all7"], seed=10)})
    pool = ModelPool([
        ModelSpec(DEMO_MODEL_NAME, str(DEMO_MODEL_DIR), memory_share=0.5, engine_args={
            **ENGINE, "enable_lora": True, "max_loras": 1, "max_lora_rank": 16}),
        ModelSpec("plain", str(DEMO_MODEL_DIR), engine_args=ENGINE, memory_share=0.5),
    ], memory_bytes=256 << 20)
    server, thread, url = start_server(pool, api_key=API_KEY, drain_timeout=5,
                                       allow_runtime_lora_updating=True,
                                       lora_modules=(("all7", str(models.adapters["all7"])),))
    yield PoolServer(url, None, pool), models
    server.should_exit = True
    thread.join(timeout=30)


def test_adapter_leases_the_default_model(lora_pool):
    server, models = lora_pool
    tok = server.pool.default.current.engine.tokenizer
    ids = tok.encode(PROMPT)
    client = server.client()
    out = client.completions.create(model="all7", prompt=PROMPT, **GREEDY)
    assert out.model == "all7"
    tokens, _ = peft_greedy(models, "all7", ids, N)
    assert out.choices[0].text == tok.decode(tokens, skip_special_tokens=True,
                                             clean_up_tokenization_spaces=False)
    base, _ = peft_greedy(models, None, ids, N)
    for name in (DEMO_MODEL_NAME, "plain"):  # the base model itself, in both engines
        text = client.completions.create(model=name, prompt=PROMPT, **GREEDY).choices[0].text
        assert text == tok.decode(base, skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False)


def test_models_lists_pool_and_adapters(lora_pool):
    server, _ = lora_pool
    cards = server.cards()
    assert set(cards) == {DEMO_MODEL_NAME, "plain", "all7"}
    assert cards["all7"]["parent"] == DEMO_MODEL_NAME and cards["plain"]["parent"] is None
    assert server.client().models.retrieve("all7").id == "all7"


def test_unknown_model_404_names_models_and_adapters(lora_pool):
    server, _ = lora_pool
    with pytest.raises(openai.NotFoundError) as e:
        server.client().completions.create(model="nope", prompt="a", max_tokens=2)
    message = e.value.body["message"]
    assert "'plain'" in message and "'all7'" in message
    r = server.post("/v1/load_lora_adapter", json={"lora_name": "plain", "lora_path": "/x"})
    assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"]


def test_beam_search_with_adapter_is_400(lora_pool):
    server, _ = lora_pool
    with pytest.raises(openai.BadRequestError, match="beam search with a LoRA adapter"):
        server.client().completions.create(model="all7", prompt=PROMPT, n=2, max_tokens=4,
                                           extra_body={"use_beam_search": True})


def test_lora_metric_per_model(lora_pool):
    server, _ = lora_pool
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    lora = [s for s in text.splitlines() if s.startswith("pjinfer:lora_requests_info{")]
    assert len(lora) == 1 and f'model_name="{DEMO_MODEL_NAME}"' in lora[0]
    assert 'max_lora="1"' in lora[0]
    running = [s for s in text.splitlines() if s.startswith("pjinfer:num_requests_running{")]
    assert {'model_name="plain"' in s for s in running} == {True, False}
