"""GGUF files (F16, BF16, F32, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K; Llama, Qwen2, Qwen3,
Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE) through the engine equal transformers loading the same
file with `gguf_file=` (greedy tokens for 24 tokens, logits within 1e-3), or, where that
reader drops what the file holds (Mixtral's experts, rope factors, Phi-3's window),
transformers running the original model on the same weights."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer import LLM
from pjinfer.errors import ModelLoadError
from pjinfer.models.dense import dense_logits
from pjinfer.quantization.gguf_file import ARCHITECTURES, GGUFIndex
from pjinfer.quantization.weight import QuantizedWeight
from tests.quantization.gguf_writer import GGUF_TINY, LAYER_TYPES, OTHER_TYPES, write_gguf
from tests.quantization.test_checkpoints import ENGINE, GREEDY, PROMPTS, _hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """arch -> (the .gguf path, transformers' model read from it)."""
    root, out = tmp_path_factory.mktemp("gguf"), {}
    for arch, cls in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config")):
        torch.manual_seed(7)
        config = getattr(transformers, cls)(**GGUF_TINY)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folder = root / arch
        folder.mkdir()
        path = write_gguf(model, folder / "model.gguf", arch)
        oracle = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file="model.gguf", dtype=torch.float32).eval()
        out[arch] = path, oracle
    return out


def _logits_match(llm: LLM, oracle) -> None:
    n = max(map(len, PROMPTS))
    tokens = np.zeros((len(PROMPTS), n), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    got = np.asarray(dense_logits(llm.engine.runner.params, llm.engine.model_config,
                                  jnp.asarray(tokens), jnp.asarray([len(p) for p in PROMPTS])))
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            want = oracle(torch.tensor([p])).logits[0].numpy()
        assert np.abs(got[i, :len(p)] - want).max() / np.abs(want).max() < 1e-3


def _check(llm: LLM, oracle) -> None:
    """Greedy tokens of every prompt and the logits equal the oracle's."""
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt), prompt
    _logits_match(llm, oracle)


def _differs_from_transformers_reading(llm: LLM, folder) -> None:
    """transformers' own reading of the folder's model.gguf (which drops what the test is
    about) gives other logits: the test exercises what it says."""
    dropped = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="model.gguf", dtype=torch.float32).eval()
    with pytest.raises(AssertionError):
        _logits_match(llm, dropped)


def _as_stored(model) -> None:
    """The float model as a GGUF file of F32 layers stores it: F16 embeddings, a BF16 head."""
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight.half())
        model.lm_head.weight.copy_(model.lm_head.weight.bfloat16())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_matches_transformers_gguf(gguf_files, arch):
    path, oracle = gguf_files[arch]
    llm = LLM(str(path if arch == "llama" else path.parent), **ENGINE)  # file, or its folder
    assert llm.engine.quantization_method == "gguf"
    layer = llm.engine.runner.params["layers"][0]
    assert isinstance(layer["q_proj"], QuantizedWeight) and layer["q_proj"].kind == "int4"
    assert isinstance(layer["k_proj"], QuantizedWeight) and layer["k_proj"].kind == "int8"
    assert layer["q_proj"].scales.shape[0] == GGUF_TINY["hidden_size"] // 32  # Q4_0 blocks
    assert not isinstance(layer["v_proj"], QuantizedWeight)  # Q4_K: dequantized at load
    _check(llm, oracle)


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaConfig"), ("qwen2", "Qwen2Config")])
def test_engine_matches_transformers_on_the_other_types(tmp_path, arch, cls):
    """Every layer weight in a type dequantized at load (Q5_0, Q4_1, Q5_1, Q5_K, Q3_K, Q2_K):
    what Q5_K_M / Q3_K_M / Q2_K files hold, and Qwen2 files' fallbacks for rows a 256-wide
    super-block does not tile."""
    torch.manual_seed(11)
    config = getattr(transformers, cls)(**GGUF_TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "model.gguf", arch, extra_types=OTHER_TYPES, seed=3)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.quantization_method == "gguf"
    layer = llm.engine.runner.params["layers"][0]
    assert not any(isinstance(w, QuantizedWeight) for w in layer.values())
    _check(llm, oracle)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_2(gguf_files, arch):
    """The packed Q4_0 / Q8_0 weights shard like their float form (q_proj column-parallel:
    its blocks' output rows split; the K-quants, dequantized, as float weights)."""
    path, oracle = gguf_files[arch]
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    q = llm.engine.runner.params["layers"][0]["q_proj"]
    assert isinstance(q, QuantizedWeight) and len(q.packed.sharding.device_set) == 2
    _check(llm, oracle)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    config = transformers.LlamaConfig(**GGUF_TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "iq2.gguf", "llama", extra_types={"ffn_down": "IQ2_XXS"})
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_down.weight' has GGUF type IQ2_XXS"):
        LLM(str(path), **ENGINE)


