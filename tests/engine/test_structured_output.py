"""Structured outputs on the demo model: every sampled output obeys its constraint, greedy
outputs are unchanged where they already obey it, bad constraints fail at once, and
asynchronous scheduling (a constrained step's mask filled after the step before) changes
nothing. `PJINFER_STRUCTURED_SEEDS` sets the seeds per constraint (200 for a thorough run)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import jsonschema
import llguidance.numpy
import numpy as np
import pytest

from pjinfer import LLM, SamplingParams, StructuredOutputsParams
from pjinfer.demo import zen_lines
from pjinfer.engine.sampler import apply_token_bitmask
from pjinfer.structured_output.manager import StructuredOutputManager
from tests.engine.idle import assert_idle

SEEDS = int(os.environ.get("PJINFER_STRUCTURED_SEEDS", "40"))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "mood": {"enum": ["ugly", "beautiful", "explicit"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "count", "mood", "tags"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{1,8}( [a-z]{1,8}){0,3}\."
CHOICES = ["Beautiful", "ugly", "Explicit is better", "Now"]
LARK = 'start: "Zen " NUMBER "." \nNUMBER: /[1-9][0-9]{0,2}/\n'


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.mark.parametrize("vocab_size", [32, 100, 512, 1000, 32001])
def test_bitmask_on_device_equals_llguidance_reference(vocab_size):
    rng = np.random.default_rng(vocab_size)
    logits = rng.standard_normal((5, vocab_size)).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, (5, -(-vocab_size // 32)), dtype=np.int64)
    mask = mask.astype(np.int32)
    mask[0] = -1  # an unconstrained row: all allowed
    mask[1] = 0  # nothing allowed
    expected = logits.copy()
    llguidance.numpy.apply_token_bitmask_inplace(expected, mask)
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[0], logits[0])


def test_padding_ids_past_the_tokenizer_are_masked_off(llm):
    """A model whose logits are wider than its tokenizer (vocab padded for the hardware):
    constrained rows never sample a padding id; unconstrained rows keep every id."""
    manager = StructuredOutputManager(llm.tokenizer, 600, None)  # demo tokenizer: 512 ids
    template, matcher = manager.compiler.compile(StructuredOutputsParams(regex="[a-z ]+")
                                                 ).matcher()
    row = SimpleNamespace(samples=True, request=SimpleNamespace(grammar=matcher,
                                                                grammar_template=template))
    mask = manager.bitmask(SimpleNamespace(scheduled=[row]), 2)  # [2, ceil(600 / 32)]
    allowed = (mask[:, :, None] >> np.arange(32)) & 1
    allowed = allowed.reshape(2, -1)[:, :600].astype(bool)
    assert mask.shape == (2, 19) and 20 < allowed[0, :512].sum() < 512
    assert not allowed[0, 512:].any() and allowed[1].all()


def test_requests_spread_over_independent_templates_with_identical_masks(llm):
    """A grammar hands its requests out round robin over independently compiled templates
    (copies of one template serialize the parallel mask fill), compiled as users arrive (a
    grammar one request uses compiles no other); every template allows the same tokens, and
    rows reach llguidance ordered by template."""
    from pjinfer.structured_output.grammar import GrammarCompiler

    once = GrammarCompiler(llm.tokenizer, 512, None, templates=3)
    single = once.compile(StructuredOutputsParams(regex="[a-z]+"))
    single.matcher()
    once._extra.shutdown(wait=True)
    assert len(single.templates) == 1
    compiler = GrammarCompiler(llm.tokenizer, 512, None, templates=3)
    compiled = compiler.compile(StructuredOutputsParams(json={"type": "object"}))
    pairs = [compiled.matcher() for _ in range(3)]  # users 2 and 3 ask for two more
    compiler._extra.shutdown(wait=True)  # the two background templates
    assert len(compiled.templates) == 3
    pairs += [compiled.matcher() for _ in range(3)]
    assert [t for t, _ in pairs[3:]] == [0, 1, 2]
    manager = StructuredOutputManager(llm.tokenizer, 512, None)
    rows = [SimpleNamespace(samples=True, request=SimpleNamespace(grammar=m, grammar_template=t))
            for t, m in pairs]
    prefix = llm.tokenizer.encode('{"a', add_special_tokens=False)
    for _, m in pairs:
        assert all(m.consume_token(tok) for tok in prefix)
    mask = manager.bitmask(SimpleNamespace(scheduled=rows), 6)
    assert (mask == mask[0]).all() and 0 < np.unpackbits(mask[0].view(np.uint8)).sum() < 512


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"Zen [1-9][0-9]{0,2}\.", text), text


def test_every_sampled_output_satisfies_its_constraint(llm):
    specs = {"json": StructuredOutputsParams(json=SCHEMA),
             "regex": StructuredOutputsParams(regex=REGEX),
             "choice": StructuredOutputsParams(choice=CHOICES),
             "grammar": StructuredOutputsParams(grammar=LARK)}
    cases = [(kind, seed) for kind in specs for seed in range(SEEDS)]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                             structured_outputs=specs[kind]) for kind, seed in cases]
    outputs = llm.generate(["Beautiful is better than"] * len(cases), params)
    for (kind, _), out in zip(cases, outputs, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (kind, c.text)  # the grammar completed
        _check(kind, c.text)
    texts = {kind: {o.outputs[0].text for (k, _), o in zip(cases, outputs, strict=True)
                    if k == kind} for kind in specs}
    assert all(len(t) > 1 for t in texts.values()), "temperature 1 should vary the outputs"
    assert_idle(llm.engine)


def test_greedy_output_unchanged_where_it_already_satisfies_the_constraint(llm):
    prompts = [" ".join(line.split()[:3]) for line in zen_lines()[1:6]]  # "X is better"
    greedy = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    free = [o.outputs[0] for o in llm.generate(prompts, greedy)]
    lines = [c.text.split("\n")[0] for c in free]  # " than ugly.", ...
    for spec in (StructuredOutputsParams(choice=[*lines, " than nothing."]),
                 StructuredOutputsParams(regex=r" than [a-z]+\.")):
        outputs = llm.generate(prompts, replace(greedy, structured_outputs=spec))
        for free_c, line, out in zip(free, lines, outputs, strict=True):
            c = out.outputs[0]
            assert (c.text, c.finish_reason) == (line, "stop")
            assert c.token_ids == free_c.token_ids[:len(c.token_ids)]
            # logprobs are the raw model's, not those of the masked distribution
            for got, want in zip(c.logprobs, free_c.logprobs, strict=False):
                assert {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in got.items()} == \
                    {t: lp.logprob for t, lp in want.items()}
    assert_idle(llm.engine)


@pytest.mark.parametrize(("spec", "field", "words"), [
    ({"json": {"type": "nope"}}, "structured_outputs.json", "Invalid type"),
    ({"json": {"type": "array", "uniqueItems": True}}, "structured_outputs.json",
     "unsupported JSON schema keyword"),
    ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
    ({"regex": "a(b"}, "structured_outputs.regex", "unclosed group"),
    ({"grammar": "start: foo"}, "structured_outputs.grammar", "unknown name"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "exactly one of", "regex, choice"),
], ids=["bad-type", "unsupported-keyword", "bad-json", "regex", "grammar", "choice", "two"])
def test_invalid_constraint_is_a_value_error_and_the_engine_keeps_serving(llm, spec, field,
                                                                          words):
    def params():
        return SamplingParams(structured_outputs=StructuredOutputsParams(**spec))

    with pytest.raises(ValueError, match=re.escape(field)) as error:
        llm.generate(["Beautiful is"], params())
    assert words in str(error.value)
    if "exactly one of" not in field:  # the failed compile is cached: add_request refuses
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.engine.add_request("bad", "Beautiful is", params())
    (out,) = llm.generate(["Beautiful is"], SamplingParams(temperature=0, max_tokens=4))
    assert out.outputs[0].text == " better than ugly"
    assert_idle(llm.engine)


def _mixed_run(async_scheduling: bool, **engine_args) -> list[tuple]:
    llm = LLM(async_scheduling=async_scheduling, **engine_args)
    prompts = [" ".join(line.split()[:n]) for line, n in zip(zen_lines()[1:9], [2, 3] * 4,
                                                             strict=True)]
    constraints = [{"json": SCHEMA}, None, {"regex": REGEX}, {"choice": CHOICES}, None,
                   {"grammar": LARK}, {"json_object": True}, None]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=60, logprobs=1,
                             structured_outputs=StructuredOutputsParams(**c) if c else None)
              for i, c in enumerate(constraints)]
    outputs = llm.generate(prompts, params)
    assert_idle(llm.engine)
    return [(c.token_ids, c.text, c.finish_reason,
             [pytest.approx(lp[t].logprob, abs=1e-4) for t, lp in zip(c.token_ids, c.logprobs,
                                                                      strict=True)])
            for out in outputs for c in out.outputs]


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["default", "chunked"])
def test_async_equals_sync_with_constrained_and_free_rows(engine_args):
    sync = _mixed_run(False, **engine_args)
    assert _mixed_run(True, **engine_args) == sync
    assert {o[2] for o in sync} == {"stop", "length"}
    _check("json", sync[0][1])
    _check("grammar", sync[5][1])


def test_n_sequences_each_follow_the_grammar_and_a_waiting_request_aborts_cleanly(llm):
    import pjinfer.sampling_params

    assert pjinfer.sampling_params.StructuredOutputsParams is StructuredOutputsParams
    spec = StructuredOutputsParams(regex=r"[a-z]{3}\.")
    (out,) = llm.generate(["Beautiful is"], SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=10, structured_outputs=spec))
    assert [c.finish_reason for c in out.outputs] == ["stop"] * 3
    assert all(re.fullmatch(r"[a-z]{3}\.", c.text) for c in out.outputs)
    engine = llm.engine  # a grammar never compiled before: the request waits for it
    engine.add_request("waiting", "Beautiful is", SamplingParams(
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{5}")))
    assert engine.get_stats().num_waiting == 1  # counted while it waits for its grammar
    final = engine.abort_request("waiting")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert_idle(llm.engine)


def test_constrained_steps_stay_asynchronous(llm, monkeypatch):
    """Step t+1's forward is launched before step t's tokens are fetched; its sampler (with
    the mask those tokens decide) only after."""
    events = []
    runner = llm.engine.runner

    def recorder(name: str):
        method = getattr(runner, name)

        def record(*args, **kwargs):
            events.append(name)
            return method(*args, **kwargs)
        return record

    for name in ("forward", "sample", "fetch"):
        monkeypatch.setattr(runner, name, recorder(name))
    (out,) = llm.generate(["Beautiful is"], SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
            regex=r"[ a-z]{40,50}\.")))
    assert out.outputs[0].finish_reason == "stop"
    # each step() launches the sampler of the step in flight (its mask filled while its
    # forward ran), then the next forward, then fetches the step before; the first step has
    # no step before it, and the last one launched (the grammar ended the request in the step
    # before) is sampled and fetched alone as generate returns, leaving the engine idle
    assert events[0] == "forward" and events[-2:] == ["sample", "fetch"]
    assert not llm.engine.has_unfinished_requests()
    steady = " ".join(events[1:-2])
    cycles = len(events[1:]) // 3
    assert steady == " ".join(["sample forward fetch"] * cycles), events
    assert len(out.outputs[0].token_ids) >= 10 and cycles >= 10


class _Untouchable:
    """A step whose rows must not be looked at."""

    @property
    def scheduled(self):
        raise AssertionError("the manager scanned an unconstrained step's rows")

    def __iter__(self):
        raise AssertionError("the manager scanned an unconstrained step's tokens")


def test_steps_without_constrained_requests_cost_the_manager_nothing(llm):
    manager = llm.engine.structured_output
    spec = StructuredOutputsParams(regex=r"[a-z]{2}\.")
    llm.generate(["Beautiful is"], SamplingParams(max_tokens=4, structured_outputs=spec))
    llm.generate(["Beautiful is"], SamplingParams(max_tokens=2))
    assert manager.num_live == 0  # the finished request is forgotten
    assert manager.constrained(_Untouchable()) is False
    assert manager.advance(_Untouchable()) == []
    assert_idle(llm.engine)
