"""The multi-LoRA term of a decode step against its roofline: the LoRA benchmark's
microbenchmark (`python -m pjinfer.benchmarks.lora --skip-engine`).

The LoRA term of each group of projections sharing an input (q/k/v, gate/up,
o, down), added to its base outputs as the model does (`AdaptedWeight.linears`), in the XLA form
(one-hot shrink + expand per module) and with the Pallas kernel (pjinfer/kernels/lora_matmul.py,
one call per group), at several token counts with max_loras = used slots of rank R, each
token on its own adapter (cycling over the L slots: "spread"), and W1's step: one real token
on one adapter, padded with base rows to the engine's 16-token bucket ("batch1"). One jitted
call covers the group in every layer, so the per-call Python dispatch (~50 us) does not hide
the device time; times are per layer-group, and `shrink_expand_per_step_s` sums a whole step.
Roofline: bytes = A and B of the slots the tokens use (adapters x R x (in x modules + outs))
+ x read + the float32 base read and result written; FLOPs = 2 x T x R x (in x modules +
outs); time >= max(bytes / bandwidth, FLOPs / matmul rate), with the ceilings measured in the
same process (pjinfer.benchmarks.ceilings).

"folded" is the engine's form at tp = 1 (`pjinfer.lora.weights.fold_shrinks`): the group's
step through `layers.linears` with every slot's A carried by its first weight, minus the same
step on the plain weights (the LoRA term; its roofline counts only the used adapters' A and
B, since x and the outputs are the base matmul's anyway), and the masked expand alone
(`ops.lora_folded_deltas`; bytes: the used B, the shrink columns read and the float32 terms
written).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import numpy as np

from pjinfer.benchmarks.ceilings import pipelined_seconds, timing_plan

# The projections that share an input, as the decoder groups them (layers.linears).
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"),
          "o": ("o_proj",), "down": ("down_proj",)}


def _apply_groups(x, adapters, slots, base, *, sizes: Any = None):
    """Every layer's LoRA term of one group added to its base outputs (float32, cast once),
    as `AdaptedWeight.linears` does: the Pallas kernel tiled by `sizes` (a LoRABlockSizes),
    else the XLA form, whatever T is."""
    import jax

    from pjinfer.kernels import lora_matmul, ops

    out = []
    for layer in adapters:  # distinct weights per layer: nothing for XLA to share
        if sizes is not None:
            deltas = lora_matmul.lora_group_delta(x, layer, slots, block_sizes=sizes,
                                                  interpret=jax.default_backend() != "gpu")
        else:
            deltas = ops.lora_group_deltas(x, layer, slots, backend="reference")
        out += [(b + d).astype(x.dtype) for b, d in zip(base, deltas, strict=True)]
    return out


def _timed(inputs: tuple, sizes: Any, timing: dict, layers: int,
           roofline_s: float) -> dict[str, Any]:
    """Best and median seconds per layer-group of `_apply_groups` over `inputs`."""
    import jax

    fn = jax.jit(lambda *a: _apply_groups(*a, sizes=sizes))
    secs = pipelined_seconds(fn, inputs, sync=jax.block_until_ready, **timing)
    best = min(secs) / layers
    out = {"best_s": best, "median_s": float(np.median(secs)) / layers,
           "fraction_of_roofline": roofline_s / best}
    return out if sizes is None else {**out, "block_sizes": dataclasses.asdict(sizes)}


def _group_outputs(x, layers, slots, num_slots: int):
    """Every layer's group through `layers.linears` as the engine runs it at tp = 1: layers
    [[(W_m, B_m)]] with W_0 = [W | A_1 ... A_M] (folded shrinks) and B_m [L, R, out_m];
    B None: the plain base weights (the no-LoRA step)."""
    from pjinfer.kernels.lora_matmul import used_rows
    from pjinfer.lora.ops import AdaptedWeight
    from pjinfer.models.layers import linears

    used = used_rows(slots, num_slots)  # once a step, as `lora.weights.attach` does
    out = []
    for group in layers:
        weights = [w if b is None else AdaptedWeight(w, None, b, slots, used)
                   for w, b in group]
        out += linears(x, weights, [None] * len(group))
    return out


def _folded_rows(x, base, folded, slots, num_slots: int, expand_inputs: tuple, timing: dict,
                 layers: int, roofline_s: float, expand_roofline_s: float) -> dict[str, Any]:
    """The folded form's LoRA term per layer-group: its group's step minus the same step on
    the plain weights (one process, one plan), and the masked expand alone."""
    import jax

    from pjinfer.kernels import ops

    def best(fn, inputs):
        secs = pipelined_seconds(jax.jit(fn), inputs, sync=jax.block_until_ready, **timing)
        return min(secs) / layers

    step = partial(_group_outputs, num_slots=num_slots)
    plain, with_lora = best(step, (x, base, slots)), best(step, (x, folded, slots))
    def expands(ys, bs, s):
        return [ops.lora_folded_deltas(y, b, s) for y, b in zip(ys, bs, strict=True)]
    expand = best(expands, expand_inputs)
    term = with_lora - plain
    return {"base_step_s": plain, "lora_step_s": with_lora, "best_s": term,
            "fraction_of_roofline": roofline_s / term if term > 0 else None,
            "expand_best_s": expand, "expand_fraction_of_roofline": expand_roofline_s / expand}


def _slot_layouts(token_counts: list[int], slots: int) -> list[tuple[str, int, np.ndarray]]:
    """(layout, T, token slots): every T "spread" (token t on adapter 1 + t mod L), then
    "batch1": W1's step, one token on adapter 1 and 15 base rows (the 16-token bucket)."""
    out = [("spread", t, 1 + np.arange(t) % slots) for t in token_counts]
    return out + [("batch1", 16, np.eye(1, 16, dtype=np.int64)[0])]


