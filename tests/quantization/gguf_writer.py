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
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


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


def _quantized(kind: str | None, value: np.ndarray, rng: np.random.Generator):
    """(data, raw_dtype) for one tensor of `kind` (None: float32 as it is); a stack's leading
    dims are kept, its last dim quantized."""
    import gguf
    from gguf import GGMLQuantizationType as T

    if kind is None:
        return value, None
    rows, cols = int(np.prod(value.shape[:-1])), value.shape[-1]
    if kind in _K_LAYOUT:
        data = k_quant_blocks(kind, rows, cols, rng)
    elif kind not in QUANTIZABLE:  # e.g. an unsupported type: only its name matters
        data = random_blocks(kind, rows, cols, rng)
    else:
        return gguf.quants.quantize(value, T[kind]), T[kind]
    return data.reshape(*value.shape[:-1], data.shape[-1]), T[kind]


def _metadata(w, cfg, arch: str) -> None:
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope(cfg).get("rope_theta", 10000.0))
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if arch == "phi3":  # else transformers' Phi3Config pads with id 32000
        w.add_pad_token_id(cfg.pad_token_id)
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
    if arch.startswith("qwen3"):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # llama.cpp's expert fields (Mixtral: a llama with them)
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch.endswith("moe"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _layer_tensors(name: str, value: np.ndarray, cfg, arch: str):
    """(llama.cpp's short name, leaf, value) of one decoder-layer tensor: MoE expert stacks
    split into llama.cpp's gate / up / down stacks, q / k rows permuted for Llama."""
    _, _, _, *rest = name.split(".")
    module, leaf = ".".join(rest[:-1]), rest[-1]
    if ".".join(rest) == "mlp.experts.gate_up_proj":  # [E, 2I, D], gate rows first
        half = value.shape[1] // 2
        return [("ffn_gate_exps", "weight", value[:, :half]),
                ("ffn_up_exps", "weight", value[:, half:])]
    if ".".join(rest) == "mlp.experts.down_proj":
        return [("ffn_down_exps", "weight", value)]
    short = HF_TO_GGUF[module]
    if arch == "llama" and short in ("attn_q", "attn_k"):
        heads = cfg.num_attention_heads if short == "attn_q" else cfg.num_key_value_heads
        value = _permute(value, heads)
    if short == "ffn_gate_inp_shexp":
        value = value.reshape(-1)  # llama.cpp's [D]
    return [(short, leaf, value)]


def add_bpe_tokenizer(w, folder: Path) -> None:
    """A byte-level BPE tokenizer folder (tokenizer.json, tokenizer_config.json) as llama.cpp's
    `gpt2` tokenizer metadata: tokens by id, their types, merges, special ids, chat template."""
    import json

    tok = json.loads((folder / "tokenizer.json").read_text())
    conf = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if vocab[t] in special else 1 for t in tokens])  # control / normal
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tok["model"]["merges"]])
    w.add_add_bos_token(bool(conf.get("add_bos_token", False)))
    w.add_pad_token_id(ids[conf["pad_token"]])
    w.add_chat_template(conf["chat_template"])


def _rope(cfg) -> dict:
    return getattr(cfg, "rope_parameters", None) or {}


def llama3_rope_freqs(cfg) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for a Llama 3.1 rope_scaling."""
    s, d = _rope(cfg), cfg.head_dim
    freqs = 1.0 / s["rope_theta"] ** (np.arange(0, d, 2) / d)
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = ((old / wavelen - s["low_freq_factor"])
                      / (s["high_freq_factor"] - s["low_freq_factor"]))
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, np.float32)


def _rope_tensors(w, cfg, arch: str) -> None:
    """Rope scaling as llama.cpp's converter writes it: Llama 3.1's `rope_freqs`, Phi-3's
    LongRoPE factors with the original length and attention factor in the metadata."""
    r = _rope(cfg)
    if r.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    if r.get("rope_type") == "longrope":
        orig = cfg.original_max_position_embeddings
        w.add_tensor("rope_factors_short.weight", np.asarray(r["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(r["long_factor"], np.float32))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", orig)
        scale = cfg.max_position_embeddings / orig
        w.add_float32(f"{arch}.rope.scaling.attn_factor",
                      float(np.sqrt(1 + np.log(scale) / np.log(orig))) if scale > 1 else 1.0)


def write_gguf(model, path: Path, arch: str, *, extra_types: dict[str, str | None] | None = None,
               seed: int = 0, tokenizer: Path | None = None,
               metadata: dict[str, str | float] | None = None,
               state: dict | None = None) -> Path:
    """`model` (a tiny float Llama / Qwen2 / Qwen3 / Phi-3 / Mixtral / Qwen2-MoE / Qwen3-MoE,
    llama.cpp's `arch` naming its family) as a GGUF file of mixed tensor types (`LAYER_TYPES`
    updated by `extra_types`, by llama.cpp's short names; other tensors float32).
    `tokenizer`: a byte-level BPE tokenizer folder to store in the metadata; `metadata`: more
    fields (strings or float32); `state`: tensors to write instead of the model's (its config
    still writes the metadata)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    cfg = model.config
    types = LAYER_TYPES | (extra_types or {})
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, cfg, arch)
    for name, value in (metadata or {}).items():  # extra fields, as given
        (w.add_string if isinstance(value, str) else w.add_float32)(name, value)
    _rope_tensors(w, cfg, arch)
    if tokenizer is not None:
        add_bpe_tokenizer(w, tokenizer)
    for name, value in (state if state is not None else model.state_dict()).items():
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
        block = name.split(".")[2]
        for short, leaf, part in _layer_tensors(name, value, cfg, arch):
            kind = types.get(short) if leaf == "weight" and part.ndim > 1 else None
            data, raw = _quantized(kind, np.ascontiguousarray(part), rng)
            w.add_tensor(f"blk.{block}.{short}.{leaf}", data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
