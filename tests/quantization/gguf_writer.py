"""Tiny GGUF files written with the gguf package's writer, from a float transformers model.

BF16 and Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 tensors are the gguf package's own quantization;
the K-quants Q2_K-Q6_K (which it only dequantizes) are random blocks with small scales, and the
model they mean is whatever transformers reads back with `gguf_file=`, the oracle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# 256-wide: K-quant super-blocks (256 values) tile every input dim
GGUF_TINY = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYER_TYPES = {"attn_q": "Q4_0", "attn_k": "Q8_0", "attn_v": "Q4_K", "attn_output": "Q6_K",
               "ffn_gate": "Q8_0", "ffn_up": "Q4_0", "ffn_down": "Q6_K"}
# the other types llama.cpp's usual files hold (Q5_K_M, Q3_K_M, Q2_K; Q5_0 / Q4_1 / Q5_1 for
# rows a 256-wide super-block does not tile), all dequantized at load
OTHER_TYPES = {"attn_q": "Q5_0", "attn_k": "Q4_1", "attn_v": "Q5_1", "attn_output": "Q5_K",
               "ffn_gate": "Q3_K", "ffn_up": "Q2_K", "ffn_down": "Q5_K"}
QUANTIZABLE = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # the gguf package's quantize
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary layout (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


# K-quant super-blocks of 256 values: bytes a block, and where its f16 scale(s) sit
_K_LAYOUT = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)),
             "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
_K_SCALE = {"Q2_K": 0.002, "Q3_K": 0.0005, "Q4_K": 0.0004, "Q5_K": 0.0002, "Q6_K": 0.0015}


def k_quant_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks (Q2_K-Q6_K) with small finite f16 scales: every other
    byte (quants, packed sub-block scales) random. Q6_K's int8 sub-block scales are kept
    small too; the dmin of Q2_K / Q4_K / Q5_K is half the scale."""
    size, at = _K_LAYOUT[kind]
    nb = cols // 256
    b = rng.integers(0, 256, (rows, nb, size), dtype=np.uint8)
    for j, offset in enumerate(at):
        value = _K_SCALE[kind] / (1 + j)  # d, then dmin
        b[..., offset:offset + 2] = np.full((rows, nb, 1), value, np.float16).view(np.uint8)
    if kind == "Q6_K":
        b[..., 192:208] = rng.integers(-6, 7, (rows, nb, 16)).astype(np.int8).view(np.uint8)
    return b.reshape(rows, nb * size)


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes shaped as `kind`'s blocks (a type whose values do not matter here)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


def write_gguf(model, path: Path, arch: str, *, extra_types: dict[str, str] | None = None,
               seed: int = 0) -> Path:
    """`model` (a tiny float Llama / Qwen2) as a GGUF file of mixed tensor types."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    cfg = model.config
    types = LAYER_TYPES | (extra_types or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else 10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, value in model.state_dict().items():
        value = value.detach().numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", value.astype(np.float16))
            continue
        if name == "lm_head.weight":
            w.add_tensor("output.weight", gguf.quants.quantize(value, T.BF16), raw_dtype=T.BF16)
            continue
        if name == "model.norm.weight":
            w.add_tensor("output_norm.weight", value)
            continue
        _, _, i, *rest = name.split(".")
        module, leaf = ".".join(rest[:-1]), rest[-1]
        gname = f"blk.{i}.{HF_TO_GGUF[module]}.{leaf}"
        short = HF_TO_GGUF[module]
        if arch == "llama" and short in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
            value = _permute(value, heads)
        kind = types.get(short) if leaf == "weight" else None
        if kind is None:
            w.add_tensor(gname, value)
        elif kind in _K_LAYOUT:
            w.add_tensor(gname, k_quant_blocks(kind, *value.shape, rng), raw_dtype=T[kind])
        elif kind not in QUANTIZABLE:  # e.g. an unsupported type: only its name matters
            w.add_tensor(gname, random_blocks(kind, *value.shape, rng), raw_dtype=T[kind])
        else:
            w.add_tensor(gname, gguf.quants.quantize(value, T[kind]), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