MOE_TYPES = {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q6_K"}
# transformers reads neither field of a Qwen2-MoE GGUF: its defaults (1408, 5632) it is
ARCH_CASES = {
    "qwen3": ("Qwen3Config", dict(head_dim=128), {}),  # transformers' GGUF Qwen3 head_dim
    "qwen3moe": ("Qwen3MoeConfig", dict(head_dim=64, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=768, norm_topk_prob=True),
                 MOE_TYPES),
    "qwen2moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2),
                 {**MOE_TYPES, "ffn_down_exps": "Q8_0", "ffn_gate_shexp": "Q4_0",
                  "ffn_up_shexp": "Q8_0", "ffn_down_shexp": "Q5_K"}),
}


@pytest.mark.parametrize("arch, parallel", [
    ("qwen3", {}), ("qwen3moe", {}), ("qwen2moe", {}),
    ("qwen3moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    ("qwen2moe", dict(tensor_parallel_size=2))],
    ids=["qwen3", "qwen3moe", "qwen2moe", "qwen3moe-tp2-ep", "qwen2moe-tp2"])
def test_qwen3_and_moe_gguf_match_transformers(tmp_path, arch, parallel):
    """Qwen3 (q / k norms) and the MoE files (llama.cpp's [E, ...] expert stacks, router,
    Qwen2-MoE's shared expert and its [D] gate) through the engine equal transformers reading
    the same file: greedy tokens and logits; at tp=2 too, experts whole a device (expert
    parallel) or split over their width."""
    cls, fields, types = ARCH_CASES[arch]
    torch.manual_seed(5)
    config = getattr(transformers, cls)(**GGUF_TINY, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # decisive routing: top-k not decided by rounding
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    path = write_gguf(model, tmp_path / "model.gguf", arch, extra_types=types, seed=9)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    llm = LLM(str(path), **ENGINE, **parallel)
    assert type(oracle).__name__ == ARCHITECTURES[arch]
    assert llm.engine.model_config.architecture == ARCHITECTURES[arch]
    layer = llm.engine.runner.params["layers"][0]
    assert ("router" in layer) == arch.endswith("moe")
    if parallel:
        assert len(layer["experts_gate_up"].sharding.device_set) == 2
    _check(llm, oracle)


def test_a_missing_expert_stack_names_the_tensor(tmp_path, monkeypatch):
    """A Qwen3-MoE file without one layer's ffn_up_exps: a load error naming what is
    missing, not a shape error deep in the loader."""
    import tests.quantization.gguf_writer as writer

    whole = writer._layer_tensors
    monkeypatch.setattr(writer, "_layer_tensors", lambda *a: [
        t for t in whole(*a) if not (t[0] == "ffn_up_exps" and a[0].startswith("model.layers.1"))])
    cls, fields, _ = ARCH_CASES["qwen3moe"]
    config = getattr(transformers, cls)(**GGUF_TINY, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "model.gguf", "qwen3moe")
    with pytest.raises(ModelLoadError, match="experts.gate_up_proj'.*in the file: "
                       "'blk.1.ffn_gate_exps.weight', 'blk.1.ffn_up_exps.weight'"):
        LLM(str(path), **ENGINE)


def test_the_demo_model_as_gguf_brings_its_tokenizer_and_chat_template(tmp_path):
    """The demo model written as a GGUF file (float tensors) with its byte-level BPE tokenizer
    and chat template in the metadata, as llama.cpp's converter stores them: the engine builds
    its tokenizer from the file alone and answers with the same text as the demo folder."""
    from pjinfer.demo import DEMO_MODEL_DIR, zen_lines
    from pjinfer.sampling_params import SamplingParams
    from pjinfer.tokenizer import load_tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR,
                                                              dtype=torch.float32)
    path = write_gguf(model, tmp_path / "demo.gguf", "llama", tokenizer=DEMO_MODEL_DIR,
                      extra_types=dict.fromkeys(LAYER_TYPES))
    got, want = load_tokenizer(path), load_tokenizer(DEMO_MODEL_DIR)
    for text in [*zen_lines(), "héllo wörld 🙂", "<|user|>\nhi</s>"]:
        assert got.encode(text) == want.encode(text), text
    assert got.chat_template == want.chat_template
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    from_file, from_folder = (LLM(str(m), dtype="float32", warmup=False)
                              for m in (path, DEMO_MODEL_DIR))
    prompts = ["Beautiful is", "Errors should never"]
    texts = [[o.outputs[0].text for o in llm.generate(prompts, greedy)]
             for llm in (from_file, from_folder)]
    assert texts[0] == texts[1] and texts[0][0].startswith(" better than ugly."), texts
    chat = [{"role": "user", "content": "What is the Zen of Python?"}]
    answers = [llm.chat(chat, greedy)[0].outputs[0].text for llm in (from_file, from_folder)]
    assert answers[0] == answers[1] and answers[0], answers


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    """A Llama 3.1 file: llama.cpp stores its rope scaling as the `rope_freqs` tensor (one
    divisor a frequency), which transformers' GGUF reader ignores. The engine applies it, so it
    matches transformers running the original float model (same weights: F32 tensors), and
    not transformers' reading of the file."""
    torch.manual_seed(3)
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16)
    config = transformers.LlamaConfig(**GGUF_TINY, rope_parameters=rope)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _as_stored(model)
    path = write_gguf(model, tmp_path / "model.gguf", "llama",
                      extra_types=dict.fromkeys(LAYER_TYPES))
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.model_config.rope_scaling.short_factor[-1] == 8.0
    _check(llm, model)
    _differs_from_transformers_reading(llm, tmp_path)


@pytest.mark.parametrize("parallel", [{}, dict(tensor_parallel_size=2,
                                                enable_expert_parallel=True)])
def test_mixtral_gguf(tmp_path, parallel):
    """llama.cpp writes Mixtral as a `llama` with `expert_count` and [E, ...] expert stacks,
    which transformers' GGUF reader loads as a dense Llama; the oracle is transformers' Mixtral
    with the same (float) weights."""
    torch.manual_seed(4)
    config = transformers.MixtralConfig(**GGUF_TINY, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for i in range(config.num_hidden_layers):  # decisive routing
            model.model.layers[i].mlp.gate.weight.normal_(0.0, 0.5)
    _as_stored(model)
    path = write_gguf(model, tmp_path / "model.gguf", "llama",
                      extra_types=dict.fromkeys(LAYER_TYPES))
    llm = LLM(str(path), **ENGINE, **parallel)
    assert llm.engine.model_config.architecture == "MixtralForCausalLM"
    _check(llm, model)


@pytest.mark.parametrize("scaling, error", [("linear", None), ("yarn", "rope scaling 'yarn'")])
def test_rope_scaling_metadata(tmp_path, scaling, error):
    """`rope.scaling.type`: linear (with its factor) as transformers' linear scaling; a type
    pjinfer does not implement is one clear error, not a silently different model."""
    config = transformers.LlamaConfig(**GGUF_TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "model.gguf", "llama",
                      metadata={"llama.rope.scaling.type": scaling,
                                "llama.rope.scaling.factor": 4.0})
    if error:
        with pytest.raises(ModelLoadError, match=error):
            LLM(str(path), **ENGINE)
        return
    assert GGUFIndex(path).hf_config()["rope_scaling"] == dict(rope_type="linear", factor=4.0)
    assert LLM(str(path), **ENGINE).engine.model_config.rope_scaling.factor == 4.0


def test_hf_config_path_describes_a_gguf_file(tmp_path):
    """A file whose converter wrote no rope scaling (no `rope_freqs`): `hf_config_path`, the
    original model's folder, gives the config (vLLM's flag for GGUF metadata that falls
    short), so the engine matches transformers running the original model; a folder without
    config.json is one clear error."""
    torch.manual_seed(3)
    rope = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=16)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**GGUF_TINY, rope_parameters=rope), dtype=torch.float32).eval()
    _as_stored(model)
    original = tmp_path / "original"
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(original)  # config.json alone
    plain = transformers.LlamaConfig(**GGUF_TINY)  # the file as if rope scaling were lost
    path = write_gguf(transformers.AutoModelForCausalLM.from_config(plain), tmp_path / "m.gguf",
                      "llama", extra_types=dict.fromkeys(LAYER_TYPES), state=model.state_dict())
    assert "rope_scaling" not in GGUFIndex(path).hf_config()
    llm = LLM(str(path), hf_config_path=str(original), **ENGINE)
    assert llm.engine.model_config.rope_scaling.rope_type == "llama3"
    _check(llm, model)
    with pytest.raises(ModelLoadError, match="hf_config_path .* has no config.json"):
        LLM(str(path), hf_config_path=str(tmp_path), **ENGINE)


