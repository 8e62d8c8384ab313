"""Quantized weights into their place: read from a checkpoint, quantized at load, or dummy.

Which params are quantized: the decoder layers' Linear weights (`*_proj`) and, for fp8 / int8,
a MoE layer's expert stacks (`pjinfer.quantization.experts`); embeddings, norms, routers,
biases and the head stay in the model dtype. Pre-quantized formats replace HF Linear weights
(one `.weight`, transposed to input-major except fp8's, which stay [out, in]); a checkpoint
may leave some of them float (an `ignore` list, `modules_to_not_convert`): a layer is read as
quantized when its format's marker tensor is there. Every part is placed with its weight's
logical axes (`component_axes`), so a tp mesh splits scales and zeros with their weight;
row-parallel splits must keep whole groups.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from pjinfer.errors import ModelLoadError
from pjinfer.models.moe import ROUTED_EXPERT_PARAMS
from pjinfer.models.spec import ParamSpec, transpose
from pjinfer.quantization import awq, compressed_tensors, fp8, gguf_blocks, gptq
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.experts import (
    EXPERT_KINDS,
    QuantizedExperts,
    expert_bytes,
    quantize_experts,
    scale_axes,
    value_axes,
)
from pjinfer.quantization.host import HostQuant
from pjinfer.quantization.weight import (
    OUT_MAJOR,
    QuantizedWeight,
    component_axes,
    dequantize,
    int4_span,
    quantize_int4,
    quantize_per_channel,
)
from pjinfer.sharding.placement import Placer
from pjinfer.sharding.rules import LOGICAL_TO_MESH, spec_for

log = logging.getLogger("pjinfer")
READERS: dict[str, ModuleType] = {"gptq": gptq, "awq": awq, "fp8": fp8,
                                  "compressed-tensors": compressed_tensors, "gguf": gguf_blocks}


def quantizable(p: ParamSpec) -> bool:
    """A decoder layer's Linear weight (any architecture: on-the-fly methods quantize it)."""
    return p.path[0] == "layers" and str(p.path[-1]).endswith("_proj") and len(p.shape) == 2


def loads_quantized(p: ParamSpec, q: QuantConfig | None) -> bool:
    """Whether `load_quantized` loads `p`: a Linear weight, or an expert stack that `q`
    quantizes or a quantized checkpoint may store quantized."""
    if q is None:
        return False
    stack = p.path[0] == "layers" and p.path[-1] in ROUTED_EXPERT_PARAMS and q.method != "gguf"
    return quantizable(p) or quantizable_experts(p, q) or (stack and q.from_checkpoint)


def quantizable_experts(p: ParamSpec, q: QuantConfig | None) -> bool:
    """An expert stack that `q` turns into `QuantizedExperts`: fp8 / int8 quantization on the
    fly (or of dummy weights), an fp8 checkpoint's, per tensor, channel or block, a
    symmetric 8-bit int checkpoint's and a 4-bit one's (GPTQ, AWQ, compressed-tensors),
    without act-order (either may also store its experts float); other int-packed experts
    load dequantized."""
    if q is None or p.path[0] != "layers" or p.path[-1] not in ROUTED_EXPERT_PARAMS:
        return False
    if q.from_checkpoint:
        return q.method != "gguf" and _stored_experts(q)
    return q.weight_kind in EXPERT_KINDS


def _stored_experts(q: QuantConfig) -> bool:
    """A checkpoint's experts as the expert kernels read them: fp8; int8 values times a
    scale per channel and K group (symmetric); int4 nibbles with their groups' scales and
    zeros (act-order: rows sorted by group, x permuted per expert by the MoE layer)."""
    return q.weight_kind in ("fp8", "int4") or (q.weight_kind == "int8" and q.sym)


