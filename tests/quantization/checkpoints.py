"""Tiny quantized checkpoints written by the NumPy packers, with their float oracle.

`write` replaces every decoder Linear weight of a float transformers model by one format's
tensors (config.json gets the matching `quantization_config`) and returns the same model with
the dequantized weights: transformers running it in float32 is the expected output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.quantization import packers

# 128 / 256 wide so group sizes 32, 64 and 128 all divide every layer
QUANT_TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FP8_BLOCK = (16, 32)  # [out, in]: not square, so a transposed block reads wrong
LINEAR = re.compile(r"(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj)\.weight")


def _ct(bits: int, group_size: int, *, sym: bool = True, actorder: str | None = None,
        fmt: str = "pack-quantized", activations: dict | None = None) -> dict:
    strategy = "channel" if group_size == -1 else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": None if group_size == -1 else group_size, "actorder": actorder}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations}},
            "ignore": ["lm_head"]}


INT8_TOKENS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True,
               "strategy": "token"}  # llm-compressor's W8A8 int8 activations
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"},
              "input_activations": {"num_bits": 8, "type": "float", "dynamic": True,
                                    "strategy": "token"}}}, "ignore": ["lm_head"]}


CT_FP8_BLOCK = {"quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                    "block_structure": list(FP8_BLOCK)}, "input_activations": {
                    "num_bits": 8, "type": "float", "dynamic": True, "strategy": "group",
                    "group_size": 128}}}, "ignore": ["lm_head"]}


def _renamed(packed: tuple[dict, np.ndarray], **names: str) -> tuple[dict, np.ndarray]:
    """A packer's (tensors, dequantized) with some tensors renamed (old=new)."""
    tensors, deq = packed
    return {names.get(k, k): v for k, v in tensors.items()}, deq


def scheme(name: str) -> tuple[Callable, dict]:
    """(packer of one weight, quantization_config) of a named test scheme."""
    rng = np.random.default_rng(0)
    table = {
        "gptq4_g32_asym_act": (lambda w: packers.gptq(w, 4, 32, False, True, rng),
                               {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                "desc_act": True, "sym": False}),
        "gptq4_g64_asym_act": (lambda w: packers.gptq(w, 4, 64, False, True, rng),
                               {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                "desc_act": True, "sym": False}),
        # act-order with one row order per input width: a MoE expert's gate and up share
        # theirs, as GPTQ gives them (one input, one Hessian)
        "gptq4_g32_asym_act_shared": (
            lambda w: packers.gptq(w, 4, 32, False, True, np.random.default_rng(w.shape[1])),
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
             "sym": False}),
        "gptq4_g32_asym": (lambda w: packers.gptq(w, 4, 32, False, False, rng),
                           {"quant_method": "gptq", "bits": 4, "group_size": 32,
                            "desc_act": False, "sym": False}),
        "gptq4_g128_sym": (lambda w: packers.gptq(w, 4, 128, True, False, rng),
                           {"quant_method": "gptq", "bits": 4, "group_size": 128,
                            "desc_act": False, "sym": True}),
        "gptq8_gall_sym": (lambda w: packers.gptq(w, 8, -1, True, False, rng),
                           {"quant_method": "gptq", "bits": 8, "group_size": -1,
                            "desc_act": False, "sym": True}),
        "awq_g64": (lambda w: packers.awq(w, 64),
                    {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                     "version": "gemm"}),
        "awq_g32": (lambda w: packers.awq(w, 32),
                    {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                     "version": "gemm"}),
        "ct_w4a16_g128": (lambda w: packers.ct_int(w, 4, 128), _ct(4, 128)),
        "ct_w8a16_g64": (lambda w: packers.ct_int(w, 8, 64), _ct(8, 64)),
        "ct_w8a16_g16": (lambda w: packers.ct_int(w, 8, 16), _ct(8, 16)),
        "ct_w4a16_g32": (lambda w: packers.ct_int(w, 4, 32), _ct(4, 32)),
        "ct_w4a16_asym_act": (lambda w: packers.ct_int(w, 4, 32, sym=False, rng=rng),
                              _ct(4, 32, sym=False, actorder="group")),
        "ct_w8a8_int": (lambda w: packers.ct_int(w, 8, -1, packed=False),
                        _ct(8, -1, fmt="int-quantized", activations=INT8_TOKENS)),
        "ct_fp8_tensor": (lambda w: packers.fp8(w, per_channel=False), CT_FP8),
        "fp8_channel": (lambda w: packers.fp8(w, per_channel=True),
                        {"quant_method": "fp8", "activation_scheme": "dynamic"}),
        "fp8_tensor": (lambda w: packers.fp8(w, per_channel=False), {"quant_method": "fp8"}),
        "ct_fp8_block": (lambda w: _renamed(packers.fp8_block(w, FP8_BLOCK),
                                            weight_scale_inv="weight_scale"), CT_FP8_BLOCK),
        "fp8_block": (lambda w: packers.fp8_block(w, FP8_BLOCK),
                      {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "weight_block_size": list(FP8_BLOCK)}),
        "fp8_block16": (lambda w: packers.fp8_block(w, (16, 16)),
                        {"quant_method": "fp8", "activation_scheme": "dynamic",
                         "weight_block_size": [16, 16]}),
    }
    return table[name]


