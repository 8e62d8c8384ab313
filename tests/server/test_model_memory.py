"""A pooled model's KV cache is sized in the dtype the engine will store it in."""

from __future__ import annotations

from pjinfer.server.model_memory import kv_bytes


def test_kv_bytes_follow_the_kv_cache_dtype():
    # the demo model stores its cache in float32 by default
    plain = kv_bytes(None, {"num_kv_blocks": 10})
    assert kv_bytes(None, {"num_kv_blocks": 10, "kv_cache_dtype": "fp8"}) * 4 == plain
    assert kv_bytes(None, {"num_kv_blocks": 10, "dtype": "bfloat16"}) * 2 == plain
    assert kv_bytes(None, {"kv_cache_memory": 12345}) == 12345


def test_weight_bytes_count_quantized_linears_at_their_bits(tmp_path):
    """A quantized model's weights are planned at their stored size, not the model dtype's."""
    import json
    import math
    import shutil

    from pjinfer.config import ModelConfig
    from pjinfer.demo import DEMO_MODEL_DIR
    from pjinfer.quantization.loader import quantizable
    from pjinfer.server.model_memory import weight_bytes

    cfg = ModelConfig.from_pretrained(DEMO_MODEL_DIR)
    linears = [p.shape for p in cfg.param_specs() if quantizable(p)]
    plain = weight_bytes(None, "float32")
    int8 = weight_bytes(None, "float32", "int8")  # on the fly: 1 byte + a scale per column
    assert plain - int8 == sum(r * c * 3 - 4 * c for r, c in linears)
    folder = tmp_path / "gptq"
    shutil.copytree(DEMO_MODEL_DIR, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "sym": False, "desc_act": True}
    (folder / "config.json").write_text(json.dumps(raw))
    gptq = sum(r * c // 2 + math.ceil(r / 32) * 8 * c + 4 * r for r, c in linears)
    assert plain - weight_bytes(str(folder), "float32") == sum(
        r * c * 4 for r, c in linears) - gptq


def test_a_bad_quantization_is_a_load_error_not_a_memory_one():
    """The pool answers model_load_failed for it (a ValueError would read as no memory)."""
    import pytest

    from pjinfer.errors import ModelLoadError
    from pjinfer.server.model_memory import check_fits

    with pytest.raises(ModelLoadError, match="quantization='bogus'"):
        check_fits("m", None, {"quantization": "bogus"}, 0.5, 1 << 30)


def test_a_gguf_file_and_hf_config_path_are_planned_from_the_config_the_engine_reads(tmp_path):
    """A GGUF file has no config.json: its metadata gives the shapes (its tensors counted as
    float, as the loader's planning does); hf_config_path's config.json wins when given."""
    import shutil

    import pytest

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from pjinfer.demo import DEMO_MODEL_DIR
    from pjinfer.server.model_memory import weight_bytes
    from tests.quantization.gguf_writer import LAYER_TYPES, write_gguf

    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR,
                                                              dtype=torch.float32)
    path = write_gguf(model, tmp_path / "demo.gguf", "llama", extra_types=dict.fromkeys(
        LAYER_TYPES, "Q8_0"))
    plain = weight_bytes(None, "float32")
    assert weight_bytes(str(path), "float32") == plain
    assert kv_bytes(str(path), {"num_kv_blocks": 10}) == kv_bytes(None, {"num_kv_blocks": 10})
    config = tmp_path / "config"
    config.mkdir()
    shutil.copy(DEMO_MODEL_DIR / "config.json", config)
    assert weight_bytes(str(path), "float32", hf_config_path=str(config)) == plain
