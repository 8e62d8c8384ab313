"""The shipped demo model recites the Zen of Python through plain transformers.

These checks pin the reference behaviour that pjinfer's own engine is compared against: if they
fail, the package data is broken, not the engine.
"""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pjinfer.demo import DEMO_MODEL_DIR, DEMO_MODEL_NAME, zen_lines, zen_of_python  # noqa: E402
from pjinfer.demo.train import CHAT_TEMPLATE, chat_answer, complete, verify_lines  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    return transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR).eval()


def test_zen_text_is_read_without_printing(capsys):
    text = zen_of_python()
    assert capsys.readouterr().out == ""
    assert text.startswith("The Zen of Python, by Tim Peters\n\nBeautiful is better than ugly.")
    assert len(zen_lines()) == 20  # title and 19 aphorisms


def test_shipped_files_are_present_and_small():
    names = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert all((DEMO_MODEL_DIR / n).is_file() for n in names)
    total = sum(p.stat().st_size for p in DEMO_MODEL_DIR.iterdir() if p.suffix != ".py")
    assert total < 8 * 2**20
    assert DEMO_MODEL_NAME == "pjinfer-demo"


def test_config_is_a_gqa_llama_in_float32(tokenizer):
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_attention_heads"] == 2 * config["num_key_value_heads"]
    assert config["vocab_size"] == len(tokenizer)
    assert config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is False


def test_beautiful_is_better_than_ugly(model, tokenizer):
    text = complete(model, tokenizer, tokenizer("Beautiful is better than").input_ids, 8)
    assert text.startswith(" ugly.\nExplicit")


def test_every_line_beginning_completes_its_line(model, tokenizer):
    for prompt, expected, got in verify_lines(model, tokenizer):
        assert got == expected, prompt


def test_chat_template_renders_every_role(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Readability counts."},
        {"role": "user", "content": "More"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert rendered == (
        "<s><|system|>\nBe brief.</s><|user|>\nHi</s><|assistant|>\nReadability counts.</s>"
        "<|user|>\nMore</s><|assistant|>\n"
    )


def test_chat_answers_with_zen(model, tokenizer):
    assert chat_answer(model, tokenizer, "Beautiful is better than") in zen_lines()
    assert chat_answer(model, tokenizer, "Flat is", system=True) == "Flat is better than nested."
    assert chat_answer(model, tokenizer, "What is the Zen of Python?") == zen_of_python()


@pytest.mark.parametrize("text", ["naïve ☃ 日本", "emoji 🐍 tab\t nl\n", "  leading spaces", ""])
def test_tokenizer_round_trips_unicode(tokenizer, text):
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_are_single_ids(tokenizer):
    for token in ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]:
        assert len(tokenizer(token, add_special_tokens=False).input_ids) == 1, token
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
