"""The batched multi-adapter LoRA term: shrink (x A) and expand (. B), grouped by slot.

Every token carries a slot: 0 is the base model, s >= 1 the adapter in row s - 1 of the
stacked arrays A [in, L, R] and B [L, R, out] (L = max_loras, R = max_lora_rank; a rank below
R is zero-padded, so it adds nothing). A is input-major so that, like B, it already is the
operand of a plain matmul ([in, L*R]; B: [L*R, out]): no transposed copy per step. The XLA
form computes x against every slot's A at once, [T, in] x [in, L*R], zeroes the columns of
the other slots (a one-hot mask: base tokens keep none) and expands with one
[T, L*R] x [L*R, out] matmul. Both are dense matmuls with an inner size of L*R (e.g.
8 x 16 = 128), so they use the matmul units at any batch size, read each adapter weight once
per step, and cost (in + out) * L * R / (in * out) of the base layer's FLOPs and bytes.
`lora_delta_reference` gathers each token's own A and B instead: the obvious formulation,
for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pjinfer.models.layers import linear


def slot_mask(slots: jax.Array, num_slots: int) -> jax.Array:
    """[T, L] float32: 1 where token t uses adapter row l (slot l + 1), 0 elsewhere."""
    return (slots[:, None] == jnp.arange(1, num_slots + 1, dtype=slots.dtype)[None, :]
            ).astype(jnp.float32)


def lora_shrink(x: jax.Array, a: jax.Array, slots: jax.Array) -> jax.Array:
    """x [T, in], A [in, L, R], slots [T] -> [T, L, R] float32, zero outside a token's slot."""
    h = jnp.einsum("ti,ilr->tlr", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    return h * slot_mask(slots, a.shape[1])[:, :, None]


def lora_expand(h: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """h [T, L, R] (float32; cast to `dtype` like the activations), B [L, R, out] -> [T, out]
    float32."""
    return jnp.einsum("tlr,lro->to", h.astype(dtype), b.astype(dtype),
                      preferred_element_type=jnp.float32)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """The LoRA term of every token, [T, out] float32 (scaling is folded into B)."""
    return lora_expand(lora_shrink(x, a, slots), b, x.dtype)


def lora_delta_reference(x: jax.Array, a: jax.Array, b: jax.Array,
                         slots: jax.Array) -> jax.Array:
    """Per token: x_t A[slot] B[slot] in float32, slot 0 contributing nothing."""
    a = jnp.moveaxis(a.astype(jnp.float32), 1, 0)  # [L, in, R]
    zero_a = jnp.zeros((1, *a.shape[1:]), jnp.float32)
    zero_b = jnp.zeros((1, *b.shape[1:]), jnp.float32)
    a_t = jnp.concatenate([zero_a, a])[slots]  # [T, in, R]
    b_t = jnp.concatenate([zero_b, b.astype(jnp.float32)])[slots]  # [T, R, out]
    h = jnp.einsum("ti,tir->tr", x.astype(jnp.float32), a_t)
    return jnp.einsum("tr,tro->to", h, b_t)


@partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "slots"],
         meta_fields=[])
@dataclass(frozen=True)
class AdaptedWeight:
    """A base weight plus the stacked adapters of its Linear and the step's token slots;
    `layers.linear` hands itself to `linear` of such a weight."""

    base: jax.Array  # [in, out], or whatever weight object `layers.linear` understands
    a: jax.Array  # [in, L, R]
    b: jax.Array  # [L, R, out]
    slots: jax.Array  # [T] int32, 0 = base model

    def linear(self, x: jax.Array, bias: jax.Array | None = None, *,
               out_dtype=None) -> jax.Array:
        """x [T, in] -> base(x) + lora(x) (+ bias) [T, out], summed in float32."""
        y = linear(x, self.base, out_dtype=jnp.float32) + lora_delta(x, self.a, self.b,
                                                                      self.slots)
        y = y.astype(out_dtype or x.dtype)
        return y if bias is None else y + bias
