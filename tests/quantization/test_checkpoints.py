"""Pre-quantized checkpoints through the engine equal transformers running the same model with
the dequantized weights in float32: greedy tokens identical for 24 tokens, logits within 1e-3
relative; Llama and Qwen2, chunked prefill and prefix caching on, and at tp=2."""

from __future__ import annotations

import random

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.errors import ModelLoadError
from pjinfer.models.dense import dense_logits
from pjinfer.quantization.weight import QuantizedWeight
from tests.engine.idle import assert_idle
from tests.quantization import checkpoints

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
_rng = random.Random(0)
_PREFIX = [1] + [_rng.randrange(3, 128) for _ in range(12)]  # shared: prefix caching hits
PROMPTS = [_PREFIX + [_rng.randrange(3, 128) for _ in range(n)] for n in (4, 9, 7)]


@pytest.fixture(scope="module")
def float_models():
    models = {}
    for arch, cls in (("llama", "LlamaConfig"), ("qwen2", "Qwen2Config")):
        torch.manual_seed(len(arch))
        config = getattr(transformers, cls)(**checkpoints.QUANT_TINY)
        models[arch] = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32).eval()
    return models


@pytest.fixture(scope="module")
def quantized(float_models, tmp_path_factory):
    """(arch, scheme) -> (folder, dequantized transformers model), written once."""
    root, made = tmp_path_factory.mktemp("quantized"), {}

    def get(arch: str, name: str):
        if (arch, name) not in made:
            folder = root / f"{arch}-{name}"
            made[arch, name] = folder, checkpoints.write(float_models[arch], folder, name)
        return made[arch, name]
    return get


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                         min_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check(llm: LLM, oracle) -> None:
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt), prompt
    assert_idle(llm.engine)
    params = llm.engine.runner.params
    assert isinstance(params["layers"][0]["q_proj"], QuantizedWeight)
    n = max(map(len, PROMPTS))
    tokens = np.zeros((len(PROMPTS), n), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    got = np.asarray(dense_logits(params, llm.engine.model_config, jnp.asarray(tokens),
                                  jnp.asarray([len(p) for p in PROMPTS], jnp.int32)))
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            want = oracle(torch.tensor([p])).logits[0].numpy()
        err = np.abs(got[i, :len(p)] - want).max() / np.abs(want).max()
        assert err < 1e-3, (p, err)


ENGINE = dict(dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=16,
              max_num_seqs=4, warmup=False)


@pytest.mark.parametrize("arch, name", [
    ("llama", "gptq4_g32_asym_act"), ("llama", "awq_g64"), ("llama", "ct_w4a16_g128"),
    ("llama", "fp8_channel"), ("qwen2", "fp8_block"), ("qwen2", "gptq8_gall_sym"),
    ("qwen2", "ct_w8a16_g64"), ("qwen2", "ct_fp8_tensor"), ("llama", "ct_fp8_block"),
    ("llama", "ct_w8a8_int"), ("qwen2", "ct_w4a16_asym_act"),
])
def test_engine_matches_transformers_on_dequantized_weights(quantized, arch, name):
    folder, oracle = quantized(arch, name)
    llm = LLM(str(folder), **ENGINE)
    assert llm.engine.quantization_method == checkpoints.scheme(name)[1]["quant_method"]
    int4 = llm.engine.runner.params["layers"][0]["q_proj"].kind == "int4"
    assert llm.engine.runner.seq_sizes == ((2, 4) if int4 else None)  # a 2-sequence bucket
    _check(llm, oracle)


@pytest.mark.parametrize("arch, name", [("llama", "gptq4_g64_asym_act"), ("qwen2", "awq_g32"),
                                        ("llama", "fp8_block"), ("llama", "ct_w4a16_asym_act")])
def test_tensor_parallel_2(quantized, arch, name):
    folder, oracle = quantized(arch, name)
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)
    down = llm.engine.runner.params["layers"][0]["down_proj"]  # row-parallel: groups split
    assert len(down.packed.sharding.device_set) == 2
    assert down.scales.sharding.shard_shape(down.scales.shape)[0] == down.scales.shape[0] // 2
    _check(llm, oracle)


@pytest.mark.parametrize("arch, name", [("llama", "fp8_channel"), ("qwen2", "ct_fp8_tensor")])
def test_fp8_at_tensor_parallel_4_duplicates_kv_heads(quantized, arch, name):
    """fp8 values stay [out, in]: at tp=4 over 2 kv heads each k / v projection holds every
    head twice along its first dim, split over the devices like the float weight."""
    folder, oracle = quantized(arch, name)
    llm = LLM(str(folder), tensor_parallel_size=4, **ENGINE)
    k = llm.engine.runner.params["layers"][0]["k_proj"]
    assert k.shape == k.packed.shape[::-1] and k.packed.shape[0] == 4 * 32  # 2 heads x 2, hd 32
    assert k.packed.sharding.shard_shape(k.packed.shape)[0] == 32
    _check(llm, oracle)


