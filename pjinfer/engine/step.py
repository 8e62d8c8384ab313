"""The jitted pure step: model forward over the paged cache, logits of the rows to sample.

`model_step(params, kv_caches, inputs) -> (logits, kv_caches)` is the one function that runs the
model; the cache is donated so XLA writes the new K/V in place. Sampling is a separate small
jitted function (see runner), so the many sampler variants never multiply the model's compiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig
from pjinfer.engine.inputs import StepInputs
from pjinfer.kernels import ops
from pjinfer.lora.weights import attach as attach_lora
from pjinfer.models.registry import get_model_spec
from pjinfer.sharding.attention import shard_over_heads

KVCaches = list[tuple[jax.Array, jax.Array]]  # per layer (K, V): [NB, bs, KVH, hd] each


@dataclass(frozen=True, slots=True)
class StepOptions:
    """Static settings of a compiled step (hashable: part of the compile key)."""

    cfg: ModelConfig
    max_model_len: int
    decode_only: bool = False
    backend: str = "auto"
    prompt_logprobs: int | None = None  # top-N of every token's raw distribution, when asked
    # Tensor parallelism: attention runs per "tp" shard under shard_map; None = one device.
    # With a mesh, `cfg` is the device layout (`pjinfer.sharding.rules.layout_config`).
    mesh: Mesh | None = None
    # fp8 KV cache: per layer (k_scale, v_scale) the cache stores K and V divided by; () = 1.0
    kv_scales: tuple[tuple[float, float], ...] = ()


def init_kv_caches(cfg: ModelConfig, num_blocks: int, block_size: int, dtype,
                   sharding=None) -> KVCaches:
    shape = ops.get_kv_cache_shape(num_blocks, block_size, cfg.num_key_value_heads,
                                   cfg.head_dim)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return [(make(), make()) for _ in range(cfg.num_hidden_layers)]


def model_step(params, kv_caches: KVCaches, inputs: StepInputs, lora=None, *,
               opts: StepOptions):
    """Forward the ragged batch; returns (logits [S, V] f32, caches[, prompt logprob tables]).
    `lora`: the adapter slots (pjinfer.lora.weights), applied per token by `inputs.lora_slots`:
    an argument, so loading an adapter never recompiles the step."""
    cfg = opts.cfg
    if lora is not None:
        params = attach_lora(params, lora, inputs.lora_slots)
    spec = get_model_spec(cfg.architecture)
    attention = _paged_attention(opts)
    # Model code that must place work per shard (the MoE experts) reads the abstract mesh.
    mesh = jax.sharding.AbstractMesh((), ()) if opts.mesh is None else opts.mesh.abstract_mesh
    with jax.sharding.use_abstract_mesh(mesh):
        hidden, kv_caches = spec.forward(params, cfg, inputs.resolved_token_ids(),
                                         inputs.positions, kv_caches, inputs.attn,
                                         attention=attention,
                                         rotary=spec.rotary(cfg, opts.max_model_len))
    logits = spec.compute_logits(params, hidden[inputs.logits_indices])  # [S, V]
    if opts.prompt_logprobs is None:
        return logits, kv_caches
    return logits, kv_caches, token_logprobs(spec.compute_logits(params, hidden),
                                             inputs.next_token_ids, opts.prompt_logprobs)


def _paged_attention(opts: StepOptions):
    """The model's `attention` callback: q and k through their norm and RoPE, this step's
    K/V written (one kernel on the Pallas backend), attention over the paged cache.

    Under a mesh both ops run per tp shard (each sees its own q and kv heads), so the
    Pallas kernels never see a sharded array.
    """
    cfg = opts.cfg

    def attention(layer, q, k, v, qk, cache, md):
        k_scale, v_scale = opts.kv_scales[layer] if opts.kv_scales else (1.0, 1.0)
        attn = ops.AttentionParams(cfg.attention_scale(layer),
                                   sliding_window=cfg.sliding_window(layer),
                                   k_scale=k_scale, v_scale=v_scale)

        def local(q, k, v, qk, k_cache, v_cache, md):
            q, k_cache, v_cache = ops.rotate_and_write_kv(q, k, v, k_cache, v_cache,
                                                          md.slot_mapping, qk, attn,
                                                          backend=opts.backend)
            out = ops.paged_attention(q, k_cache, v_cache, md, attn,
                                      decode_only=opts.decode_only, backend=opts.backend)
            return out, k_cache, v_cache
        if opts.mesh is not None:
            local = shard_over_heads(local, opts.mesh)
        out, k_cache, v_cache = local(q, k, v, qk, cache[0], cache[1], md)
        return out, (k_cache, v_cache)
    return attention


def token_logprobs(logits: jax.Array, target: jax.Array, k: int):
    """For prompt_logprobs: token t's logits score `target[t]`, the prompt token after it.

    Returns (logprob of the target [T], its rank [T], top-k logprobs [T, k], ids [T, k]).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # [T, V]
    chosen = jnp.take_along_axis(logprobs, target[:, None], axis=-1)[:, 0]
    rank = jnp.sum(logprobs > chosen[:, None], axis=-1) + 1
    top_vals, top_ids = jax.lax.top_k(logprobs, max(k, 1))
    return chosen, rank.astype(jnp.int32), top_vals[:, :k], top_ids[:, :k]


def copy_blocks(kv_caches: KVCaches, src: jax.Array, dst: jax.Array) -> KVCaches:
    """Copy-on-write: block dst := block src in every layer (src/dst [C], padded with 0 -> 0)."""
    return [(k.at[dst].set(k[src]), v.at[dst].set(v[src])) for k, v in kv_caches]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    return (2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
            * np.dtype(dtype).itemsize)
