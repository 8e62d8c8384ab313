"""Engine behaviour a user sees: the demo model, seeded sampling, aborts, timeouts, bad input."""

from __future__ import annotations

import gc
import time

import pytest
from tqdm import tqdm

import pjinfer
from pjinfer import LLM, SamplingParams
from pjinfer.demo import zen_lines
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.errors import EngineOverloadedError
from tests.engine.idle import assert_idle


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM()


def test_generate_completes_zen_lines():
    lines = zen_lines()[1:]
    prompts = [" ".join(line.split()[:4]) for line in lines if not line.startswith("If the")]
    outputs = pjinfer.generate(None, prompts, SamplingParams(temperature=0, max_tokens=24))
    for prompt, out in zip(prompts, outputs, strict=True):
        first_line = (prompt + out.outputs[0].text).split("\n")[0]
        assert first_line in lines, (prompt, out.outputs[0].text)
    assert prompts[0] == "Beautiful is better than"
    assert outputs[0].outputs[0].text.startswith(" ugly.\n")


def test_chat_answers_with_the_zen(demo):
    out = demo.chat([{"role": "user", "content": "What is the Zen of Python?"}],
                    SamplingParams(temperature=0, max_tokens=64))[0]
    assert out.outputs[0].text.startswith("The Zen of Python, by Tim Peters")


def test_chat_template_arguments_as_vllm(demo):
    """LLM.chat's vLLM arguments: `chat_template` replaces the model's, `chat_template_kwargs`
    are its variables, `continue_final_message` leaves the assistant's text open; a
    template error is a ValueError."""
    params = SamplingParams(temperature=0, max_tokens=6)
    template = "{{ lead }} {% for m in messages %}{{ m['content'] }}{% endfor %}"
    out = demo.chat([{"role": "user", "content": "is better than"}], params,
                    chat_template=template, chat_template_kwargs={"lead": "Beautiful"})[0]
    plain = demo.generate("Beautiful is better than", params)[0]
    assert out.prompt_token_ids == demo.tokenizer.encode("Beautiful is better than",
                                                         add_special_tokens=False)
    assert out.outputs[0].text == plain.outputs[0].text
    went_on = demo.chat([{"role": "user", "content": "What is the Zen of Python?"},
                         {"role": "assistant", "content": "Beautiful is"}], params,
                        add_generation_prompt=False, continue_final_message=True)[0]
    assert demo.tokenizer.decode(went_on.prompt_token_ids).endswith("Beautiful is")
    assert went_on.outputs[0].text.startswith(" better than")
    with pytest.raises(ValueError, match="cannot both be true"):
        demo.chat([{"role": "assistant", "content": "x"}], continue_final_message=True)
    with pytest.raises(ValueError, match="the chat template failed"):
        demo.chat([{"role": "user", "content": "x"}], chat_template="{{ raise_exception('no') }}")
    with pytest.raises(ValueError, match="may not set add_generation_prompt"):
        demo.chat([{"role": "user", "content": "x"}],
                  chat_template_kwargs={"add_generation_prompt": False})
    assert_idle(demo.engine)


def test_allowed_token_ids_and_prompt_truncation(demo):
    """vLLM's allowed_token_ids (greedy picks the best allowed token; a batch mate without
    the field is untouched) and truncate_prompt_tokens (the engine runs the prompt's last k
    tokens, exactly as if they were the prompt)."""
    prompt = "Beautiful is better than ugly.\nExplicit is better than"
    greedy = SamplingParams(temperature=0, max_tokens=12)
    plain = demo.generate(prompt, greedy)[0].outputs[0].token_ids
    superset = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[*plain, 1, 2])
    others = [t for t in range(3, 40) if t not in plain]
    disjoint = SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=others)
    outs = demo.generate([prompt] * 3, [superset, disjoint, greedy])
    assert outs[0].outputs[0].token_ids == plain == outs[2].outputs[0].token_ids
    assert set(outs[1].outputs[0].token_ids) <= set(others)
    ids = demo.tokenizer.encode(prompt)
    cut = demo.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                               truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs[0].token_ids == demo.generate({"prompt_token_ids": ids[-5:]},
                                                     greedy)[0].outputs[0].token_ids
    assert_idle(demo.engine)


def test_vllm_prompt_dicts_and_the_frozen_heap(demo):
    """vLLM's TextPrompt / TokensPrompt dicts mean their text / ids; anything else in a
    prompt dict is refused by name. Start-up leaves its objects out of the cyclic GC."""
    params = SamplingParams(temperature=0, max_tokens=8)
    ids = demo.tokenizer.encode("Beautiful is better than")
    plain = [o.outputs[0].token_ids for o in demo.generate(["Beautiful is better than", ids],
                                                            params)]
    dicts = demo.generate([{"prompt": "Beautiful is better than"}, {"prompt_token_ids": ids}],
                          params)
    assert [o.outputs[0].token_ids for o in dicts] == plain == [plain[0]] * 2
    assert demo.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids == plain[0]
    for bad in ({"prompt": "a", "multi_modal_data": {}}, {"prompt_token_ids": "abc"}, {}):
        with pytest.raises(ValueError, match="a prompt dict takes one key"):
            demo.generate([bad], params)
    assert_idle(demo.engine)
    assert gc.get_freeze_count() > 0 and "gc_freeze" in demo.engine.startup_phases


