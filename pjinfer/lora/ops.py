"""A base weight with its stacked adapters: `layers.linear` / `layers.linears` hand it the
input, and it adds the batched multi-adapter LoRA term (shrink x A, expand . B, grouped by
token slot; the math and its kernels are in pjinfer.kernels.lora_matmul, dispatched by
`kernels.ops`).

Two forms. Folded (plain weights at tp = 1, `pjinfer.lora.weights.fold_shrinks`): the first
weight of a group holds every slot's A of every module of the group as extra columns, W_ext
= [W | A_1 ... A_M], so its base matmul also yields the group's shrinks and only the masked
expand is left (`ops.lora_folded_deltas`: one Pallas kernel per group at decode on a GPU).
Separate (quantized or tensor-parallel weights): A and B beside
the base weight, the group's terms from `ops.lora_group_deltas`. A group of projections
sharing their input (q/k/v; gate/up) goes through `linears`, which hands the whole group to
the dispatch; base and LoRA outputs are summed in float32 and cast once, an elementwise add
XLA fuses into the consumer (RoPE, silu * up, the residual add).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from pjinfer.kernels import ops
from pjinfer.models.layers import linear


@partial(jax.tree_util.register_dataclass, data_fields=["base", "a", "b", "slots", "used"],
         meta_fields=["backend"])
@dataclass(frozen=True)
class AdaptedWeight:
    """A base weight plus the stacked adapters of its Linear and the step's token slots;
    `layers.linear` hands itself to `linear` of such a weight, `layers.linears` a group of
    them to `linears`."""

    base: jax.Array  # [in, out] (or any weight `layers.linear` understands); folded (a is
    # None), its group's first module: [in, out + M*L*R] = [W | A_1 ... A_M], slot-major
    a: jax.Array | None  # [in, L, R]; None: folded into its group's first base weight
    b: jax.Array  # [L, R, out]
    slots: jax.Array  # [T] int32, 0 = base model
    used: tuple[jax.Array, jax.Array] | None = None  # `lora_matmul.used_rows(slots, L)`,
    # once a step
    backend: str = "auto"  # of the LoRA term (`kernels.ops`)

    @property
    def carried(self) -> int:
        """How many modules' shrinks a folded base weight carries (0: none, or not folded)."""
        if self.a is not None:
            return 0
        num_slots, rank, out = self.b.shape
        return (self.base.shape[1] - out) // (num_slots * rank)

    def linear(self, x: jax.Array, bias: jax.Array | None = None, *,
               out_dtype=None) -> jax.Array:
        """x [T, in] -> base(x) + lora(x) (+ bias) [T, out], summed in float32."""
        return AdaptedWeight.linears(x, [self], [bias], out_dtype=out_dtype)[0]

    @staticmethod
    def linears(x: jax.Array, weights: list[AdaptedWeight], biases: list, *,
                out_dtype=None) -> list[jax.Array]:
        """x [T, in] through every weight of a group (same slots) -> [T, out_m] each: base
        outputs one matmul per module, the LoRA terms of the whole group in one call."""
        first = weights[0]
        ys = [linear(x, w.base, out_dtype=jnp.float32) for w in weights]
        folded = [w.a is None for w in weights]
        if any(folded) and not (all(folded) and first.carried == len(weights)
                                and not any(w.carried for w in weights[1:])):
            raise ValueError(
                f"a group of {len(weights)} LoRA-adapted projections whose first weight "
                f"carries {first.carried} modules' shrinks: projections folded together "
                "(pjinfer.lora.weights.fold_shrinks) go through `layers.linears` together, "
                "in their SHARED_INPUT order")
        if first.a is None:  # ys[0] [T, out_0 + M*L*R]: the base output, then the shrinks
            deltas = ops.lora_folded_deltas(ys[0], [w.b for w in weights], first.slots,
                                            first.used, backend=first.backend)
            ys[0] = ys[0][:, :first.b.shape[2]]
        else:
            deltas = ops.lora_group_deltas(x, [(w.a, w.b) for w in weights], first.slots,
                                           backend=first.backend)
        out = []
        for y, bias, delta in zip(ys, biases, deltas, strict=True):
            y = (y + delta).astype(out_dtype or x.dtype)
            out.append(y if bias is None else y + bias)
        return out
