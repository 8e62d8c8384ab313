"""Where a decode step's LoRA time goes: the projections of a Llama-3-8B-shaped model (all
layers in one jitted call, attention replaced by an elementwise stand-in) without LoRA, with
the XLA form of the LoRA term, with the expand folded into the base matmul, and with the
shrink folded into it.

`folded` (the expand folded): a module's B rows are appended to its base weight
([in + L*R, out]), so x W + (x A) B = [x, x A] [W; B] is one matmul; the shrinks of the
modules sharing an input (q/k/v, gate/up) are one matmul over their A's side by side.
`shrink_folded[_pallas]` (the engine's form at tp = 1): every slot's A columns of a group's
modules are appended to the group's first base weight ([in, out + M*L*R]), so that matmul
yields the group's x A too; the rest is the masked expand, by XLA
(`kernels.lora_matmul.folded_deltas`) or one Pallas kernel per group
(`folded_group_expand`). The XLA form runs two matmuls per module
(`kernels.lora_matmul.lora_delta`). Records ms per call and the kernels XLA emits
(top-level fusions and custom calls of the optimized module), so the number of launches a
form costs is known before an engine is changed for it.

    python -m pjinfer.benchmarks.lora_fold --out lora_fold.json [--layers 32 --tokens 1 16]
"""

from __future__ import annotations

import argparse
import re
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from pjinfer.benchmarks import common  # noqa: E402

MODULES = {"q": ("d", "q"), "k": ("d", "kv"), "v": ("d", "kv"), "o": ("q", "d"),
           "gate": ("d", "f"), "up": ("d", "f"), "down": ("f", "d")}
GROUPS = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))
FORMS = ("base", "xla", "folded", "shrink_folded", "shrink_folded_pallas")


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=common.positive_int, default=32)
    p.add_argument("--tokens", type=common.positive_int, nargs="+", default=[1, 16])
    p.add_argument("--hidden", type=common.positive_int, default=4096)
    p.add_argument("--q-width", type=common.positive_int, default=4096)
    p.add_argument("--kv-width", type=common.positive_int, default=1024)
    p.add_argument("--intermediate", type=common.positive_int, default=14336)
    p.add_argument("--max-loras", type=common.positive_int, default=8)
    p.add_argument("--rank", type=common.positive_int, default=16)
    p.add_argument("--calls", type=common.positive_int, default=20)
    p.add_argument("--samples", type=common.positive_int, default=7)
    p.add_argument("--forms", nargs="+", default=None,
                   help="forms to run (default: all); base is always run")
    p.add_argument("--hlo-dir", default=None,
                   help="write each form's optimized HLO here (what the kernel count counts)")
    a = p.parse_args(argv)
    if a.q_width % a.kv_width:
        p.error("--q-width must be a multiple of --kv-width")
    return a


def _weights(a, key):
    """Per layer and module: W [in, out], A [in, L, R], B [L, R, out] (bf16; B large enough
    that the LoRA term moves the output by a visible fraction)."""
    import jax
    import jax.numpy as jnp

    dims = {"d": a.hidden, "q": a.q_width, "kv": a.kv_width, "f": a.intermediate}
    layers = []
    for layer in range(a.layers):
        row = {}
        for i, (m, (i_dim, o_dim)) in enumerate(MODULES.items()):
            k = jax.random.fold_in(key, layer * 16 + i)
            n_in, n_out = dims[i_dim], dims[o_dim]
            kw, ka, kb = jax.random.split(k, 3)
            row[m] = (0.02 * jax.random.normal(kw, (n_in, n_out), jnp.bfloat16),
                      0.02 * jax.random.normal(ka, (n_in, a.max_loras, a.rank), jnp.bfloat16),
                      0.1 * jax.random.normal(kb, (a.max_loras, a.rank, n_out), jnp.bfloat16))
        layers.append(row)
    return layers


def _fold(layers):
    """Folded weights: per module [W; B] ([in + L*R, out]); per group its A's side by side
    ([in, M * L * R], module-major, so each module's h is one contiguous column range)."""
    import jax.numpy as jnp

    out = []
    for row in layers:
        folded = {m: jnp.concatenate([w, b.reshape(-1, b.shape[-1])]) for m, (w, _, b) in
                  row.items()}
        shrink = {g: jnp.concatenate([row[m][1].reshape(row[m][1].shape[0], -1) for m in g],
                                     axis=1) for g in GROUPS}
        out.append((folded, shrink))
    return out


def _fold_shrink(layers):
    """Per group, its first module's W_ext = [W | A_1 ... A_M] ([in, out + M*L*R]); the
    other modules' W; every module's B."""
    from pjinfer.kernels.lora_matmul import extended_weight

    out = []
    for row in layers:
        folded = {m: (w, b) for m, (w, _, b) in row.items()}
        for g in GROUPS:
            folded[g[0]] = (extended_weight(row[g[0]][0], [row[m][1] for m in g]), row[g[0]][2])
        out.append(folded)
    return out


def _norm(x):
    """RMS norm without a weight: keeps 32 random layers' activations finite."""
    import jax
    import jax.numpy as jnp

    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
            ).astype(x.dtype)


