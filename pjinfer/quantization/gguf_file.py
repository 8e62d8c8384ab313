"""GGUF files (llama.cpp): the model config from the metadata, the tensors under HF names.

`LLM("model.gguf")`, or a folder holding one `.gguf`. The `gguf` package reads the file
(memory-mapped). Tensors are exposed by `GGUFIndex` with the names the architecture's
`ParamSpec`s ask for (transformers' names), so the one loader reads them:
  - F32 / F16 / BF16, Q4_1 / Q5_0 / Q5_1 and the K-quants Q2_K-Q6_K (dequantized at load
    by the gguf package, as transformers does), under `<name>.weight`;
  - Q8_0 / Q4_0 decoder Linear weights additionally under `<prefix>.gguf_blocks` (raw blocks)
    and `<prefix>.gguf_type`, which `gguf_blocks.read` turns into the canonical packed int8 /
    int4 form (blocks of 32 along the input dim: group size 32) that the kernel streams.
llama.cpp stores Llama's q and k projections with their rows permuted for its rotary layout;
they are permuted back here (whole rows, so packed blocks move unchanged). Architectures: Llama
(Mistral's too), Qwen2, Qwen3, Phi-3 (its fused attn_qkv and ffn_up read as the fused
checkpoint tensors; sliding window and LongRoPE factors from the file), and the MoE files of
Mixtral (a llama with `expert_count`), Qwen2-MoE and Qwen3-MoE, whose [E, ...] expert stacks
(`ffn_{gate,up,down}_exps`) are served under transformers 5's fused names and load as float.
Rope scaling: linear from the metadata, and Llama 3.1's as llama.cpp stores it (`rope_freqs`,
a divisor a frequency), which transformers' own GGUF reader drops.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from pjinfer.errors import ModelLoadError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM"}
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")
PACKED_TYPES = ("Q8_0", "Q4_0")  # kept packed for the kernel
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's fused
# a MoE layer's expert stacks, as transformers 5 names them ([E, 2I, D] gate rows first;
# [E, D, I]): llama.cpp's stacks concatenated along dim 1
_EXPERTS = {"mlp.experts.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
            "mlp.experts.down_proj": ("ffn_down_exps",)}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_path(model: str | Path | None) -> Path | None:
    """The .gguf file `model` names (the file, or a folder with exactly one), else None."""
    if model is None:
        return None
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ModelLoadError(f"{path} holds {len(files)} .gguf files; pass the one to load")
        return files[0] if files else None
    return None


def gguf_name(hf_name: str) -> str | None:
    """transformers' tensor name -> llama.cpp's (None when it has no counterpart)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    layer = _layer_part(hf_name)
    if layer is None or layer[1] in _EXPERTS:  # an expert stack is several: `expert_names`
        return None
    block, rest = layer
    for hf, gg in _LAYER.items():
        if rest == hf or rest.startswith(hf + "."):
            return f"blk.{block}.{gg}{rest[len(hf):]}"
    return None


def expert_names(hf_name: str) -> tuple[str, ...] | None:
    """A MoE layer's expert stack in transformers 5's name -> llama.cpp's tensors (in
    the order they concatenate), else None."""
    layer = _layer_part(hf_name)
    if layer is None or layer[1] not in _EXPERTS:
        return None
    return tuple(f"blk.{layer[0]}.{name}.weight" for name in _EXPERTS[layer[1]])


