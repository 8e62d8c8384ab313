"""The adapter slots on the device: per layer and target module, A [in, L, R], B [L, R, out].

Fixed shapes (L = max_loras, R = max_lora_rank) whatever is loaded, so writing a slot is a
jitted in-place update and the step, which takes these arrays as an argument, never
recompiles. Every adaptable Linear of the model gets arrays (an adapter that does not target a
module has zeros there). Under tensor parallelism they shard with their base layer: a
column-parallel weight [in, out/tp] gets A replicated and B split on out; a row-parallel one
[in/tp, out] gets A split on in and B replicated; so x A and (x A) B line up with x W.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pjinfer.config import ModelConfig
from pjinfer.lora.adapter import LoRAAdapter, module_shapes
from pjinfer.lora.ops import AdaptedWeight
from pjinfer.models.registry import get_model_spec
from pjinfer.sharding.rules import holds_kv_heads, logical_axes, spec_for

LoRAWeights = list[dict[str, tuple[jax.Array, jax.Array]]]  # per layer: module -> (A, B)


def lora_layout(cfg: ModelConfig, max_loras: int, max_rank: int) -> list[dict[str, tuple]]:
    """Per layer: module -> (A shape [in, L, R], B shape [L, R, out]) for `cfg`'s layout."""
    shapes = module_shapes(cfg)
    return [{m: ((i, max_loras, max_rank), (max_loras, max_rank, o))
             for m, (i, o) in shapes.items()} for _ in range(cfg.num_hidden_layers)]


def lora_shardings(cfg: ModelConfig, mesh: Mesh, max_loras: int, max_rank: int) -> list:
    """NamedShardings of the slot arrays, consistent with each base weight's."""
    spec = get_model_spec(cfg.architecture)
    out = []
    for layer, modules in enumerate(lora_layout(cfg, max_loras, max_rank)):
        row = {}
        for m, (a_shape, b_shape) in modules.items():
            in_axis, out_axis = logical_axes(spec, ("layers", layer, m))
            row[m] = (NamedSharding(mesh, spec_for((in_axis, None, None), a_shape, mesh)),
                      NamedSharding(mesh, spec_for((None, None, out_axis), b_shape, mesh)))
        out.append(row)
    return out


def init_lora_weights(cfg: ModelConfig, max_loras: int, max_rank: int, dtype,
                      mesh: Mesh | None = None) -> LoRAWeights:
    """Zeroed slots (every slot empty) on the device(s)."""
    layout = lora_layout(cfg, max_loras, max_rank)
    shardings = lora_shardings(cfg, mesh, max_loras, max_rank) if mesh is not None else None

    def zeros(shape, sharding):
        return jax.jit(partial(jnp.zeros, shape, dtype), out_shardings=sharding)()
    return [{m: (zeros(a, None if shardings is None else shardings[i][m][0]),
                 zeros(b, None if shardings is None else shardings[i][m][1]))
             for m, (a, b) in modules.items()} for i, modules in enumerate(layout)]


def attach(params: dict, weights: LoRAWeights, slots: jax.Array, backend: str = "auto") -> dict:
    """The params with every adaptable weight wrapped with its slots (inside the step);
    `backend`: of the LoRA term (`kernels.ops.lora_group_deltas`)."""
    layers = []
    for lp, modules in zip(params["layers"], weights, strict=True):
        lp = dict(lp)
        for m, (a, b) in modules.items():
            lp[m] = AdaptedWeight(lp[m], a, b, slots, backend)
        layers.append(lp)
    return {**params, "layers": layers}


def slot_contents(adapter: LoRAAdapter | None, canonical: ModelConfig, layout: ModelConfig,
                  max_rank: int) -> list[dict[str, tuple[np.ndarray, np.ndarray]]]:
    """What one slot holds: per layer and module A [in, R], B [R, out] (float32, zero-padded
    to R, zeros where the adapter does not reach; kv heads duplicated as the layout does)."""
    spec = get_model_spec(layout.architecture)
    reps = layout.num_key_value_heads // canonical.num_key_value_heads
    out = []
    for layer, modules in enumerate(lora_layout(layout, 1, max_rank)):
        row = {}
        for m, (a_shape, b_shape) in modules.items():
            a_full = np.zeros((a_shape[0], a_shape[2]), np.float32)
            b_full = np.zeros(b_shape[1:], np.float32)
            found = None if adapter is None else adapter.weights.get((layer, m))
            if found is not None:
                a, b = found
                if reps > 1 and holds_kv_heads(spec, ("layers", layer, m)):
                    heads = b.reshape(b.shape[0], -1, layout.head_dim)
                    b = np.repeat(heads, reps, axis=1).reshape(b.shape[0], -1)
                a_full[:, :a.shape[1]], b_full[:b.shape[0]] = a, b
            row[m] = (a_full, b_full)
        out.append(row)
    return out


def _write(weights: LoRAWeights, index: jax.Array, contents: Any) -> LoRAWeights:
    return [{m: (a.at[:, index].set(contents[i][m][0].astype(a.dtype)),
                 b.at[index].set(contents[i][m][1].astype(b.dtype)))
             for m, (a, b) in modules.items()} for i, modules in enumerate(weights)]


def slot_writer(weights: LoRAWeights):
    """A jitted `(weights, row, contents) -> weights` that updates row `row` in place (the
    old arrays are donated); one compile for every row and adapter."""
    shardings = jax.tree.map(lambda x: x.sharding, weights)
    return jax.jit(_write, donate_argnums=0, out_shardings=shardings)