def _k_groups(p: ParamSpec, q: QuantConfig) -> int:
    """Scale groups along a checkpoint's expert K (block-wise fp8: one per input block;
    int: one per quantization group)."""
    if not q.from_checkpoint or q.group_size <= 0:
        return 1
    return max(1, p.shape[1] // q.group_size)


def device_bytes(p: ParamSpec, q: QuantConfig | None, itemsize: int) -> int:
    """Bytes a param will take on the device, from its spec alone (memory planning before a
    load): a Linear weight the quantization replaces at its bits plus float32 scales (and
    zeros, and an act-order permutation) per group; anything else at `itemsize` (the model
    dtype's). GGUF tensors, whose types only the file knows, count as float."""
    if quantizable_experts(p, q):
        return expert_bytes(p.shape, _k_groups(p, q), q.weight_kind if q.from_checkpoint
                            else "int8")
    if q is None or q.method == "gguf" or not quantizable(p) or (
            q.from_checkpoint and not _stored_as_linear(p)):
        return math.prod(p.shape) * itemsize
    rows, cols = p.shape
    groups = 1 if q.group_size == -1 else -(-rows // q.group_size)
    per_group = 4 * cols * (1 if q.sym else 2)  # scales (and zeros), float32
    return rows * cols * q.bits // 8 + groups * per_group + (4 * rows if q.desc_act else 0)


def _stored_as_linear(p: ParamSpec) -> bool:
    """Read from one HF Linear `.weight` and transposed: what pre-quantized formats replace
    (fused or Conv1D checkpoint tensors, e.g. Phi-3's qkv_proj or GPT-2's, are read as float)."""
    return (p.transform is transpose and len(p.hf_names) == 1
            and p.hf_names[0].endswith(".weight"))


def _marker(q: QuantConfig) -> str:
    """The tensor whose presence says a layer is stored quantized."""
    if q.method in ("gptq", "awq"):
        return "qweight"
    if q.method == "gguf":
        return "gguf_blocks"
    if q.method == "compressed-tensors" and q.fmt == "pack-quantized":
        return "weight_packed"
    return fp8.parts(q)[1] if q.kind == "float" else "weight_scale"


def _parts(q: QuantConfig) -> tuple[str, ...]:
    reader = READERS[q.method]
    return reader.parts(q) if callable(getattr(reader, "parts", None)) else reader.PARTS


def load_quantized(get: Callable[[str], Any], has: Callable[[str], bool], p: ParamSpec,
                   q: QuantConfig, placer: Placer,
                   load_float: Callable[[ParamSpec], jax.Array]) -> QuantizedWeight | jax.Array:
    """One quantizable param from a checkpoint: its quantized parts when stored so, else the
    float weight (quantized on the device for the on-the-fly methods)."""
    if not q.from_checkpoint:
        return quantize_on_device(load_float(p), p, q, placer)
    if p.path[-1] in ROUTED_EXPERT_PARAMS:
        return _checkpoint_experts(get, has, p, q, placer, load_float)
    prefix = p.hf_names[0].removesuffix(".weight")
    if not _stored_as_linear(p) or not has(f"{prefix}.{_marker(q)}"):
        return load_float(p)
    try:
        host = READERS[q.method].read(get, prefix, p.shape, q)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint is missing tensor {e.args[0]!r}: a {q.method} layer "
                             f"needs {', '.join(f'{prefix}.{n}' for n in _parts(q))}") from None
    return place_host(host, p, placer)


def _checkpoint_experts(get: Callable[[str], Any], has: Callable[[str], bool], p: ParamSpec,
                        q: QuantConfig, placer: Placer,
                        load_float: Callable[..., jax.Array]) -> Any:
    """An expert stack from a quantized checkpoint: float experts as they are; fp8 experts
    (each a float8_e4m3fn [out, in] `.weight` with a per-tensor or per-channel
    `.weight_scale`, as for a Linear, or block-wise `.weight_scale_inv`), symmetric int8 ones
    and int4 ones (GPTQ, AWQ, compressed-tensors; per channel or group; act-order with each
    expert's row order) stacked into `QuantizedExperts`, scales (and int4 zeros) per output
    channel and K group; asymmetric 8-bit experts, groups the kernels cannot step through
    and act-order rows a tp split would cut dequantized to the model dtype, with a
    warning."""
    first = p.hf_names[0].removesuffix(".weight")
    if not has(f"{first}.{_marker(q)}"):
        return load_float(p)
    where = "/".join(map(str, p.path))
    as_stored = _stored_experts(q)
    if as_stored and not _kernel_groups(p, q, placer):
        log.warning("%s: %s experts with K groups of %d rows are dequantized to the model "
                    "dtype at load (taking its bytes): the expert kernels need K groups of a "
                    "multiple of 16 rows that split whole over tensor_parallel_size, and "
                    "act-order experts a K that it does not split (or use "
                    "enable_expert_parallel)", where, q.method, q.group_size)
        as_stored = False
    if not as_stored:
        if q.weight_kind == "fp8":
            return load_float(p)  # `weights.read_param` applies each block's scale
        log.warning("%s: %s %d-bit experts are dequantized to the model dtype at load (the "
                    "expert kernels read fp8, symmetric int8 and int4 experts without "
                    "act-order), taking that dtype's bytes", where, q.method, q.bits)
        return load_float(p, _dequantized_experts(get, p, q))
    e, rows, *out = p.shape
    try:  # each expert's HF [out, in] tensors, in the stack's order (gate/up: g0, u0, g1, ...)
        hosts = [READERS[q.method].read(get, name.removesuffix(".weight"), (rows, out[-1]), q)
                 for name in p.hf_names]
    except KeyError as missing:
        raise ModelLoadError(f"checkpoint is missing tensor {missing.args[0]!r}: {q.method} "
                             f"experts need {', '.join(_parts(q))} for each of {first} ..."
                             ) from None
    perm = _expert_perms(hosts, e, rows)
    if isinstance(perm, str):
        log.warning("%s: act-order experts are dequantized to the model dtype at load: %s",
                    where, perm)
        return load_float(p, _dequantized_experts(get, p, q))
    # fp8 / int4 values are [out, in (/ 2)] as stored, int8 ones [in, out] (`OUT_MAJOR`)
    values = np.stack([h.packed if h.kind in OUT_MAJOR else h.packed.T for h in hosts])
    values = values.reshape(e, *out, values.shape[-1])
    groups = hosts[0].scales.shape[0]
    grouped = groups > 1 or hosts[0].kind == "int4"  # int4's scales are always grouped
    value_spec, scale_spec = _part_specs(p, placer, groups if grouped else None, values.shape)
    parts = [np.stack([getattr(h, name) for h in hosts]) for name in ("scales", "zeros")
             if getattr(hosts[0], name) is not None]  # each [E * names, G, out]
    placed = [placer.from_host(scale_spec, _expert_groups(a, e, out, grouped)) for a in parts]
    if perm is not None:
        perm = placer.from_host(ParamSpec((*p.path, "perm"), perm.shape,
                                          axes=(placer.axes(p)[0], None)), perm)
    scales, zeros = (*placed, None)[:2]
    # a block-wise checkpoint's scales span its blocks' columns; kept where each output
    # piece (gate's and up's I, down's D) holds whole blocks and no mesh cuts them
    block = q.block[0] if q.block and grouped and hosts[0].kind == "fp8" else 1
    if out[-1] % block or placer.mesh is not None:
        block = 1
    return QuantizedExperts(placer.from_host(value_spec, values), scales, zeros, perm,
                            scale_cols=block)


def _expert_perms(hosts: list[HostQuant], e: int, rows: int) -> np.ndarray | str | None:
    """Each expert's act-order row order [E, K] (None: none reorders), or why not: the
    projections of one expert (gate and up) must share theirs, which the layer applies to
    their one input."""
    if all(h.perm is None for h in hosts):
        return None
    plain = np.arange(rows, dtype=np.int32)
    perms = np.stack([plain if h.perm is None else h.perm for h in hosts]).reshape(e, -1, rows)
    if np.any(perms != perms[:, :1]):
        return "an expert's gate and up projections have different row orders (g_idx)"
    return np.ascontiguousarray(perms[:, 0])


def _expert_groups(a: np.ndarray, e: int, out: list[int], grouped: bool) -> np.ndarray:
    """Per-expert [G, out] scales (or zeros), stacked [E * names an expert, G, out], ->
    [E, G, *out] (`grouped`) or per channel [E, *out]."""
    groups = a.shape[1]
    a = np.moveaxis(a.reshape(e, -1, groups, out[-1]), 2, 1).reshape(e, groups, *out)
    return a if grouped else a[:, 0]


def _kernel_groups(p: ParamSpec, q: QuantConfig, placer: Placer) -> bool:
    """Whether an expert stack's K groups (block-wise fp8, grouped int) suit the expert
    kernels: a multiple of 16 rows (their smallest K step; int4: nibble blocks of >= 16 + 16
    rows, a K step each) and, where tensor parallelism splits K (a down stack without
    expert parallelism), whole on every shard (int4's one group too: its scales are
    grouped)."""
    groups, k = _k_groups(p, q), p.shape[1]
    int4 = q.weight_kind == "int4"
    sharding = placer.sharding(p)  # of the float stack [E, K, *out]
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    shards = placer.mesh.shape[spec[1]] if len(spec) > 1 and spec[1] is not None else 1
    if q.desc_act and shards > 1:  # a shard would need x's rows from the others
        return False
    if groups == 1 and not int4:
        return True
    rows = k // groups
    return (rows % 16 == 0 and groups % shards == 0
            and (not int4 or int4_span(k, rows) >= 16))


def _dequantized_experts(get: Callable[[str], Any], p: ParamSpec, q: QuantConfig) -> np.ndarray:
    """An int-packed expert stack read expert by expert with its format's reader, each
    dequantized (groups, zeros, act-order) and stacked into the float [E, K, *out]."""
    e, rows, *out = p.shape
    weights = []
    for name in p.hf_names:  # each expert's Linear, in the stack's order (g0, u0, g1, ...)
        prefix = name.removesuffix(".weight")
        try:
            host = READERS[q.method].read(get, prefix, (rows, out[-1]), q)
        except KeyError as missing:
            raise ModelLoadError(f"checkpoint is missing tensor {missing.args[0]!r}: a "
                                 f"{q.method} expert needs "
                                 f"{', '.join(f'{prefix}.{n}' for n in _parts(q))}") from None
        parts = {k: jnp.asarray(v) for k, v in host.parts().items()}
        qw = QuantizedWeight(**parts, kind=host.kind, zero_point=host.zero_point)
        weights.append(np.asarray(dequantize(qw, jnp.float32)))  # [in, out]
    stack = np.stack(weights).reshape(e, -1, rows, out[-1])  # [E, names an expert, K, out]
    return np.moveaxis(stack, 2, 1).reshape(p.shape)  # [E, K, *out]


def _part_specs(p: ParamSpec, placer: Placer, groups: int | None = None,
                values: tuple[int, ...] | None = None) -> tuple[ParamSpec, ParamSpec]:
    """ParamSpecs of an expert stack's values [E, *out, K] (or `values`' shape: int4's
    [E, *out, K / 2]) and scales [E, *out] (`groups` G: [E, G, *out]), placed along the
    float stack's axes."""
    axes = placer.axes(p)
    e, rows, *out = p.shape
    scales = (e, *out) if groups is None else (e, groups, *out)
    values = values or (e, *out, rows)
    return (ParamSpec((*p.path, "values"), values, axes=value_axes(axes)),
            ParamSpec((*p.path, "scales"), scales, dtype="float32",
                      axes=scale_axes(axes, groups is not None)))


def _place_experts(qe: QuantizedExperts, p: ParamSpec, placer: Placer) -> QuantizedExperts:
    """Values, scales (and int4 zeros) split along the float stack's axes."""
    if placer.mesh is None:
        return qe
    value_spec, scale_spec = _part_specs(p, placer, qe.k_groups if qe.grouped else None,
                                         qe.values.shape)
    scales = placer.sharding(scale_spec)
    return dataclasses.replace(
        qe, values=jax.device_put(qe.values, placer.sharding(value_spec)),
        scales=jax.device_put(qe.scales, scales),
        zeros=None if qe.zeros is None else jax.device_put(qe.zeros, scales))


def _check_whole_groups(p: ParamSpec, placer: Placer, groups: int) -> None:
    """A row-parallel split (input dim over tp) must not cut a group in two."""
    in_axis = placer.axes(p)[0]
    if placer.mesh is None or groups <= 1 or LOGICAL_TO_MESH.get(in_axis) != "tp":
        return
    tp = placer.mesh.shape["tp"]
    if groups % tp:
        raise ModelLoadError(
            f"{'/'.join(map(str, p.path))}: {groups} quantization groups along the input dim "
            f"cannot be split whole over tensor_parallel_size {tp}; use a tensor_parallel_size "
            f"that divides {groups}")


def place_host(host: HostQuant, p: ParamSpec, placer: Placer) -> QuantizedWeight:
    """Each canonical part onto the device(s), sharded along with its weight."""
    groups = host.scales.shape[0]
    _check_whole_groups(p, placer, groups)
    parts = {}
    for name, arr in host.parts().items():
        if name == "packed" and host.kind in OUT_MAJOR and placer.mesh is not None:
            parts[name] = _place_out_major(arr, p, placer, host.kind)
            continue
        axes = component_axes(placer.axes(p), name, groups, host.kind)
        parts[name] = placer.from_host(ParamSpec((*p.path, name), arr.shape, axes=axes), arr)
    return QuantizedWeight(**parts, kind=host.kind, zero_point=host.zero_point,
                           kernel=placer.mesh is None)


def _place_out_major(packed: Any, p: ParamSpec, placer: Placer, kind: str) -> jax.Array:
    """int4 / fp8 values [out, in (/ 2)] onto a mesh: placed as the [in, out] weight they are
    (kv heads duplicated along out, as the placer does for every weight), then turned back
    on the devices, each keeping its own slice."""
    stored = packed.T  # [in (/ 2), out]
    w = placer.from_host(ParamSpec((*p.path, "packed"), stored.shape, axes=placer.axes(p)),
                         stored)
    axes = component_axes(placer.axes(p), "packed", 1, kind)
    return _transpose_into(NamedSharding(placer.mesh, spec_for(axes, w.shape[::-1],
                                                               placer.mesh)))(w)


@lru_cache(maxsize=64)
def _transpose_into(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    """A jitted 2-D transpose landing in `sharding`: one compile per (shape, sharding)."""
    return jax.jit(jnp.transpose, out_shardings=sharding)


def quantize_on_device(w: jax.Array, p: ParamSpec, q: QuantConfig,
                       placer: Placer) -> QuantizedWeight | QuantizedExperts:
    """A float weight already placed -> the method's quantized form, parts placed like it
    (per output channel for int8 / fp8; symmetric int4 in groups for dummy 4-bit weights;
    an expert stack per expert and output channel, and K group as a checkpoint's would
    load: dummy block-wise fp8 or GPTQ-int4 experts, unless its groups would not suit the
    kernels, whose experts then stay float as the checkpoint's would load dequantized)."""
    if p.path[-1] in ROUTED_EXPERT_PARAMS:
        if q.from_checkpoint and not _kernel_groups(p, q, placer):
            return w
        group = p.shape[1] // _k_groups(p, q) if q.from_checkpoint else None
        return _place_experts(quantize_experts(w, q.weight_kind, group), p, placer)
    rows = w.shape[0]
    if q.weight_kind == "int4":
        group = rows if q.group_size == -1 else q.group_size
        _check_whole_groups(p, placer, rows // group)
        qw = quantize_int4(w, group)
    else:
        qw = quantize_per_channel(w, q.weight_kind)
    if placer.mesh is None:
        return qw
    groups = qw.scales.shape[0]
    moved = {}
    for name in ("packed", "scales", "zeros"):
        arr = getattr(qw, name)
        if arr is not None:
            axes = component_axes(placer.axes(p), name, groups, qw.kind)
            moved[name] = jax.device_put(arr, NamedSharding(placer.mesh,
                                                            spec_for(axes, arr.shape,
                                                                     placer.mesh)))
    return QuantizedWeight(**moved, kind=qw.kind, zero_point=qw.zero_point, kernel=False)