def _torch(a: np.ndarray):
    import torch

    if a.dtype.name == "float8_e4m3fn":
        return torch.from_numpy(a.astype(np.float32)).to(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


def write(model, folder: Path, name: str):
    """Save `model` quantized with scheme `name` into `folder`; return the dequantized model."""
    import torch
    from safetensors.torch import save_file

    pack, qconfig = scheme(name)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors, dequantized = {}, {}
    for key, value in state.items():
        m = LINEAR.fullmatch(key)
        if m is None:
            tensors[key] = value
            continue
        parts, deq = pack(value)
        tensors |= {f"{m[1]}.{part}": a for part, a in parts.items()}
        dequantized[key] = torch.from_numpy(deq)
    folder.mkdir(parents=True)
    save_file({k: _torch(v) for k, v in tensors.items()}, folder / "model.safetensors")
    config = model.config.to_dict() | {"quantization_config": qconfig,
                                       "architectures": [type(model).__name__]}
    (folder / "config.json").write_text(json.dumps(config))
    oracle = type(model)(model.config).eval()
    oracle.load_state_dict(model.state_dict() | dequantized)
    return oracle


def folder(src, dst, name: str, drop: tuple[str, ...] = ()):
    """`src`'s float checkpoint (a saved folder) with every decoder `*_proj.weight` stored
    by scheme `name` as it is named there (MoE experts: the Hub's per-expert names; Phi-3:
    fused qkv_proj, gate_up_proj; the tensors named in `drop` left out); returns the float
    folder holding the dequantized weights (the oracle transformers runs)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    pack, qconfig = scheme(name)
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for key, w in tensors.items():
        if key.startswith("model.layers.") and key.endswith("_proj.weight"):
            parts, deq = pack(w.astype(np.float32))
            prefix = key.removesuffix(".weight")
            quantized |= {f"{prefix}.{k}": v for k, v in parts.items()
                          if f"{prefix}.{k}" not in drop}
            dequantized[key] = deq.astype(np.float32)
        else:
            quantized[key] = dequantized[key] = w
    oracle = dst.parent / f"{dst.name}-dequantized"
    for target, state, config_entry in ((dst, quantized, qconfig), (oracle, dequantized, None)):
        shutil.copytree(src, target)
        save_file({k: np.ascontiguousarray(v) for k, v in state.items()},  # views saved as
                  target / "model.safetensors")  # their buffer's order otherwise
        config = json.loads((target / "config.json").read_text())
        if config_entry:
            config["quantization_config"] = config_entry
        (target / "config.json").write_text(json.dumps(config))
    return oracle