def test_missing_scales_name_the_tensor(quantized, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = quantized("llama", "awq_g64")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.scales"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing tensor 'model.layers.1.mlp.down_proj"
                                             ".scales'"):
        LLM(str(broken), **ENGINE)


def test_row_parallel_split_must_keep_whole_groups(quantized):
    folder, _ = quantized("llama", "gptq4_g128_sym")  # down_proj: 2 groups of 128 rows
    with pytest.raises(ModelLoadError, match="2 quantization groups .* tensor_parallel_size 4"):
        LLM(str(folder), tensor_parallel_size=4, **ENGINE)


def test_quantization_argument_must_match_the_checkpoint(quantized):
    folder, _ = quantized("llama", "awq_g64")
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        LLM(str(folder), quantization="gptq", **ENGINE)
    # vLLM's names for its kernels' variants confirm the method they run; on a float
    # checkpoint, a checkpoint format's name (modelopt: fp8) is one error, not fp8 at load
    assert LLM(str(folder), quantization="awq_marlin", **ENGINE).engine.quantization_method \
        == "awq"
    with pytest.raises(ValueError, match="'modelopt' needs a checkpoint quantized with it"):
        LLM(quantization="modelopt", **ENGINE)  # the float demo model


@pytest.mark.parametrize("name", ["fp8_channel", "fp8_block", "ct_fp8_block"])
def test_fused_fp8_tensors_are_dequantized_at_load(hf_models, tmp_path, name):
    """Phi-3 stores q/k/v and gate/up as fused tensors, which pjinfer slices at load and keeps
    float: stored fp8 they are dequantized with their `weight_scale` (or block-wise
    `weight_scale_inv`; read as stored they were off by that scale, silently); o_proj and
    down_proj stay fp8."""
    folder = tmp_path / "phi3-fp8"
    oracle_dir = checkpoints.folder(hf_models["phi3"], folder, name)
    # within original_max_position_embeddings (64): LongRoPE's short factors, as transformers
    llm = LLM(str(folder), max_model_len=64, **ENGINE)
    layer = llm.engine.runner.params["layers"][0]
    assert isinstance(layer["o_proj"], QuantizedWeight)
    assert not isinstance(layer["q_proj"], QuantizedWeight)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(oracle_dir,
                                                               dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt), prompt


def test_fused_int_packed_tensors_are_refused_by_name(hf_models, tmp_path):
    """A GPTQ Phi-3 stores its fused qkv_proj as `qweight`: one error naming that tensor, not
    a missing `.weight`."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "phi3-gptq"
    shutil.copytree(hf_models["phi3"], folder)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj"
    del tensors[f"{name}.weight"]
    tensors[f"{name}.qweight"] = np.zeros((8, 96), np.int32)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{name}.qweight' is stored int-packed"):
        LLM(str(folder), **ENGINE)


@pytest.mark.parametrize("flavour", ["modelopt", "fbgemm_fp8"])
def test_modelopt_and_fbgemm_fp8_checkpoints(quantized, tmp_path, flavour):
    """NVIDIA ModelOpt's FP8 export (hf_quant_config.json, per-tensor weight_scale, static
    input_scale left unused, KV scales as k_proj.k_scale / v_proj.v_scale) and fbgemm's
    (per-channel weight_scale): read as the fp8 checkpoints they are."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from pjinfer.quantization.kv_cache import kv_cache_scales

    folder, oracle = quantized("llama", "fp8_tensor" if flavour == "modelopt" else "fp8_channel")
    copy = tmp_path / flavour
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    if flavour == "modelopt":
        del config["quantization_config"]
        (copy / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt"},
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                             "exclude_modules": ["lm_head"]}}))
        attn = "model.layers.0.self_attn"
        save_file({f"{attn}.q_proj.input_scale": np.array(0.02, np.float32),
                   f"{attn}.k_proj.k_scale": np.array(0.5, np.float32),
                   f"{attn}.v_proj.v_scale": np.array(0.25, np.float32)},
                  copy / "extra.safetensors")
        assert kv_cache_scales(copy, 2, "auto") == ((0.5, 0.25), (1.0, 1.0))
    else:
        config["quantization_config"] = {"quant_method": "fbgemm_fp8",
                                         "activation_scale_ub": 1200.0,
                                         "modules_to_not_convert": ["lm_head"]}
    (copy / "config.json").write_text(json.dumps(config))
    llm = LLM(str(copy), quantization=flavour, **ENGINE)  # vLLM's name confirms the method
    assert llm.engine.quantization_method == "fp8"
    _check(llm, oracle)


def test_unsupported_modelopt_algorithm_and_bad_json_are_named(quantized, tmp_path):
    import json
    import shutil

    folder, _ = quantized("llama", "fp8_tensor")
    copy = tmp_path / "nvfp4"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "NVFP4", "group_size": 16}}))
    with pytest.raises(ValueError, match="ModelOpt quant_algo 'NVFP4' is not supported"):
        LLM(str(copy), **ENGINE)
    (copy / "hf_quant_config.json").write_text("{quantization: FP8")
    with pytest.raises(ValueError, match="hf_quant_config.json is not valid JSON"):
        LLM(str(copy), **ENGINE)
