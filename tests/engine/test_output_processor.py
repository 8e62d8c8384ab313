"""The three output kinds (CUMULATIVE, DELTA, FINAL_ONLY) through the engine on the demo model:
joined deltas equal the cumulative text, tokens and logprobs, and FINAL_ONLY reports once."""

from __future__ import annotations

import dataclasses

import pytest

from pjinfer import SamplingParams
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.sampling_params import RequestOutputKind
from tests.engine.idle import assert_idle

PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(warmup=False))


def _run(engine: LLMEngine, params: SamplingParams, kind: RequestOutputKind) -> list:
    engine.add_request(f"r-{kind.value}", PROMPT, dataclasses.replace(params, output_kind=kind))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def _join(deltas: list, n: int) -> list[dict]:
    seqs = [dict(text="", token_ids=[], logprobs=[], finish_reason=None) for _ in range(n)]
    for out in deltas:
        for c in out.outputs:
            s = seqs[c.index]
            assert s["finish_reason"] is None, "nothing follows a sequence's finish"
            s["text"] += c.text
            s["token_ids"] += c.token_ids
            s["logprobs"] += c.logprobs or []
            s["finish_reason"] = c.finish_reason
    return seqs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, logprobs=2, prompt_logprobs=1),
    SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=24, stop=["Explicit"]),
])
def test_delta_joins_to_cumulative_and_final_only_reports_once(engine, params):
    cumulative = _run(engine, params, RequestOutputKind.CUMULATIVE)
    deltas = _run(engine, params, RequestOutputKind.DELTA)
    finals = _run(engine, params, RequestOutputKind.FINAL_ONLY)
    assert len(finals) == 1 and finals[0].finished
    last = cumulative[-1]
    assert last.finished and not any(o.finished for o in cumulative[:-1])
    assert len(deltas) > 2 and deltas[-1].finished
    for got, want, final in zip(_join(deltas, params.n), last.outputs, finals[0].outputs,
                                strict=True):
        assert got["text"] == want.text == final.text
        assert got["token_ids"] == want.token_ids == final.token_ids
        assert got["finish_reason"] == want.finish_reason == final.finish_reason
        if params.logprobs is not None:
            assert got["logprobs"] == want.logprobs == final.logprobs
    # prompt logprobs come once in a delta stream, with the first output
    with_prompt_lps = [o for o in deltas if o.prompt_logprobs is not None]
    if params.prompt_logprobs is not None:
        assert with_prompt_lps == [deltas[0]]
        assert deltas[0].prompt_logprobs == last.prompt_logprobs
    else:
        assert not with_prompt_lps
    # each cumulative output is a prefix of the next
    for before, after in zip(cumulative, cumulative[1:], strict=False):
        for b, a in zip(before.outputs, after.outputs, strict=True):
            assert a.text.startswith(b.text) and a.token_ids[:len(b.token_ids)] == b.token_ids


def test_stop_string_is_cut_from_every_kind(engine):
    params = SamplingParams(temperature=0, max_tokens=30, stop=["\n"])
    for kind in RequestOutputKind:
        outs = _run(engine, params, kind)
        text = "".join(c.text for o in outs for c in o.outputs) \
            if kind is RequestOutputKind.DELTA else outs[-1].outputs[0].text
        assert text == " ugly.", kind
        assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == \
            ("stop", "\n")


def test_abort_reports_a_final_delta(engine):
    params = SamplingParams(temperature=0, max_tokens=50, output_kind=RequestOutputKind.DELTA)
    engine.add_request("to-abort", PROMPT, params)
    sent = []
    for _ in range(4):
        sent += engine.step()
    final = engine.abort_request("to-abort")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    streamed = "".join(c.text for o in sent + [final] for c in o.outputs)
    assert (PROMPT + " ugly.\nExplicit is better than implicit.").startswith(PROMPT + streamed)
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(engine)


def test_the_stopping_token_is_not_in_the_text(engine):
    """EOS (kept with skip_special_tokens=False) and a stop token id end the text without
    their own text, as in vLLM; include_stop_str_in_output keeps it."""
    eos = SamplingParams(temperature=0, max_tokens=400, skip_special_tokens=False)
    (out,) = _run(engine, eos, RequestOutputKind.FINAL_ONLY)[-1].outputs
    assert out.finish_reason == "stop" and out.token_ids[-1] == engine.eos_token_id
    assert out.text.endswith("those!")
    kept = dataclasses.replace(eos, include_stop_str_in_output=True)
    assert _run(engine, kept, RequestOutputKind.FINAL_ONLY)[-1].outputs[0].text == \
        out.text + "</s>"
    dot = engine.tokenizer.convert_tokens_to_ids(".")
    by_id = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[dot])
    (out,) = _run(engine, by_id, RequestOutputKind.FINAL_ONLY)[-1].outputs
    assert (out.text, out.stop_reason, out.token_ids[-1]) == (" ugly", dot, dot)