def test_vllm_accessors_reach_the_engine_and_tokenizer(demo):
    """vLLM scripts reach the engine as `llm.llm_engine` and the tokenizer through
    `llm.get_tokenizer()`: the same objects as pjinfer's own names."""
    assert demo.llm_engine is demo.engine
    assert demo.get_tokenizer() is demo.tokenizer is demo.engine.tokenizer
    ids = demo.get_tokenizer().encode("Beautiful is better than")
    params = SamplingParams(temperature=0, max_tokens=4)
    assert demo.generate({"prompt_token_ids": ids}, params)[0].prompt_token_ids == ids
    assert not demo.llm_engine.has_unfinished_requests()


def test_progress_bar_counts_finished_prompts(demo, capsys):
    """`use_tqdm` (vLLM's): True draws tqdm's bar on stderr, a callable makes the bar, False
    none; the outputs are the same either way."""
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = ["Beautiful is", "Simple is", "Flat is"]
    quiet = demo.generate(prompts, params, use_tqdm=False)
    assert capsys.readouterr().err == ""
    shown = demo.generate(prompts, params)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output: " in err
    made = []

    class Bar(tqdm):
        def __init__(self, **kwargs):
            made.append(kwargs["total"])
            super().__init__(**kwargs, disable=True)

    chats = demo.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=Bar)
    assert made == [3] and len(chats) == 3
    assert [o.outputs[0].token_ids for o in quiet] == [o.outputs[0].token_ids for o in shown]
    assert_idle(demo.engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(demo):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    alone = demo.generate(["Errors should"], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.5, seed=i, max_tokens=30) for i in range(5)]
    batch = demo.generate(["Simple is", "Errors should", "Now is", "Flat is", "In the face",
                           "Sparse is"], [others[0], params, *others[1:]])
    assert batch[1].outputs[0].token_ids == alone
    assert_idle(demo.engine)


def test_stop_strings_and_logprobs(demo):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["than"], logprobs=3)
    out = demo.generate(["Explicit is"], params)[0].outputs[0]
    assert out.text == " better " and out.finish_reason == "stop" and out.stop_reason == "than"
    assert len(out.logprobs) == len(out.token_ids)
    first = out.logprobs[0]
    assert first[out.token_ids[0]].rank == 1 and len(first) >= 3


def test_prompt_logprobs(demo):
    out = demo.generate(["Beautiful is better than"],
                        SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for pos, entry in enumerate(out.prompt_logprobs[1:], 1):
        assert out.prompt_token_ids[pos] in entry


def test_abort_frees_blocks_and_others_continue(demo):
    engine = demo.engine
    engine.add_request("keep", "Beautiful is", SamplingParams(temperature=0, max_tokens=30))
    engine.add_request("drop", "Explicit is", SamplingParams(temperature=0, max_tokens=30))
    engine.step()
    engine.step()
    assert engine.abort_request("drop").outputs[0].finish_reason == "abort"
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["keep"].outputs[0].finish_reason == "length"
    assert_idle(engine)


def test_timeout_finishes_request_and_frees_blocks():
    engine = LLMEngine(EngineConfig(warmup=False, request_timeout=0.05))
    engine.add_request("slow", "Beautiful is", SamplingParams(temperature=0, max_tokens=400,
                                                              ignore_eos=True))
    engine.step()
    time.sleep(0.1)
    outs = engine.step()
    assert outs[0].outputs[0].finish_reason == "timeout"
    assert_idle(engine)


def test_bounded_waiting_queue():
    engine = LLMEngine(EngineConfig(warmup=False, max_waiting_requests=2))
    engine.add_request("a", "Now is", SamplingParams(max_tokens=2))
    engine.add_request("b", "Now is", SamplingParams(max_tokens=2))
    with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
        engine.add_request("c", "Now is", SamplingParams(max_tokens=2))


@pytest.mark.parametrize("prompt, params, match", [
    ("", None, "prompt must not be empty"),
    ("word " * 600, None, "max_model_len"),
    ("ok", dict(max_tokens=0), "max_tokens"),
    ("ok", dict(top_p=1.5), "top_p"),
    ("ok", dict(temperature=-1.0), "temperature"),
    ("ok", dict(stop=3), "stop"),
])
def test_bad_input_is_a_clear_value_error_and_engine_keeps_serving(demo, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        demo.generate([prompt], SamplingParams(**params) if params else None)
    out = demo.generate(["Beautiful is better than"], SamplingParams(temperature=0,
                                                                     max_tokens=3))
    assert out[0].outputs[0].text.startswith(" ugly")
    assert_idle(demo.engine)


def test_unknown_engine_argument_is_named():
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("name", ["async_scheduling", "enable_prefix_caching", "warmup"])
def test_engine_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=f"{name} must be true or false"):
        EngineConfig(**{name: "no"})


def test_one_sequence_decode_writes_the_kv_cache_in_place():
    """`--max-num-seqs 1` decoded at ~320 ms a token on the CPU against ~1.6 ms with 2: a
    one-token step made XLA rewrite its KV write as a copy of the whole cache. The decode
    step must need no temporary anywhere near the cache's size, and compile once per shape."""
    engine = LLMEngine(EngineConfig(warmup=False, max_num_seqs=1, num_kv_blocks=1024))
    engine.add_request("a", "Beautiful is better than",
                       SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert len(outputs[-1].outputs[0].token_ids) == 32
    assert engine.runner.num_compiles == 2  # the prompt's shape, the decode shape
    cache_bytes = sum(k.nbytes + v.nbytes for k, v in engine.runner.kv_caches)
    for step in engine.runner._compiled.values():
        assert step.memory_analysis().temp_size_in_bytes < cache_bytes / 16
    assert_idle(engine)
