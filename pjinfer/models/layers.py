"""Building blocks shared by the decoders: norms, rotary embeddings, activations, MLPs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.config import ModelConfig, RopeScaling
from pjinfer.kernels import ops
from pjinfer.kernels.rotary_write import QKTransform
from pjinfer.quantization.weight import QuantizedWeight


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back: what transformers' LlamaRMSNorm does."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm (with bias) in float32, cast back; GPT-2's ln_1/ln_2/ln_f."""
    x32 = x.astype(jnp.float32)
    centered = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    return (centered * jax.lax.rsqrt(var + eps) * weight + bias).astype(x.dtype)


# Norms by name for the decoder: (params holding `name` [and `name_bias`], name, x, eps).
def rms_norm_named(p: dict, name: str, x: jax.Array, eps: float) -> jax.Array:
    return rms_norm(x, p[name], eps)


def layer_norm_named(p: dict, name: str, x: jax.Array, eps: float) -> jax.Array:
    return layer_norm(x, p[name], p[f"{name}_bias"], eps)


# transformers' ACT2FN names -> jax; gelu_new and gelu_pytorch_tanh are the same tanh formula.
ACTIVATIONS = {
    "silu": jax.nn.silu, "swish": jax.nn.silu, "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


@partial(jax.tree_util.register_dataclass, data_fields=["inv_freq"],
         meta_fields=["attention_factor"])
@dataclass(frozen=True)
class Rope:
    """What `rope_angles` needs: inverse frequencies [rotary_dim / 2] (rotary_dim <= head_dim:
    the rest of each head passes through) and the factor cos and sin are multiplied by (static
    under jit, so a factor of 1 costs nothing)."""

    inv_freq: jax.Array
    attention_factor: float = 1.0


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths stretched, short ones kept, a smooth band between."""
    old_len = s.original_max_position_embeddings or 8192
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, max_len: int | None = None) -> np.ndarray:
    """Inverse frequencies [rotary_dim / 2] in float32, as transformers computes them.

    Dynamic NTK and LongRoPE depend on the sequence length: transformers recomputes them per
    forward from the current length, which a paged cache cannot follow (keys already stored
    keep their rotation), so (like vLLM) they are fixed once for `max_len`, the longest
    length the engine serves. Dynamic NTK changes the base only past max_position_embeddings;
    LongRoPE takes its long factors when max_len > original_max_position_embeddings, its short
    ones otherwise (and for max_len None, as transformers does without a length).
    """
    d, s = int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_scaling
    base = cfg.rope_theta
    if s.rope_type == "dynamic" and max_len and max_len > cfg.max_position_embeddings:
        ratio = s.factor * max_len / cfg.max_position_embeddings - (s.factor - 1)
        base = base * ratio ** (d / (d - 2))
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d
    if s.rope_type == "longrope":
        long = max_len is not None and max_len > s.original_max_position_embeddings
        ext = np.asarray(s.long_factor if long else s.short_factor, np.float32)
        return (1.0 / (ext * base ** exponent)).astype(np.float32)
    inv_freq = (1.0 / (base ** exponent)).astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / np.float32(s.factor)).astype(np.float32)
    if s.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, s)
    return inv_freq


def rope(cfg: ModelConfig, max_len: int | None = None) -> Rope:
    """The rotary setup of `cfg` for sequences up to `max_len` (see `rope_inv_freq`)."""
    return Rope(jnp.asarray(rope_inv_freq(cfg, max_len)), cfg.rope_scaling.attention_factor)


def rope_angles(r: Rope, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, R/2] float32 of each token's rotation, times the attention factor:
    computed once a step and shared by every layer (a kernel input each layer would
    otherwise recompute)."""
    freqs = positions.astype(jnp.float32)[:, None] * r.inv_freq[None, :]  # [T, R/2]
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if r.attention_factor != 1.0:
        cos, sin = cos * r.attention_factor, sin * r.attention_factor
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout, not interleaved) on the first R dims of each head.

    x [T, N, D]; cos, sin [T, R/2] from `rope_angles`, R <= D.
    """
    cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :]  # [T, 1, R]
    sin = jnp.concatenate([sin, sin], axis=-1)[:, None, :]
    x32 = x.astype(jnp.float32)
    rot, half = cos.shape[-1], cos.shape[-1] // 2
    xr = x32[..., :rot]
    rotated = jnp.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    return jnp.concatenate([xr * cos + rotated * sin, x32[..., rot:]], axis=-1).astype(x.dtype)


def qk_transform(angles: tuple[jax.Array, jax.Array] | None, q_norm: jax.Array | None,
                 k_norm: jax.Array | None, eps: float) -> QKTransform:
    """What turns a layer's projected q and k into attention's (see `apply_qk`); `angles`:
    `rope_angles`' cos and sin, None without RoPE."""
    cos, sin = (None, None) if angles is None else angles
    return QKTransform(cos, sin, q_norm, k_norm, eps)


