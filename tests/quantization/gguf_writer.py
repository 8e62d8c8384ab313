"""Tiny GGUF files written with the gguf package's writer, from a float transformers model.

Q8_0 / Q4_0 / BF16 tensors are the writer's own quantization; Q4_K / Q6_K (which the gguf
package only dequantizes) are random blocks with small scales, and the model they mean is
whatever transformers reads back with `gguf_file=`, the oracle.
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
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for its rotary layout (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def k_quant_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K (144 B) / Q6_K (210 B) super-blocks of 256 values, finite small scales."""
    nb = cols // 256
    if kind == "Q4_K":  # d, dmin (f16), 12 bytes of 6-bit scales / mins, 128 bytes of nibbles
        b = rng.integers(0, 256, (rows, nb, 144), dtype=np.uint8)
        b[..., 0:2] = np.full((rows, nb, 1), 0.0004, np.float16).view(np.uint8)
        b[..., 2:4] = np.full((rows, nb, 1), 0.0002, np.float16).view(np.uint8)
    else:  # Q6_K: 128 low bits, 64 high bits, 16 int8 scales, d (f16)
        b = rng.integers(0, 256, (rows, nb, 210), dtype=np.uint8)
        b[..., 192:208] = rng.integers(-6, 7, (rows, nb, 16)).astype(np.int8).view(np.uint8)
        b[..., 208:210] = np.full((rows, nb, 1), 0.0015, np.float16).view(np.uint8)
    return b.reshape(rows, nb * b.shape[-1])


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
        elif kind in ("Q4_K", "Q6_K", "Q5_K"):
            blocks = k_quant_blocks(kind if kind != "Q5_K" else "Q4_K", *value.shape, rng)
            if kind == "Q5_K":  # 176-byte blocks: random, only its type matters here
                blocks = rng.integers(0, 256, (value.shape[0], value.shape[1] // 256 * 176),
                                      dtype=np.uint8)
            w.add_tensor(gname, blocks, raw_dtype=T[kind])
        else:
            w.add_tensor(gname, gguf.quants.quantize(value, T[kind]), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
