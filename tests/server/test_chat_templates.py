"""Chat templates at the server: --chat-template replaces the model's, a request's own
chat_template only with --trust-request-chat-template, chat_template_kwargs as variables."""

from __future__ import annotations

import dataclasses

import pytest

from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.server.protocol import APIError, ModelInfo
from pjinfer.server.validation import parse_chat, tokenize
from pjinfer.tokenizer import load_tokenizer

SERVER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
REQUEST_TEMPLATE = "{{ lead }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "Beautiful is better than"}]


@pytest.fixture(scope="module")
def info() -> ModelInfo:
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    return ModelInfo("demo", 512, tokenizer, len(tokenizer))


def _prompt_text(info: ModelInfo, **body) -> str:
    req = parse_chat({"model": "demo", "messages": MESSAGES, **body}, info, "r")
    return info.tokenizer.decode(req.prompts[0])


def test_server_template_replaces_the_models(info):
    own = _prompt_text(info)
    served = dataclasses.replace(info, chat_template=SERVER_TEMPLATE)
    assert _prompt_text(served) == "[user] Beautiful is better than\n" != own
    tokens = tokenize({"messages": MESSAGES}, served)  # /tokenize renders it the same way
    assert info.tokenizer.decode(tokens) == "[user] Beautiful is better than\n"


def test_request_template_needs_the_trust_flag(info):
    with pytest.raises(APIError, match="--trust-request-chat-template") as err:
        _prompt_text(info, chat_template=REQUEST_TEMPLATE)
    assert err.value.param == "chat_template"
    trusted = dataclasses.replace(info, chat_template=SERVER_TEMPLATE,
                                  trust_request_chat_template=True)
    text = _prompt_text(trusted, chat_template=REQUEST_TEMPLATE,
                        chat_template_kwargs={"lead": "Now: "})
    assert text == "Now: Beautiful is better than"
    with pytest.raises(APIError, match="the chat template failed") as err:
        _prompt_text(trusted, chat_template="{{ raise_exception('no tools here') }}")
    assert "no tools here" in err.value.message and err.value.status == 400
    with pytest.raises(APIError, match="failed on these messages: TypeError") as err:
        _prompt_text(trusted, chat_template="{{ lead + messages[0]['content'] }}",
                     chat_template_kwargs={"lead": 3})  # a kwarg of the wrong type: a 400
    assert err.value.status == 400 and err.value.param == "messages"
    with pytest.raises(APIError, match="chat_template must be a string"):
        _prompt_text(trusted, chat_template=["x"])
