"""Multi-step decoding (num_scheduler_steps > 1: several decode steps in one device call) must
not change a single output: tokens, text, finish reasons and logprobs equal one step at a
time, through EOS, stop ids and strings met mid-way, length limits that are not a multiple of
the steps, seeded sampling, min_tokens reached mid-call, chunked prefill, preemption and prefix
caching; rows that need the host between tokens (penalties, structured outputs) run single
steps."""

from __future__ import annotations

import pytest

from pjinfer import LLM, SamplingParams, StructuredOutputsParams
from pjinfer.demo import zen_lines
from pjinfer.engine.config import EngineConfig
from tests.engine.idle import assert_idle

PROMPTS = [" ".join(line.split()[:n]) for line, n in zip(zen_lines()[1:13], [2, 3, 4] * 4,
                                                          strict=True)]
NEWLINE, PERIOD = 204, 19  # the demo tokenizer's "\n" and "."
MULTI = [  # every one may run several steps a call
    SamplingParams(temperature=0.0, max_tokens=40),  # stops at EOS (demo lines end)
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # 7 = 4 + 3
    SamplingParams(temperature=0.8, seed=3, max_tokens=25, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=40, stop=["than"]),  # a stop string mid-call
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=11, max_tokens=30),
    SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[NEWLINE]),  # the line's end
    SamplingParams(temperature=0.0, max_tokens=1, logprobs=1),
    # stop ids suppressed until min_tokens, which a call reaches mid-way
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=9, stop_token_ids=[NEWLINE]),
    SamplingParams(temperature=1.0, top_k=5, seed=11, max_tokens=30, min_tokens=14,
                   stop_token_ids=[PERIOD]),
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=6, stop=["is"]),
]
SINGLE = [  # each of these keeps its step a single one
    SamplingParams(temperature=0.9, seed=5, max_tokens=30, presence_penalty=0.7,
                   frequency_penalty=0.9, repetition_penalty=1.4),
]


def _run(steps: int, params: list[SamplingParams], **engine_args) -> tuple[list, int]:
    llm = LLM(num_scheduler_steps=steps, warmup=False, **engine_args)
    calls = []
    launch = llm.engine.runner.launch_multi
    llm.engine.runner.launch_multi = lambda **k: calls.append(k["num_steps"]) or launch(**k)
    outputs = llm.generate(PROMPTS, [params[i % len(params)] for i in range(len(PROMPTS))])
    assert_idle(llm.engine)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob
             and pytest.approx(c.cumulative_logprob, abs=1e-3),
             None if c.logprobs is None else [
                 [(tid, lp.rank, pytest.approx(lp.logprob, abs=1e-4))
                  for tid, lp in sorted(e.items())] for e in c.logprobs])
            for out in outputs for c in out.outputs], calls


@pytest.mark.parametrize("engine_args", [
    {},
    {"async_scheduling": False},
    {"max_num_batched_tokens": 8, "max_num_seqs": 4},  # chunked prefill, few seqs per step
    {"num_kv_blocks": 8, "block_size": 16, "max_model_len": 64},  # preemption
    {"enable_prefix_caching": True, "block_size": 4},
], ids=["default", "sync", "chunked", "preempted", "prefix-cached"])
def test_multi_step_equals_single_steps(engine_args):
    single, none = _run(1, MULTI, **engine_args)
    multi, calls = _run(4, MULTI, **engine_args)
    assert not none and calls, "the multi-step decode never ran"
    assert max(max(steps) for steps in calls) == 4 and min(min(s) for s in calls) >= 1
    assert multi == single
    assert {"stop", "length"} <= {o[2] for o in single}  # both endings exercised


def test_rows_needing_the_host_between_tokens_run_single_steps():
    single, _ = _run(1, MULTI + SINGLE)
    multi, _ = _run(3, MULTI + SINGLE)
    assert multi == single
    _, calls = _run(3, SINGLE)
    assert not calls


def test_structured_outputs_run_single_steps():
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    single, _ = _run(1, [params])
    multi, calls = _run(4, [params])
    assert multi == single and not calls


def test_num_scheduler_steps_must_be_positive():
    with pytest.raises(ValueError, match="num_scheduler_steps must be a positive integer"):
        EngineConfig(num_scheduler_steps=0)


def test_warmup_compiles_the_multi_step_decode():
    """A greedy and a temperature request in the smallest bucket find their executables."""
    llm = LLM(num_scheduler_steps=4, warmup=True)  # the demo model: its smallest buckets
    compiled = llm.engine.runner._multi._compiled
    warmed = dict(compiled)
    assert len(warmed) == 2
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=9))
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.7, seed=1, max_tokens=9))
    assert compiled == warmed


def test_warm_restart_loads_the_multi_step_decode(tmp_path, restore_jax_cache_flags):
    """The executable cache keeps the multi-step executables too: a restart on the same
    directory loads them (no compile) and generates the same tokens."""
    params = [SamplingParams(temperature=0.0, max_tokens=9),
              SamplingParams(temperature=0.8, seed=2, max_tokens=9)]

    def run():
        llm = LLM(num_scheduler_steps=4, warmup=False, compilation_cache_dir=str(tmp_path))
        outs = [c.token_ids for o in llm.generate(PROMPTS[:2], params) for c in o.outputs]
        return llm.engine.runner._multi, outs

    cold, cold_outs = run()
    assert cold.num_compiles >= 1 and cold.num_cache_loads == 0
    assert len(list(tmp_path.rglob("multi_decode_step-*.jaxexec"))) == cold.num_compiles
    warm, warm_outs = run()
    assert warm.num_compiles == 0 and warm.num_cache_loads == cold.num_compiles
    assert warm_outs == cold_outs and all(len(t) == 9 for t in warm_outs)


def test_multi_step_decode_keeps_work_on_the_weights_inside_its_loop(tmp_path):
    """XLA hoists loop-invariant work out of a loop, and work on a weight (a dequantization, a
    float conversion, a concatenation of dots' weights) would then be held for every layer at
    once (14.2 GB for int4 Llama-3-8B on an H100, RESULTS.md round 43). The weights are tied
    to the step index, so the multi-step decode allocates no more than one step: here the
    CPU's float32 copy of a bf16 embedding is what hoisting would add."""
    import json

    from pjinfer.engine.engine import LLMEngine
    from pjinfer.engine.kv_budget import step_allocation

    vocab, hidden = 4096, 128
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}))
    runner = LLMEngine(EngineConfig(
        model=str(tmp_path), load_format="dummy", dtype="bfloat16", max_model_len=128,
        max_num_seqs=8, num_kv_blocks=32, warmup=False, num_scheduler_steps=4)).runner
    runner._warm_multi_step(8, 0.0)
    (multi,) = runner._multi.executables()
    single = runner._compiled_step(*runner._dummy(8, 8, True))
    assert step_allocation(multi) < step_allocation(single) + vocab * hidden * 4 // 2