def apply_qk(qk: QKTransform, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q [T, H, D] and k [T, KVH, D] normed per head (when `qk` has norms), then rotated:
    the model's own definition (the paged step's kernel and its reference are tested
    against it)."""
    if qk.q_norm is not None:
        q, k = rms_norm(q, qk.q_norm, qk.eps), rms_norm(k, qk.k_norm, qk.eps)
    if qk.cos is None:
        return q, k
    return apply_rope(q, qk.cos, qk.sin), apply_rope(k, qk.cos, qk.sin)


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None, *,
           out_dtype: jnp.dtype | None = None) -> jax.Array:
    """x [T, in] @ w [in, out] (+ b) -> [T, out] in `out_dtype` (default x's), float32 sums.

    The dot writes `out_dtype` itself: GPU GEMMs sum bf16 products in float32 whatever
    they write, and a float32 result converted afterwards costs a [T, out] float32 tensor
    and a convert kernel (a 2,000-token Llama-3-8B step on the H200 ran two a layer,
    ~42 us each, on gate and up: benchmarks/RESULTS.md, round 15). On a CPU, XLA widens
    bf16 dots to float32 and rounds once at the end, as before.
    Weights are stored input-major, transposed from HF. Every matmul with a weight goes through
    here, so a quantized or adapter linear has one place to replace. A weight that is not an
    array but has its own `linear` (e.g. `pjinfer.lora.ops.AdaptedWeight`) computes itself.
    """
    if hasattr(w, "linear"):  # an adapted weight (pjinfer.lora) computes itself
        return w.linear(x, b, out_dtype=out_dtype)
    if isinstance(w, QuantizedWeight):
        y = ops.quantized_matmul(x, w, out_dtype=out_dtype or x.dtype)
    else:
        y = jnp.dot(x, w, preferred_element_type=out_dtype or x.dtype)
    return y if b is None else y + b


def linears(x: jax.Array, weights: list, biases: list) -> list[jax.Array]:
    """x [T, in] through several weights sharing it (q/k/v; gate/up) -> [T, out_m] each.

    Plain weights: `linear` per weight; quantized ones: one group kernel where they allow it
    (`ops.quantized_matmuls`). Adapted weights of one kind (e.g.
    `pjinfer.lora.ops.AdaptedWeight`) are handed the whole group through their type's
    `linears`, so the group's adapter terms can be computed together (one Pallas kernel per
    group where that backend is chosen).
    """
    kind = type(weights[0])
    if hasattr(kind, "linears") and all(type(w) is kind for w in weights):
        return kind.linears(x, weights, biases)
    if kind is QuantizedWeight and all(type(w) is kind for w in weights):  # one kernel
        ys = ops.quantized_matmuls(x, weights, out_dtype=x.dtype)
        return [y if b is None else y + b for y, b in zip(ys, biases, strict=True)]
    return [linear(x, w, b) for w, b in zip(weights, biases, strict=True)]


def gated_mlp(lp: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate, up = linears(x, [lp["gate_proj"], lp["up_proj"]],
                       [lp.get("gate_bias"), lp.get("up_bias")])
    return linear(jax.nn.silu(gate) * up, lp["down_proj"], lp.get("down_bias"))


def plain_mlp(lp: dict, x: jax.Array, *, act: str) -> jax.Array:
    """Ungated: down(act(up(x))) (GPT-2's c_fc, c_proj)."""
    h = ACTIVATIONS[act](linear(x, lp["up_proj"], lp.get("up_bias")))
    return linear(h, lp["down_proj"], lp.get("down_bias"))
