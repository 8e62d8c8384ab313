"""`pjinfer convert` to orbax, and restoring it (onto a mesh) gives identical weights and logits."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pjinfer
from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.models.dense import dense_logits
from pjinfer.sharding import convert
from pjinfer.sharding.checkpoint import MARKER, is_orbax_checkpoint
from pjinfer.weights import load_engine_model, load_model

IDS = np.array([[1, 5, 9, 13, 17, 21, 25, 29]], np.int32)


def _same_params(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_convert_then_load_gives_identical_logits(hf_models, tmp_path):
    from pjinfer.cli import main as pjinfer_main

    src, dst = hf_models["llama"], tmp_path / "llama_orbax"
    assert pjinfer_main(["convert", str(src), str(dst)]) == 0  # `pjinfer convert SRC DST`
    assert is_orbax_checkpoint(dst) and (dst / "config.json").is_file()
    assert not list(dst.glob("*.safetensors"))
    cfg, ref = load_model(src)
    cfg2, restored = load_model(dst)  # auto-detects the orbax marker
    assert cfg2 == cfg
    _same_params(restored, ref)
    lengths = np.array([IDS.shape[1]], np.int32)
    np.testing.assert_array_equal(np.asarray(dense_logits(restored, cfg, IDS, lengths)),
                                  np.asarray(dense_logits(ref, cfg, IDS, lengths)))


def test_sharded_convert_restores_onto_any_mesh(gqa8_model, tmp_path):
    """Converted on tp=2, restored on tp=8 (kv heads duplicated after restore) = safetensors."""
    dst = tmp_path / "gqa8_orbax"
    convert.main([str(gqa8_model), str(dst), "--tensor-parallel-size", "2"])
    _, restored, _ = load_engine_model(dst, tensor_parallel_size=8)
    _, ref, _ = load_engine_model(gqa8_model, tensor_parallel_size=8)
    assert restored["layers"][0]["k_proj"].sharding.spec == P(None, "tp")
    _same_params(restored, ref)
    tokens = [pjinfer.LLM(str(path), tensor_parallel_size=tp).generate(
        [[1, 9, 40, 3]], pjinfer.SamplingParams(temperature=0, max_tokens=6))[0]
        .outputs[0].token_ids for path, tp in ((dst, 4), (gqa8_model, 1))]
    assert tokens[0] == tokens[1]


def test_bfloat16_convert_stores_bfloat16(hf_models, tmp_path):
    dst = tmp_path / "qwen3_bf16"
    convert.main([str(hf_models["qwen3"]), str(dst), "--dtype", "bfloat16"])
    assert '"bfloat16"' in (dst / MARKER).read_text()
    _, restored = load_model(dst)
    _same_params(restored, load_model(hf_models["qwen3"], dtype="bfloat16")[1])


def test_convert_rejects_missing_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.main([str(tmp_path / "nope"), str(tmp_path / "out")])
    assert "is not a folder" in capsys.readouterr().err


def test_demo_model_served_from_orbax_equals_safetensors(tmp_path):
    """The converted folder serves the same model (load times: benchmarks/bench_load.py)."""
    dst = tmp_path / "demo_orbax"
    convert.main([str(DEMO_MODEL_DIR), str(dst)])
    out = pjinfer.LLM(str(dst)).generate("Hello", pjinfer.SamplingParams(temperature=0,
                                                                         max_tokens=5))
    ref = pjinfer.LLM(None).generate("Hello", pjinfer.SamplingParams(temperature=0,
                                                                     max_tokens=5))
    assert out[0].outputs[0].text == ref[0].outputs[0].text
