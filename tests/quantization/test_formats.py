"""Each checkpoint format's reader against its NumPy packer: the canonical weight dequantizes to
exactly what the packed tensors mean; bad tensors get one clear error naming them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.errors import ModelLoadError
from pjinfer.quantization import awq, compressed_tensors, fp8, gptq
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.weight import QuantizedWeight, dequantize
from tests.quantization import packers

OUT, IN = 48, 128
PREFIX = "model.layers.0.mlp.up_proj"


def _weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.3, (OUT, IN)).astype(np.float32)


def _decode(reader, tensors: dict, q: QuantConfig, shape=(IN, OUT)) -> np.ndarray:
    host = reader.read(lambda n: tensors[n.removeprefix(PREFIX + ".")], PREFIX, shape, q)
    qw = QuantizedWeight(**{k: jnp.asarray(v) for k, v in host.parts().items()},
                         kind=host.kind, zero_point=host.zero_point)
    return np.asarray(dequantize(qw)).T  # HF [out, in]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("sym, desc_act", [(True, False), (False, False), (False, True),
                                           (True, True)])
def test_gptq(bits, group_size, sym, desc_act):
    rng = np.random.default_rng(bits * abs(group_size))
    tensors, want = packers.gptq(_weight(), bits, group_size, sym, desc_act, rng)
    q = QuantConfig("gptq", bits, group_size, sym, desc_act)
    np.testing.assert_allclose(_decode(gptq, tensors, q), want, rtol=1e-6, atol=1e-7)


def test_gptq_v2_zeros_are_not_offset():
    tensors, want = packers.gptq(_weight(), 4, 32, False, False, np.random.default_rng(0))
    tensors["qzeros"] = packers._words(
        gptq.unpack_words(tensors["qzeros"], 4, axis=1) + 1, 4)  # v2: the zeros themselves
    q = QuantConfig("gptq", 4, 32, sym=False, fmt="gptq_v2")
    np.testing.assert_allclose(_decode(gptq, tensors, q), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq(group_size):
    tensors, want = packers.awq(_weight(1), group_size)
    q = QuantConfig("awq", 4, group_size, sym=False)
    np.testing.assert_allclose(_decode(awq, tensors, q), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits, group_size, sym, act", [
    (4, 32, True, False), (4, 128, True, False), (4, -1, True, False), (8, 64, True, False),
    (8, -1, True, False), (4, 32, False, False), (4, -1, False, False), (8, 64, False, False),
    (4, 32, False, True), (4, 64, True, True)])
@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_compressed_tensors_int(bits, group_size, sym, act, fmt):
    """Packed (int32 words) and naive (int8) values, symmetric and asymmetric, act-order."""
    rng = np.random.default_rng(bits) if act else None
    tensors, want = packers.ct_int(_weight(2), bits, group_size, sym=sym,
                                   packed=fmt == "pack-quantized", rng=rng)
    q = QuantConfig("compressed-tensors", bits, group_size, sym, desc_act=act, fmt=fmt)
    np.testing.assert_allclose(_decode(compressed_tensors, tensors, q), want, rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_int8_per_tensor(sym):
    """The tensor strategy: one scale (and zero point) for the whole weight."""
    w = _weight(4)
    scale, zero = np.float32(np.abs(w).max() / 100), np.int8(0 if sym else -7)
    values = np.clip(np.round(w / scale) + zero, -128, 127).astype(np.int8)
    tensors = dict(weight=values, weight_scale=np.array([scale], np.float32))
    if not sym:
        tensors["weight_zero_point"] = np.array([zero], np.int8)
    want = (values.astype(np.float32) - zero) * scale
    q = QuantConfig("compressed-tensors", 8, -1, sym, fmt="int-quantized")
    np.testing.assert_allclose(_decode(compressed_tensors, tensors, q), want, rtol=1e-6,
                               atol=1e-7)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_and_compressed_tensors_float(per_channel):
    tensors, want = packers.fp8(_weight(3), per_channel)
    for reader, q in ((fp8, QuantConfig("fp8", 8, kind="float")),
                      (compressed_tensors, QuantConfig("compressed-tensors", 8, kind="float",
                                                       fmt="float-quantized"))):
        np.testing.assert_allclose(_decode(reader, tensors, q), want, rtol=1e-6, atol=1e-7)


def test_config_json_spellings():
    cfg = QuantConfig.from_hf({"quant_method": "gptq", "bits": 8, "group_size": -1,
                               "desc_act": True, "sym": False})
    assert (cfg.method, cfg.bits, cfg.group_size, cfg.desc_act, cfg.sym) == \
        ("gptq", 8, -1, True, False)
    cfg = QuantConfig.from_hf({"quant_method": "awq", "bits": 4, "group_size": 64,
                               "zero_point": True, "version": "gemm"})
    assert (cfg.method, cfg.group_size, cfg.sym) == ("awq", 64, False)
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
            "group_size": 128}}}, "ignore": ["lm_head"]}
    cfg = QuantConfig.from_hf(ct)
    assert (cfg.bits, cfg.group_size, cfg.weight_kind) == (4, 128, "int4")
    weights = ct["config_groups"]["group_0"]["weights"]
    weights |= {"symmetric": False, "actorder": "group"}
    cfg = QuantConfig.from_hf(ct)
    assert (cfg.sym, cfg.desc_act) == (False, True)
    for order in ("weight", "static", None):  # groups stay contiguous: no weight_g_idx
        assert not QuantConfig.from_hf(ct | {"config_groups": {"group_0": {
            "weights": weights | {"actorder": order}}}}).desc_act
    # a group's own format (top level "mixed-precision") overrides the top level's
    mixed = ct | {"format": "mixed-precision", "config_groups": {"group_0": {
        "format": "int-quantized", "weights": weights | {"num_bits": 8}}}}
    assert (QuantConfig.from_hf(mixed).fmt, QuantConfig.from_hf(mixed).bits) == \
        ("int-quantized", 8)


def _ct_weights(**weights) -> dict:
    """A compressed-tensors float-quantized config with one weights scheme."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, **weights}}}}


