"""The cache-free forward pass: full causal attention over padded prompts.

It is the oracle every cached path (paged, chunked, batched, preempted) is compared with, and
the simplest way to run a model: no cache, no scheduler, nothing but the math.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from pjinfer.config import ModelConfig
from pjinfer.models.layers import apply_qk
from pjinfer.models.registry import get_model_spec


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, seq_ids: jax.Array,
                           positions: jax.Array, *, scale: float,
                           sliding_window: int | None) -> jax.Array:
    """q [T, H, hd], k/v [T, KVH, hd]; each token sees its own sequence up to its position."""
    t, h, hd = q.shape
    g = h // k.shape[1]
    qg = q.reshape(t, -1, g, hd).astype(jnp.float32)  # [T, KVH, G, hd]
    scores = jnp.einsum("qkgd,skd->kgqs", qg, k.astype(jnp.float32)) * scale  # [KVH, G, T, T]
    dist = positions[:, None] - positions[None, :]
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (dist >= 0)
    if sliding_window is not None:
        mask &= dist < sliding_window
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("kgqs,skd->qkgd", probs, v.astype(jnp.float32))
    return out.reshape(t, h, hd).astype(q.dtype)


@partial(jax.jit, static_argnames=("cfg",))
def dense_logits(params, cfg: ModelConfig, token_ids: jax.Array, lengths: jax.Array) -> jax.Array:
    """Logits [B, L, V] (float32) for right-padded prompts token_ids [B, L] of `lengths` [B].

    The rotary setup is that of sequences up to L, as transformers picks length-dependent rope
    (dynamic NTK, LongRoPE) from the current length.
    """
    b, seq_len = token_ids.shape
    spec = get_model_spec(cfg.architecture)
    positions = jnp.tile(jnp.arange(seq_len, dtype=jnp.int32), b)
    seq_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), seq_len)
    valid = positions < jnp.repeat(lengths, seq_len)
    seq_ids = jnp.where(valid, seq_ids, -1 - jnp.arange(b * seq_len))  # padding sees only itself

    def attention(layer, q, k, v, qk, cache, _):
        q, k = apply_qk(qk, q, k)
        out = dense_causal_attention(q, k, v, seq_ids, positions,
                                     scale=cfg.attention_scale(layer),
                                     sliding_window=cfg.sliding_window(layer))
        return out, cache

    hidden, _ = spec.forward(params, cfg, token_ids.reshape(-1), positions,
                             [None] * cfg.num_hidden_layers, None, attention=attention,
                             rotary=spec.rotary(cfg, seq_len))
    return spec.compute_logits(params, hidden).reshape(b, seq_len, -1)


def dense_greedy_generate(params, cfg: ModelConfig, prompt: list[int], max_new_tokens: int,
                          eos_token_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by re-running the full forward each step (slow, obviously right)."""
    tokens = np.zeros((1, len(prompt) + max_new_tokens), np.int32)  # one shape: one compile
    tokens[0, : len(prompt)] = prompt
    for n in range(len(prompt), tokens.shape[1]):
        logits = dense_logits(params, cfg, jnp.asarray(tokens), jnp.asarray([n], jnp.int32))
        tokens[0, n] = int(jnp.argmax(logits[0, n - 1]))
        if tokens[0, n] in eos_token_ids:
            return tokens[0, len(prompt): n + 1].tolist()
    return tokens[0, len(prompt):].tolist()