def _layer_part(hf_name: str) -> tuple[str, str] | None:
    """'model.layers.{i}.rest' -> (i, rest), else None."""
    parts = hf_name.split(".")
    if len(parts) < 4 or parts[:2] != ["model", "layers"]:
        return None
    return parts[2], ".".join(parts[3:])


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: pairs interleaved -> halves)."""
    out = rows.shape[0]
    return rows.reshape(heads, out // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(
        rows.shape)


class GGUFIndex:
    """HF tensor name -> host array, read from one GGUF file (the SafetensorsIndex interface)."""

    def __init__(self, path: str | Path):
        try:
            import gguf
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the gguf package: "
                                 "pip install gguf") from None
        self.model_dir = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError) as e:
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    @cached_property
    def metadata(self) -> dict[str, Any]:
        out = {}
        for name, field in self._reader.fields.items():
            try:
                out[name] = field.contents()
            except (ValueError, IndexError, TypeError):
                continue
        return out

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def _tensor(self, hf_name: str) -> tuple[str, Any, str]:
        """(gguf name, tensor, base) where base strips the .gguf_* suffix; KeyError if none."""
        base = hf_name
        for suffix in (".gguf_blocks", ".gguf_type"):
            if hf_name.endswith(suffix):
                base = hf_name.removesuffix(suffix) + ".weight"
        name = gguf_name(base)
        if name is None or name not in self._tensors:
            raise KeyError(hf_name)
        return name, self._tensors[name], base

    def __contains__(self, hf_name: str) -> bool:
        stack = expert_names(hf_name)
        if stack is not None:
            return all(name in self._tensors for name in stack)
        try:
            name, t, base = self._tensor(hf_name)
        except KeyError:
            return False
        return base == hf_name or t.tensor_type.name in PACKED_TYPES

    def stored_names(self, hf_name: str) -> tuple[str, ...]:
        """The file's tensor names that `hf_name` is read from (for error messages)."""
        stack = expert_names(hf_name)
        name = gguf_name(hf_name)
        return stack if stack is not None else ((name,) if name is not None else ())

    def names(self) -> list[str]:
        return list(self._tensors)

    def _rows(self, base: str, rows: np.ndarray) -> np.ndarray:
        """Rows of q / k back in transformers' order (Llama only)."""
        if self.arch != "llama":
            return rows
        m = self.metadata
        if base.endswith("self_attn.q_proj.weight"):
            return _unpermute(rows, int(m["llama.attention.head_count"]))
        if base.endswith("self_attn.k_proj.weight"):
            heads = m.get("llama.attention.head_count_kv", m["llama.attention.head_count"])
            return _unpermute(rows, int(heads))
        return rows

    def get(self, hf_name: str) -> np.ndarray:
        stack = expert_names(hf_name)
        if stack is not None:
            if hf_name not in self:
                raise KeyError(hf_name)
            return np.concatenate([self._float(n) for n in stack], axis=1)
        name, t, base = self._tensor(hf_name)
        if hf_name.endswith((".gguf_type", ".gguf_blocks")):
            self._check_type(name, t)
            if hf_name.endswith(".gguf_type"):
                return np.array(t.tensor_type.name)
            return self._rows(base, np.asarray(t.data))  # [out, row bytes]
        data = self._float(name)
        if base.endswith("shared_expert_gate.weight") and data.ndim == 1:
            data = data[None]  # llama.cpp stores Qwen2-MoE's [1, D] gate as [D]
        return self._rows(base, data)

    @staticmethod
    def _check_type(name: str, t: Any) -> None:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(f"tensor {name!r} has GGUF type {kind}, which pjinfer does not "
                                 f"read; supported: {', '.join(SUPPORTED_TYPES)}")

    def _float(self, name: str) -> np.ndarray:
        """The file's tensor `name` dequantized to float32, in numpy's dim order."""
        import gguf

        t = self._tensors[name]
        self._check_type(name, t)
        data = np.asarray(t.data)
        if t.tensor_type.name not in ("F32", "F16"):
            data = gguf.quants.dequantize(data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dim first
        return data.reshape(shape).astype(np.float32, copy=False)

    def read(self, hf_name: str) -> np.ndarray:
        """As `get`: the loader's read-ahead threads call this (the file is memory-mapped, so
        what is not decoded here is read when the device copy touches it)."""
        return self.get(hf_name)

    def hf_config(self) -> dict[str, Any]:
        """config.json's fields from the GGUF metadata (transformers' meaning)."""
        arch, m = self.arch, self.metadata
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{self.model_dir}: GGUF architecture {arch!r} is not "
                                 f"supported; supported: {', '.join(ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            return m.get(f"{arch}.{name}", default)

        def need(name: str) -> int:
            if key(name) is None:
                raise ModelLoadError(f"{self.model_dir}: the GGUF metadata lacks {arch}.{name}; "
                                     "pass the original model's folder as hf_config_path")
            return int(key(name))
        tokens = m.get("tokenizer.ggml.tokens")
        heads = need("attention.head_count")
        raw = dict(architectures=[ARCHITECTURES[arch]],
                   vocab_size=int(key("vocab_size", len(tokens) if tokens else 0)),
                   hidden_size=need("embedding_length"),
                   intermediate_size=need("feed_forward_length"),
                   num_hidden_layers=need("block_count"),
                   num_attention_heads=heads,
                   num_key_value_heads=int(key("attention.head_count_kv", heads)),
                   max_position_embeddings=int(key("context_length", 2048)),
                   rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
                   rope_theta=float(key("rope.freq_base", 10000.0)),
                   tie_word_embeddings="output.weight" not in self._tensors,
                   bos_token_id=m.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=m.get("tokenizer.ggml.eos_token_id"), dtype="float32")
        if key("attention.key_length") is not None:
            raw["head_dim"] = int(key("attention.key_length"))
        return {**raw, **_moe_config(key, arch),
                **self._rope_config(key, arch, raw["max_position_embeddings"])}

    def _rope_config(self, key: Any, arch: str, context: int) -> dict[str, Any]:
        """Rope scaling (and Phi-3's window) from the metadata and the factor tensors:
        linear scaling, Llama 3.1's `rope_freqs`, Phi-3's LongRoPE; any other type is an
        error, not a silently different model."""
        out: dict[str, Any] = {}
        scaling = str(key("rope.scaling.type", "none"))
        if scaling == "linear":
            out["rope_scaling"] = dict(rope_type="linear", factor=float(key("rope.scaling.factor")))
        elif scaling != "none":
            raise ModelLoadError(f"{self.model_dir}: GGUF rope scaling {scaling!r} is not "
                                 "supported; supported: none, linear, and Llama 3.1's rope_freqs")
        if "rope_freqs.weight" in self._tensors:
            out["rope_scaling"] = self._rope_factors(context)
        if arch == "phi3" and key("attention.sliding_window") is not None:
            out["sliding_window"] = int(key("attention.sliding_window"))
        if "rope_factors_long.weight" in self._tensors:  # Phi-3's LongRoPE
            out["rope_scaling"] = self._longrope(key)
            if key("rope.scaling.original_context_length") is not None:  # Phi3Config's field
                out["original_max_position_embeddings"] = int(
                    key("rope.scaling.original_context_length"))
        return out

    def _longrope(self, key: Any) -> dict[str, Any]:
        """Phi-3's LongRoPE as llama.cpp stores it: the factors as tensors, the attention
        factor (and the original length: `hf_config`) in the metadata; transformers'
        defaults when absent."""
        out = dict(rope_type="longrope",
                   short_factor=self._float("rope_factors_short.weight").tolist(),
                   long_factor=self._float("rope_factors_long.weight").tolist())
        if key("rope.scaling.attn_factor") is not None:
            out["attention_factor"] = float(key("rope.scaling.attn_factor"))
        return out

    def _rope_factors(self, context: int) -> dict[str, Any]:
        """llama.cpp's `rope_freqs` (Llama 3.1's scaling, as its converter stores it): one
        divisor a rotary frequency, which is LongRoPE's form with the same factors at every
        length and no attention factor."""
        factors = self._float("rope_freqs.weight").tolist()
        return dict(rope_type="longrope", short_factor=factors, long_factor=factors,
                    original_max_position_embeddings=context, factor=1.0,
                    attention_factor=1.0)


def _moe_config(key: Any, arch: str) -> dict[str, Any]:
    """A MoE GGUF's expert fields (none for a dense one), in llama.cpp's meaning: Mixtral is
    its `llama` with `expert_count`; Qwen3-MoE renormalises the top-k weights, Qwen2-MoE does
    not (unless the file says `expert_weights_norm`)."""
    if arch == "llama" and key("expert_count"):
        return dict(architectures=["MixtralForCausalLM"],
                    num_local_experts=int(key("expert_count")),
                    num_experts_per_tok=int(key("expert_used_count", 2)))
    if not arch.endswith("moe"):
        return {}
    sizes = {"num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
             "moe_intermediate_size": "expert_feed_forward_length"}
    if arch == "qwen2moe":
        sizes["shared_expert_intermediate_size"] = "expert_shared_feed_forward_length"
    raw = {field: int(key(name)) for field, name in sizes.items() if key(name) is not None}
    return {**raw, "norm_topk_prob": bool(key("expert_weights_norm", arch == "qwen3moe"))}
