"""Model configuration read from a Hugging Face `config.json`.

Hub checkpoints come from transformers 4.x (`rope_theta`, `rope_scaling`, `torch_dtype`, often no
`head_dim`) and 5.x (`rope_parameters`, `dtype`); both are accepted here, for every architecture.
What a field means for one architecture (which layers slide, which projections have biases) is
that architecture's `ModelSpec.parse_config` (pjinfer.models), so this module names none.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pjinfer.errors import ModelLoadError
from pjinfer.models.registry import get_model_spec
from pjinfer.models.spec import ParamSpec

DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope")
_ROPE_ALIASES = {"su": "longrope"}  # Phi-3's first spelling of LongRoPE


def normalize_dtype(name: str | None, *, field_name: str = "dtype") -> str:
    """Map 'bf16', 'torch.bfloat16', 'bfloat16' ... to one of DTYPES."""
    if name is None:
        return "float32"
    key = str(name).removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(
            f"{field_name}: unknown dtype {name!r}; use one of auto, {', '.join(DTYPES)}")
    return key


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Rotary-embedding frequency scaling, as transformers' `ROPE_INIT_FUNCTIONS` define it."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, longrope
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original
    long_factor: tuple[float, ...] = ()  # longrope: ... and beyond it
    attention_factor: float = 1.0  # longrope: multiplies cos and sin (see `_longrope`)

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling: unsupported rope type {self.rope_type!r}; "
                f"supported: {', '.join(ROPE_TYPES)}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise ValueError(f"rope_scaling.factor must be a positive number, got {self.factor}")
        if self.rope_type == "longrope" and not (self.short_factor and self.long_factor):
            raise ValueError("rope_scaling: longrope needs both short_factor and long_factor")

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None) -> RopeScaling:
        if not raw:
            return cls()
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        kwargs = {k: raw[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                      "original_max_position_embeddings", "attention_factor")
                  if raw.get(k) is not None}
        kwargs |= {k: tuple(map(float, raw[k])) for k in ("short_factor", "long_factor")
                   if raw.get(k)}
        return cls(rope_type=_ROPE_ALIASES.get(rope_type, rope_type), **kwargs)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape and numerics of a decoder; hashable so it can be a static jit arg.

    The fields after `tie_word_embeddings` are switches some architectures use; `options` holds
    settings only one architecture knows (its `parse_config` fills it; read with `option`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # the eps of the model's norms (RMSNorm, or GPT-2's LayerNorm)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * this dims of q and k
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2; Llama's `attention_bias`)
    o_bias: bool = False  # bias on the output projection (Llama's `attention_bias`)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3)
    # Per-layer sliding window (None = full attention), HF semantics: attend to keys with q-k < W.
    sliding_windows: tuple[int | None, ...] = ()
    # Per-layer multiplier of q.k (GPT-2's flags); () = head_dim ** -0.5 in every layer.
    attention_scales: tuple[float, ...] = ()
    hidden_act: str = "silu"
    dtype: str = "float32"  # the checkpoint's own dtype (`torch_dtype` / `dtype`)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    options: tuple[tuple[str, Any], ...] = ()  # (name, hashable value) pairs

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})")
        for name in ("sliding_windows", "attention_scales"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_hidden_layers:
                raise ValueError(f"{name} needs one entry per layer")
        normalize_dtype(self.dtype, field_name="config.json dtype")
        self._check_longrope()

    def _check_longrope(self) -> None:
        """LongRoPE divides each rotary frequency by its own factor: one per rotary dim pair."""
        s, pairs = self.rope_scaling, int(self.head_dim * self.partial_rotary_factor) // 2
        for name in ("short_factor", "long_factor"):
            if s.rope_type == "longrope" and len(getattr(s, name)) != pairs:
                raise ValueError(
                    f"config.json: rope_scaling.{name} has {len(getattr(s, name))} entries; "
                    f"it needs head_dim * partial_rotary_factor / 2 = {pairs}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def attention_scale(self, layer: int) -> float:
        """What q.k is multiplied by before the softmax in `layer`."""
        return self.attention_scales[layer] if self.attention_scales else self.head_dim ** -0.5

    def option(self, name: str, default: Any = None) -> Any:
        """An architecture-specific setting from `options`."""
        return dict(self.options).get(name, default)

    def param_specs(self) -> list[ParamSpec]:
        """Every parameter of this model, as its architecture declares them."""
        return get_model_spec(self.architecture).param_specs(self)

    def num_params(self) -> int:
        """Parameter count, for memory sizing and the roofline."""
        return sum(math.prod(p.shape) for p in self.param_specs())

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], *, architecture: str | None = None) -> ModelConfig:
        """Build from a parsed HF config.json (transformers 4.x or 5.x spelling)."""
        arch = architecture or _architecture(raw)
        try:
            raw = get_model_spec(arch).normalize_config(raw)
            return cls(**_hf_fields(raw, arch))
        except KeyError as e:
            raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"config.json: {e}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {str(model_dir)!r} does not exist; pass a local "
                                 "Hugging Face model folder (with config.json and *.safetensors)")
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: {model_dir!r} is not a Hugging Face model "
                                 "folder (it needs config.json and *.safetensors)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        try:
            return cls.from_hf_dict(raw)
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None


def resolve_dtype(dtype: str, cfg: ModelConfig) -> Any:
    """'auto' takes the checkpoint's `torch_dtype`/`dtype`; otherwise float32/bfloat16/float16.

    Returns a jnp.dtype; jax is imported here, not at the top, so reading a config stays cheap.
    """
    import jax.numpy as jnp

    return jnp.dtype(cfg.dtype if dtype == "auto" else normalize_dtype(dtype))


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError("'architectures' is missing; set it to e.g. [\"LlamaForCausalLM\"]")
    return archs[0]


def _rope_params(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 nests theta and scaling in `rope_parameters`; 4.x has them top-level."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params:
        return params
    return {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 10000.0)}


def _longrope(raw: dict[str, Any], s: RopeScaling) -> RopeScaling:
    """LongRoPE's constants, resolved as transformers does.

    A top-level `original_max_position_embeddings` (Phi-3's) wins over the rope dict's; the
    scaling `factor` defaults to max_position_embeddings / original, and the attention factor
    to sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1). `factor` is then reset to 1:
    LongRoPE configs already state the extended length in max_position_embeddings, which is
    the engine's limit, not max_position_embeddings * factor.
    """
    original = raw.get("original_max_position_embeddings") or s.original_max_position_embeddings
    if not original:
        raise ValueError("rope_scaling: longrope needs original_max_position_embeddings")
    params = _rope_params(raw)
    factor = params.get("factor") or raw.get("max_position_embeddings", 2048) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return dataclasses.replace(s, factor=1.0, original_max_position_embeddings=int(original),
                               attention_factor=float(attention))


def _rope_fields(raw: dict[str, Any]) -> dict[str, Any]:
    params = _rope_params(raw)
    scaling = RopeScaling.from_hf(params)
    if scaling.rope_type == "longrope":
        scaling = _longrope(raw, scaling)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or 1.0
    return dict(rope_theta=float(params.get("rope_theta") or raw.get("rope_theta", 10000.0)),
                rope_scaling=scaling, partial_rotary_factor=float(partial))


def sliding_window_layers(raw: dict[str, Any],
                          layer_types: list[str] | None) -> tuple[int | None, ...]:
    """Per-layer sliding window (HF semantics: keys with q-k < W), () when there is none.

    A null or 0 `sliding_window` switches the feature off (Mistral's `sliding_window: null`);
    `layer_types` (transformers 5, or derived by the architecture) picks the sliding layers,
    None meaning every layer slides.
    """
    window = raw.get("sliding_window")
    if not window:
        return ()
    if layer_types is None:
        return (int(window),) * raw["num_hidden_layers"]
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _hf_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The fields every decoder has, then those the architecture's spec parses itself."""
    heads = raw["num_attention_heads"]
    generic = dict(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        **_rope_fields(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        dtype=normalize_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32",
                              field_name="config.json dtype"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw),
    )
    return {**generic, **get_model_spec(arch).parse_config(raw)}
