"""GGUF files (F16, BF16, F32, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K) through the engine
equal transformers loading the same file with `gguf_file=`: greedy tokens for 24 tokens,
logits within 1e-3."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer import LLM
from pjinfer.errors import ModelLoadError
from pjinfer.models.dense import dense_logits
from pjinfer.quantization.weight import QuantizedWeight
from tests.quantization.gguf_writer import GGUF_TINY, OTHER_TYPES, write_gguf
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
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt), prompt
    _logits_match(llm, oracle)


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
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY), strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(oracle, prompt), prompt
    _logits_match(llm, oracle)


def test_unsupported_tensor_type_names_the_tensor(tmp_path):
    config = transformers.LlamaConfig(**GGUF_TINY)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "iq2.gguf", "llama", extra_types={"ffn_down": "IQ2_XXS"})
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_down.weight' has GGUF type IQ2_XXS"):
        LLM(str(path), **ENGINE)