def microbenchmark(cfg: Any, slots: int, rank: int, token_counts: list[int], ceilings: Any,
                   dtype: str, k_ranges: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Per group, slot layout and token count: one jitted call over every layer's group (so
    Python dispatch, ~50 us a call, does not hide microseconds of device time), XLA form vs
    Pallas kernel, per layer-group. `k_ranges`: extra kernel tilings to time
    (`pick_block_sizes(..., max_k_range)`), under "pallas_by_k_range"."""
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.lora_matmul import extended_weight, pick_block_sizes, supported
    from pjinfer.kernels.ops import LORA_PALLAS_MAX_ROWS
    from pjinfer.lora.adapter import module_shapes

    on_cpu = jax.default_backend() == "cpu"  # a plumbing check there: the kernel interprets
    timing = timing_plan(2 if on_cpu else 10, None, 1 if on_cpu else 2, on_cpu=on_cpu)
    item = np.dtype(jnp.dtype(dtype)).itemsize
    shapes, layers = module_shapes(cfg), cfg.num_hidden_layers
    rows = []
    for group, modules in GROUPS.items():
        d_in, outs = shapes[modules[0]][0], [shapes[m][1] for m in modules]
        keys = iter(jax.random.split(jax.random.key(len(rows)), 3 * layers * len(modules)))
        adapters = [[((jax.random.normal(next(keys), (d_in, slots, rank)) * d_in ** -0.5
                       ).astype(dtype),
                      (jax.random.normal(next(keys), (slots, rank, o)) * 0.01).astype(dtype))
                     for o in outs] for _ in range(layers)]
        kernel_fits = supported(jnp.zeros((1, d_in)), adapters[0], pick_block_sizes(d_in, outs))
        base_w = [[(jax.random.normal(next(keys), (d_in, o)) * d_in ** -0.5).astype(dtype)
                   for o in outs] for _ in range(layers)]
        plain = [[(w, None) for w in ws] for ws in base_w]
        folded = [[(extended_weight(ws[0], [a for a, _ in ad]), ad[0][1])]
                  + [(w, b) for w, (_, b) in zip(ws[1:], ad[1:], strict=True)]
                  for ws, ad in zip(base_w, adapters, strict=True)]
        for layout, t, token_slots in _slot_layouts(token_counts, slots):
            x = jax.random.normal(jax.random.key(t), (t, d_in)).astype(dtype)
            base = [jnp.zeros((t, o), jnp.float32) for o in outs]
            used = len(set(token_slots.tolist()) - {0})
            nbytes = layers * (used * rank * (d_in * len(outs) + sum(outs)) * item
                               + t * d_in * item + t * sum(outs) * (4 + item))
            flops = layers * 2 * t * rank * (d_in * len(outs) + sum(outs))
            bound = max(nbytes / ceilings.hbm_bytes_per_s, flops / ceilings.matmul_flops_per_s)
            row = {"group": group, "modules": list(modules), "in": d_in, "outs": outs,
                   "layout": layout, "tokens": t, "adapters_used": used, "slots": slots,
                   "rank": rank, "layers": layers, "bytes": nbytes, "flops": flops,
                   "roofline_s": bound / layers}
            kernel_runs = kernel_fits and t <= LORA_PALLAS_MAX_ROWS  # the kernel's own limit

            inputs = (x, adapters, jnp.asarray(token_slots, jnp.int32), base)
            per_layer = bound / layers
            row["xla"] = _timed(inputs, None, timing, layers, per_layer)
            row["pallas"] = (_timed(inputs, pick_block_sizes(d_in, outs), timing, layers,
                                    per_layer) if kernel_runs else None)
            extra = slots * rank * len(outs)  # the A columns W_ext carries
            shrinks = [jnp.zeros((t, outs[0] + extra), jnp.float32)] * layers
            expand_bytes = layers * (used * rank * sum(outs) * item + t * (extra + sum(outs)) * 4)
            row["folded"] = _folded_rows(
                x, plain, folded, jnp.asarray(token_slots, jnp.int32), slots,
                (shrinks, [[b for _, b in ad] for ad in adapters],
                 jnp.asarray(token_slots, jnp.int32)), timing, layers,
                max(layers * used * rank * (d_in * len(outs) + sum(outs)) * item
                    / ceilings.hbm_bytes_per_s, flops / ceilings.matmul_flops_per_s) / layers,
                max(expand_bytes / ceilings.hbm_bytes_per_s,
                    2 * t * rank * sum(outs) / ceilings.matmul_flops_per_s) / layers)
            if kernel_runs and k_ranges:
                row["pallas_by_k_range"] = {
                    str(n): _timed(inputs, pick_block_sizes(d_in, outs, n), timing, layers,
                                   per_layer) for n in k_ranges}
            rows.append(row)
        del adapters, base_w, plain, folded
    return rows


def step_totals(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per slot layout and token count ("spread/16", "batch1/16") and form: the LoRA term of
    a whole step (every group of every layer)."""
    out: dict[str, dict[str, float | None]] = {}
    for key in dict.fromkeys(f"{r['layout']}/{r['tokens']}" for r in rows):
        mine = [r for r in rows if f"{r['layout']}/{r['tokens']}" == key]
        out[key] = {form: (None if any(r[form] is None for r in mine) else
                           sum(r[form]["best_s"] * r["layers"] for r in mine))
                    for form in ("xla", "pallas", "folded")}
    return out
