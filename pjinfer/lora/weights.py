"""The adapter slots on the device: per layer and target module, A [in, L, R], B [L, R, out].

Fixed shapes (L = max_loras, R = max_lora_rank) whatever is loaded, so writing a slot is a
jitted in-place update and the step, which takes these arrays as an argument, never
recompiles. Every adaptable Linear of the model gets arrays (an adapter that does not target a
module has zeros there). Under tensor parallelism they shard with their base layer: a
column-parallel weight [in, out/tp] gets A replicated and B split on out; a row-parallel one
[in/tp, out] gets A split on in and B replicated; so x A and (x A) B line up with x W.

Without tensor parallelism, plain (unquantized) base weights take their A in
(`fold_shrinks`): the first weight of each group of modules sharing an input (`SHARED_INPUT`;
any other module alone) becomes W_ext = [W | A_1 ... A_M] ([in, out + M*L*R], each A
slot-major) and the slot arrays keep only B, so that base matmul yields the group's shrinks
(`pjinfer.lora.ops`); a slot write updates W_ext's columns of that slot.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pjinfer.config import ModelConfig
from pjinfer.kernels.lora_matmul import extended_weight, used_rows
from pjinfer.lora.adapter import LoRAAdapter, module_shapes
from pjinfer.lora.ops import AdaptedWeight
from pjinfer.models.registry import get_model_spec
from pjinfer.sharding.rules import holds_kv_heads, logical_axes, spec_for

# per layer: module -> (A, B); A None where folded into the base weight (`fold_shrinks`)
LoRAWeights = list[dict[str, tuple[jax.Array | None, jax.Array]]]

# modules the models hand to `layers.linears` together, in this order (one input)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shrink_groups(modules) -> tuple[tuple[str, ...], ...]:
    """`modules` (one layer's adapted module names) as groups sharing an input: the
    `SHARED_INPUT` groups present whole, then every other module alone."""
    groups = [g for g in SHARED_INPUT if all(m in modules for m in g)]
    grouped = {m for g in groups for m in g}
    return tuple(groups) + tuple((m,) for m in modules if m not in grouped)


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


def engine_slots(cfg: ModelConfig, params: dict, max_loras: int, max_rank: int, dtype,
                 mesh: Mesh | None) -> tuple[dict, LoRAWeights]:
    """The engine's empty slots; without a mesh the shrinks ride on the base matmul."""
    weights = init_lora_weights(cfg, max_loras, max_rank, dtype, mesh)
    return fold_shrinks(params, weights) if mesh is None else (params, weights)


def fold_shrinks(params: dict, weights: LoRAWeights) -> tuple[dict, LoRAWeights]:
    """(params, weights) with each group's shrinks folded into its first base weight:
    W_ext = [W | A_1 ... A_M] in the params, None for those A in the weights (the slots must
    be empty: A is zeros until `slot_writer` fills a slot); a group with a weight that is not
    a plain array (quantized) keeps its A. Only without a mesh (A's replicated columns would
    not follow a column-parallel W's split).

    The folded groups' weights go to the host and come back as W_ext and the members' W, the
    old device arrays deleted first (the engine owns its params, as `sleep` assumes): the new
    arrays then fill the one region the old ones left. Replaced in place on the device, each
    W_ext (a little wider than W) left its W's hole behind, and the KV cache sized from the
    free total later failed to find room (a 1.67 GiB sampler buffer out of memory on the
    H200 with Llama-3-8B)."""
    plan = [[g for g in shrink_groups(modules)
             if all(isinstance(lp[m], jax.Array) and modules[m][0] is not None for m in g)]
            for lp, modules in zip(params["layers"], weights, strict=True)]
    old = [{m: lp[m] for g in groups for m in g} for lp, groups in zip(params["layers"], plan,
                                                                        strict=True)]
    host = jax.device_get(old)
    for layer, modules in zip(old, weights, strict=True):
        for m, w in layer.items():
            w.delete()
            modules[m][0].delete()
    layers, out = [], []
    for lp, modules, groups, saved in zip(params["layers"], weights, plan, host, strict=True):
        lp, row = dict(lp), dict(modules)
        for group in groups:
            first = saved[group[0]]
            empty = np.zeros((first.shape[0], *modules[group[0]][1].shape[:2]), first.dtype)
            lp[group[0]] = jax.device_put(extended_weight(first, [empty] * len(group)),
                                          lp[group[0]].sharding)
            lp.update({m: jax.device_put(saved[m], lp[m].sharding) for m in group[1:]})
            row.update({m: (None, modules[m][1]) for m in group})
        layers.append(lp)
        out.append(row)
    return {**params, "layers": layers}, out


def attach(params: dict, weights: LoRAWeights, slots: jax.Array, backend: str = "auto") -> dict:
    """The params with every adaptable weight wrapped with its slots (inside the step);
    `backend`: of the LoRA term (`kernels.ops`)."""
    num_slots = next(iter(weights[0].values()))[1].shape[0]
    used = used_rows(slots, num_slots)  # once a step, for every layer's folded expand
    layers = []
    for lp, modules in zip(params["layers"], weights, strict=True):
        lp = dict(lp)
        for m, (a, b) in modules.items():
            lp[m] = AdaptedWeight(lp[m], a, b, slots, used, backend)
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


def _write(folded: list[dict], weights: LoRAWeights, index: jax.Array, contents: Any,
           groups: tuple) -> tuple[list[dict], LoRAWeights]:
    """Row `index` of every slot array, and of every folded W_ext: module j of its group
    writes its A [in, R] at columns out_0 + j*L*R + index*R."""
    new_folded = []
    for i, layer_groups in enumerate(groups):
        row = {}
        for group in layer_groups:
            w = folded[i][group[0]]
            num_slots, rank, out = weights[i][group[0]][1].shape
            for j, m in enumerate(group):
                a = contents[i][m][0].astype(w.dtype)
                w = jax.lax.dynamic_update_slice(
                    w, a, (0, out + j * num_slots * rank + index * rank))
            row[group[0]] = w
        new_folded.append(row)
    new_weights = [{m: (None if a is None else a.at[:, index].set(contents[i][m][0].astype(
        a.dtype)), b.at[index].set(contents[i][m][1].astype(b.dtype)))
                    for m, (a, b) in modules.items()} for i, modules in enumerate(weights)]
    return new_folded, new_weights


def slot_writer(weights: LoRAWeights):
    """`(params, weights, row, contents) -> (params, weights)`: row `row` updated in place,
    in B (and A, or the folded base weights' columns of that slot), by one jitted call whose
    old arrays are donated; one compile for every row and adapter."""
    shardings = jax.tree.map(lambda x: x.sharding, weights)
    groups = tuple(tuple(g for g in shrink_groups(modules) if modules[g[0]][0] is None)
                   for modules in weights)  # the folded groups of each layer
    jitted = jax.jit(partial(_write, groups=groups), donate_argnums=(0, 1),
                     out_shardings=(None, shardings))

    def write(params: dict, weights: LoRAWeights, row, contents) -> tuple[dict, LoRAWeights]:
        folded = [{g[0]: lp[g[0]] for g in layer_groups}
                  for lp, layer_groups in zip(params["layers"], groups, strict=True)]
        new_folded, weights = jitted(folded, weights, row, contents)
        layers = [{**lp, **new} for lp, new in zip(params["layers"], new_folded, strict=True)]
        return {**params, "layers": layers}, weights
    return write