def test_compressed_tensors_block_strategy_reads_its_blocks():
    cfg = QuantConfig.from_hf(_ct_weights(type="float", strategy="block",
                                          block_structure=[128, 64]))
    assert (cfg.weight_kind, cfg.block, cfg.group_size) == ("fp8", (128, 64), 64)


@pytest.mark.parametrize("raw, match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights are not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv' is not supported"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    (_ct_weights(type="int", strategy="block", block_structure=[128, 128]), "for int weights"),
    (_ct_weights(type="float", strategy="block"), "needs block_structure"),
    (_ct_weights(type="int", strategy="channel", actorder="dynamic"), "actorder 'dynamic'"),
    (_ct_weights(type="int", strategy="channel") | {"format": "marlin-24"},
     "format 'marlin-24' is not supported"),
])
def test_unsupported_configs_are_refused(raw, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig.from_hf(raw)


def test_group_size_that_does_not_divide_the_layer_names_the_tensor():
    tensors, _ = packers.gptq(_weight(), 4, 32, True, False, np.random.default_rng(0))
    with pytest.raises(ModelLoadError, match=f"{PREFIX}.qweight.*group_size 48 does not divide"):
        _decode(gptq, tensors, QuantConfig("gptq", 4, 48))


def test_wrong_shape_names_the_tensor():
    tensors, _ = packers.awq(_weight(), 32)
    tensors["scales"] = tensors["scales"][:, :8]
    with pytest.raises(ModelLoadError, match=f"{PREFIX}.scales.*has shape"):
        _decode(awq, tensors, QuantConfig("awq", 4, 32, sym=False))


def test_compressed_tensors_bad_zero_points_and_values_name_the_tensor():
    tensors, _ = packers.ct_int(_weight(), 4, 32, sym=False)
    q = QuantConfig("compressed-tensors", 4, 32, sym=False, fmt="pack-quantized")
    bad = tensors | {"weight_zero_point": tensors["weight_zero_point"][:, :2]}
    with pytest.raises(ModelLoadError, match=f"{PREFIX}.weight_zero_point.*has shape"):
        _decode(compressed_tensors, bad, q)
    tensors, _ = packers.ct_int(_weight(), 8, -1, packed=False)
    naive = QuantConfig("compressed-tensors", 8, -1, fmt="int-quantized")
    with pytest.raises(ModelLoadError, match=f"{PREFIX}.weight'? has dtype float32"):
        _decode(compressed_tensors, tensors | {"weight": _weight()}, naive)
