"""A base weight with its stacked adapters: `layers.linear` / `layers.linears` hand it the
input, and it adds the batched multi-adapter LoRA term (shrink x A, expand . B, grouped by
token slot; the math and its kernels are in pjinfer.kernels.lora_matmul, dispatched by
`kernels.ops.lora_group_deltas`).

A group of projections sharing their input (q/k/v; gate/up) goes through `linears`, which
hands the whole group to the dispatch (the XLA form, the default, is two matmuls per module;
the Pallas form, `backend="pallas"`, one kernel per group); base and LoRA outputs are summed
in float32 and cast once, an elementwise add XLA fuses into the consumer (RoPE, silu * up,
the residual add).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pjinfer.kernels import ops
from pjinfer.models.layers import linear


@partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "slots"],
         meta_fields=["backend"])
@dataclass(frozen=True)
class AdaptedWeight:
    """A base weight plus the stacked adapters of its Linear and the step's token slots;
    `layers.linear` hands itself to `linear` of such a weight, `layers.linears` a group of
    them to `linears`."""

    base: jax.Array  # [in, out], or whatever weight object `layers.linear` understands
    a: jax.Array  # [in, L, R]
    b: jax.Array  # [L, R, out]
    slots: jax.Array  # [T] int32, 0 = base model
    backend: str = "auto"  # of the LoRA term (`kernels.ops.lora_group_deltas`)

    def linear(self, x: jax.Array, bias: jax.Array | None = None, *,
               out_dtype=None) -> jax.Array:
        """x [T, in] -> base(x) + lora(x) (+ bias) [T, out], summed in float32."""
        return AdaptedWeight.linears(x, [self], [bias], out_dtype=out_dtype)[0]

    @staticmethod
    def linears(x: jax.Array, weights: list[AdaptedWeight], biases: list, *,
                out_dtype=None) -> list[jax.Array]:
        """x [T, in] through every weight of a group (same slots) -> [T, out_m] each: base
        outputs one matmul per module, the LoRA terms of the whole group in one call."""
        deltas = ops.lora_group_deltas(x, [(w.a, w.b) for w in weights], weights[0].slots,
                                       backend=weights[0].backend)
        out = []
        for w, bias, delta in zip(weights, biases, deltas, strict=True):
            y = (linear(x, w.base, out_dtype=jnp.float32) + delta).astype(out_dtype or x.dtype)
            out.append(y if bias is None else y + bias)
        return out