def _layer(x, project, kv_reps: int):
    """One pre-norm layer's projections around an elementwise stand-in for attention."""
    import jax
    import jax.numpy as jnp

    q, k, v = project(("q", "k", "v"), _norm(x))
    att = q + jnp.repeat(k + v, kv_reps, axis=1)
    x = x + project(("o",), att)[0]
    gate, up = project(("gate", "up"), _norm(x))
    return x + project(("down",), jax.nn.silu(gate) * up)[0]


def _forms(a):
    import jax
    import jax.numpy as jnp

    from pjinfer.kernels.lora_matmul import (
        folded_deltas,
        folded_group_expand,
        lora_delta,
        slot_mask,
        used_rows,
    )

    reps = a.q_width // a.kv_width

    def base(layers, x, slots):
        for row in layers:
            x = _layer(x, lambda g, h, row=row: [jnp.dot(h, row[m][0]) for m in g], reps)
        return x

    def xla(layers, x, slots):
        for row in layers:
            def project(g, h, row=row):
                return [(jnp.dot(h, row[m][0], preferred_element_type=jnp.float32)
                         + lora_delta(h, row[m][1], row[m][2], slots)).astype(h.dtype)
                        for m in g]
            x = _layer(x, project, reps)
        return x

    def folded(layers, x, slots):
        mask = slot_mask(slots, a.max_loras)[:, None, :, None]  # [T, 1, L, 1]
        for weights, shrink in layers:
            def project(g, h, weights=weights, shrink=shrink):
                s = jnp.dot(h, shrink[g], preferred_element_type=jnp.float32)
                s = (s.reshape(h.shape[0], len(g), a.max_loras, a.rank) * mask
                     ).astype(h.dtype).reshape(h.shape[0], len(g), -1)
                return [jnp.dot(jnp.concatenate([h, s[:, i]], axis=1), weights[m])
                        for i, m in enumerate(g)]
            x = _layer(x, project, reps)
        return x

    def shrink_folded(layers, x, slots, pallas: bool):
        used = used_rows(slots, a.max_loras)
        for row in layers:
            def project(g, h, row=row):
                ys = [jnp.dot(h, row[m][0], preferred_element_type=jnp.float32) for m in g]
                bs = [row[m][1] for m in g]
                deltas = (folded_group_expand(ys[0], bs, slots, used, interpret=not on_gpu)
                          if pallas else folded_deltas(ys[0], bs, slots))
                return [(y[:, :b.shape[2]] + d).astype(h.dtype)
                        for y, b, d in zip(ys, bs, deltas, strict=True)]
            x = _layer(x, project, reps)
        return x

    on_gpu = jax.default_backend() == "gpu"
    return {"base": jax.jit(base), "xla": jax.jit(xla), "folded": jax.jit(folded),
            "shrink_folded": jax.jit(partial(shrink_folded, pallas=False)),
            "shrink_folded_pallas": jax.jit(partial(shrink_folded, pallas=True))}


def _rel(a, b) -> float:
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def kernel_count(hlo: str) -> int:
    """Top-level fusions and custom calls of an optimized HLO module (bodies of fusions not
    counted): roughly the kernels one call launches."""
    count, inside_fusion = 0, False
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?(\S+) ", line)
        if head and line.rstrip().endswith("{"):
            inside_fusion = head.group(1).startswith(("fused", "%fused")) or "fusion" in \
                head.group(1) or "triton" in head.group(1)
            continue
        if not inside_fusion and re.search(r" (fusion|custom-call)\(", line):
            count += 1
    return count


def main(argv=None) -> dict:
    a = _args(argv)
    import jax
    import jax.numpy as jnp

    record = common.new_record("lora_fold", argv or sys.argv[1:], vars(a))
    record["device"] = common.jax_device_info()
    layers = _weights(a, jax.random.key(0))
    shrink_folded = _fold_shrink(layers)
    inputs = {"base": layers, "xla": layers, "folded": _fold(layers),
              "shrink_folded": shrink_folded, "shrink_folded_pallas": shrink_folded}
    forms = {n: f for n, f in _forms(a).items()
             if a.forms is None or n in ("base", "xla") or n in a.forms}
    rows = []
    for t in a.tokens:
        x = 0.1 * jax.random.normal(jax.random.key(t), (t, a.hidden), jnp.bfloat16)
        slots = jnp.zeros((t,), jnp.int32).at[0].set(1)  # W1: one token on adapter 1
        outs = {}
        for name, fn in forms.items():
            args = (inputs[name], x, slots)
            hlo = fn.lower(*args).compile().as_text()
            if a.hlo_dir:
                Path(a.hlo_dir).mkdir(parents=True, exist_ok=True)
                (Path(a.hlo_dir) / f"{name}_t{t}.hlo.txt").write_text(hlo)
            sec = common.median_call_seconds(fn, *args, reps=a.calls, repeats=a.samples)
            outs[name] = fn(*args)
            rows.append({"tokens": t, "form": name, "ms": sec * 1e3,
                         "kernels": kernel_count(hlo)})
            print(f"T={t:3d} {name:7s} {sec * 1e3:8.3f} ms  {rows[-1]['kernels']} kernels",
                  flush=True)
        rows.append({"tokens": t, "xla_vs_base_rel_diff": _rel(outs["xla"], outs["base"]),
                     **{f"{name}_vs_xla_rel_err": _rel(outs[name], outs["xla"])
                        for name in forms if name not in ("base", "xla")}})
    record["results"] = rows
    common.finish_record(record, a.out)
    return record


if __name__ == "__main__":
    main()
