"""LoRA in the engine against the `peft` oracle: one generate call mixing three adapters and
the base model, slot reuse without recompiles, the max_loras limit, prefix caching keyed by
adapter, bad requests."""

from __future__ import annotations

import pytest

from pjinfer import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import ADAPTERS, peft_greedy

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
SHARED = [(7 * i + 3) % 120 + 4 for i in range(36)]  # > 2 blocks of 16: prefix-cache hits
PROMPTS = [SHARED + [5, 9], SHARED + [5, 9], SHARED + [5, 9], [11, 90, 4], SHARED + [77],
           [12, 60, 61, 62, 63, 64, 65]]
ORDER = [None, "all7", "qv_rs", "mlp16", "all7", None]  # the adapter of each prompt


def _requests(models, first_id: int = 1) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, first_id + i, str(models.adapters[name]))
            for i, name in enumerate(ADAPTERS)}


def check_against_peft(models, outputs, prompts=PROMPTS, order=ORDER) -> None:
    for prompt, name, out in zip(prompts, order, outputs, strict=True):
        tokens, logprobs = peft_greedy(models, name, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert list(got.token_ids) == tokens, f"adapter {name}"
        mine = [step[t].logprob for step, t in zip(got.logprobs, got.token_ids, strict=True)]
        assert max(abs(a - b) for a, b in zip(mine, logprobs, strict=True)) < 1e-3, name


@pytest.fixture(scope="module")
def llama_llm(llama_lora):
    return LLM(str(llama_lora.base), enable_lora=True, max_loras=4, max_lora_rank=16,
               max_cpu_loras=4, enable_prefix_caching=True, max_model_len=128,
               max_num_seqs=8, max_num_batched_tokens=256, dtype="float32")


def test_mixed_batch_matches_peft_llama(llama_lora, llama_llm):
    reqs = _requests(llama_lora)
    outs = llama_llm.generate(PROMPTS, GREEDY, lora_request=[reqs.get(n) for n in ORDER])
    check_against_peft(llama_lora, outs)
    kv = llama_llm.engine.kv
    assert kv.prefix_cache_stats.hits > 0  # same prompt and adapter: blocks shared
    assert kv.num_free_blocks == kv.pool.num_blocks - 1  # nothing held after the batch


def test_multi_step_decode_matches_peft(llama_lora):
    """Three adapters and the base model decoding 4 steps per call (num_scheduler_steps)."""
    llm = LLM(str(llama_lora.base), enable_lora=True, max_loras=4, max_lora_rank=16,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256, dtype="float32",
              num_scheduler_steps=4)
    reqs = _requests(llama_lora)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[reqs.get(n) for n in ORDER])
    assert llm.engine.runner._multi._compiled, "the multi-step decode never ran"
    check_against_peft(llama_lora, outs)


def test_new_adapters_reuse_slots_without_recompiling(llama_lora, llama_llm):
    """Four more adapters (new ids: new slots) evict the LRU rows; same shapes, no compile."""
    llama_llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, _requests(llama_lora)["all7"]])
    runner, manager = llama_llm.engine.runner, llama_llm.engine.lora
    compiles, writes = runner.num_compiles, manager.num_slot_writes
    fresh = _requests(llama_lora, first_id=100)
    fresh["extra"] = LoRARequest("extra", 200, fresh["all7"].lora_path)
    loras = [fresh["extra"], fresh["qv_rs"], fresh["all7"], fresh["mlp16"]]
    outs = llama_llm.generate(PROMPTS[:1] * 4, GREEDY, lora_request=loras)
    check_against_peft(llama_lora, outs, PROMPTS[:1] * 4, ["all7", "qv_rs", "all7", "mlp16"])
    assert manager.num_slot_writes == writes + 4
    assert runner.num_compiles == compiles, "loading adapters recompiled the step"


def test_bad_requests_fail_alone(llama_lora, llama_llm, tmp_path):
    bad = LoRARequest("missing", 999, str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="not a local folder"):
        llama_llm.generate(PROMPTS[:2], GREEDY, lora_request=[None, bad])
    outs = llama_llm.generate(PROMPTS[3:4], GREEDY,
                              lora_request=_requests(llama_lora)["mlp16"])
    check_against_peft(llama_lora, outs, PROMPTS[3:4], ["mlp16"])
    kv = llama_llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert not llama_llm.engine.has_unfinished_requests()


def test_lora_without_enable_lora_is_refused(llama_lora):
    llm = LLM(str(llama_lora.base), max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[5, 6]], GREEDY, lora_request=_requests(llama_lora)["all7"])


def test_qwen2_max_loras_one(qwen2_lora):
    """max_loras=1: each step runs one adapter (others wait), outputs still peft's."""
    llm = LLM(str(qwen2_lora.base), enable_lora=True, max_loras=1, max_lora_rank=16,
              max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256,
              dtype="float32")
    manager, per_step = llm.engine.lora, []
    activate = manager.activate
    manager.activate = lambda reqs: per_step.append({r for r in reqs if r}) or activate(reqs)
    reqs = _requests(qwen2_lora)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[reqs.get(n) for n in ORDER])
    check_against_peft(qwen2_lora, outs)
    assert max(len(s) for s in per_step) == 1
    assert len({r for s in per_step for r in s}) == 3


def test_phi3_fused_projections_match_peft(tmp_path_factory):
    """PEFT on Phi-3 adapts the fused qkv_proj and gate_up_proj Linears; pjinfer splits them."""
    from tests.lora.conftest import LoRAModels, build_adapter, build_base

    root = tmp_path_factory.mktemp("lora_phi3")
    base = build_base(root, "phi3")
    models = LoRAModels(base, {"fused": build_adapter(
        base, root, "fused", 8, 16, False, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        seed=3)})
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_model_len=128,
              max_num_seqs=8, max_num_batched_tokens=256, dtype="float32")
    lora = LoRARequest("fused", 1, str(models.adapters["fused"]))
    outs = llm.generate(PROMPTS[2:4], GREEDY, lora_request=[lora, None])
    check_against_peft(models, outs, PROMPTS[2:4], ["fused", None])


def test_lora_engine_arguments_are_checked():
    from pjinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer"):
        EngineConfig(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")


def test_adapter_gone_from_disk_fails_only_its_requests(llama_lora, llama_llm, tmp_path):
    """Evicted from the host cache and deleted before its first step: its request fails with
    the reason, the base request of the same step finishes, no block stays held."""
    import shutil

    folder = tmp_path / "doomed"
    shutil.copytree(llama_lora.adapters["qv_rs"], folder)
    doomed = LoRARequest("doomed", 500, str(folder))
    engine = llama_llm.engine
    engine.add_request("doomed-req", PROMPTS[3], GREEDY, lora_request=doomed)
    engine.add_request("base-req", PROMPTS[5], GREEDY)
    engine.remove_lora(doomed)
    shutil.rmtree(folder)
    outputs, failures = {}, {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        failures.update(engine.take_failures())
    assert "not a local folder" in str(failures["doomed-req"])
    check_against_peft(llama_lora, [outputs["base-req"]], PROMPTS[5:], [None])
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks - 1