def test_phi3_gguf(tmp_path):
    """Phi-3: llama.cpp keeps its fused attn_qkv and ffn_up (gate | up), read as the fused
    checkpoint tensors the model slices (dequantized: a Q8_0 / Q4_0 fused tensor is not a
    Linear weight), against transformers reading the same file."""
    torch.manual_seed(8)
    config = transformers.Phi3Config(**GGUF_TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "model.gguf", "phi3",
                      extra_types={"attn_qkv": "Q8_0", "ffn_up": "Q4_0"})
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="model.gguf", dtype=torch.float32).eval()
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.model_config.architecture == "Phi3ForCausalLM"
    _check(llm, oracle)


def test_phi3_sliding_window_from_the_metadata(tmp_path):
    """`phi3.attention.sliding_window` (which transformers' GGUF reader leaves out): prompts
    longer than the window match transformers' Phi-3 with that window."""
    torch.manual_seed(10)
    config = transformers.Phi3Config(**GGUF_TINY, sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _as_stored(model)
    path = write_gguf(model, tmp_path / "model.gguf", "phi3",
                      extra_types=dict.fromkeys(LAYER_TYPES))
    llm = LLM(str(path), **ENGINE)
    assert llm.engine.model_config.sliding_window(0) == 8
    assert min(map(len, PROMPTS)) > 8
    _check(llm, model)


def test_phi3_longrope_from_rope_factors(tmp_path):
    """Phi-3's LongRoPE as llama.cpp stores it (`rope_factors_short` / `_long` tensors, the
    original length and attention factor in the metadata), which transformers' GGUF reader
    drops: the engine (max_model_len within the original length: the short factors, as
    transformers takes for these prompts) matches transformers running the original model."""
    torch.manual_seed(9)
    pairs = GGUF_TINY["hidden_size"] // GGUF_TINY["num_attention_heads"] // 2
    rope = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.1 * i for i in range(pairs)],
                long_factor=[2.0 + 0.5 * i for i in range(pairs)])
    config = transformers.Phi3Config(**GGUF_TINY, rope_parameters=rope,
                                     original_max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _as_stored(model)
    path = write_gguf(model, tmp_path / "model.gguf", "phi3",
                      extra_types=dict.fromkeys(LAYER_TYPES))
    llm = LLM(str(path), **{**ENGINE, "max_model_len": 64})
    scaling = llm.engine.model_config.rope_scaling
    assert scaling.rope_type == "longrope" and scaling.original_max_position_embeddings == 64
    assert scaling.attention_factor == pytest.approx(float(np.sqrt(1 + np.log(4) / np.log(64))))
    _check(llm, model)
    _differs_from_transformers_reading(llm, tmp_path)


def test_missing_metadata_names_the_key(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_feed_forward_length", lambda *a: None)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**GGUF_TINY))
    path = write_gguf(model, tmp_path / "model.gguf", "llama")
    with pytest.raises(ModelLoadError, match="lacks llama.feed_forward_length; pass the "
                                             "original model's folder as hf_config_path"):
        LLM(str(path), **ENGINE)
