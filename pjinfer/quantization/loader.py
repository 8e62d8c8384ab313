"""Quantized weights into their place: read from a checkpoint, quantized at load, or dummy.

Which params are quantized: the decoder layers' Linear weights (`*_proj`); embeddings, norms,
biases and the head stay in the model dtype. Pre-quantized formats replace HF Linear weights
(one `.weight`, transposed to input-major except fp8's, which stay [out, in]); a checkpoint
may leave some of them float (an `ignore` list, `modules_to_not_convert`): a layer is read as
quantized when its format's marker tensor is there. Every part is placed with its weight's
logical axes (`component_axes`), so a tp mesh splits scales and zeros with their weight;
row-parallel splits must keep whole groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pjinfer.errors import ModelLoadError
from pjinfer.models.spec import ParamSpec, transpose
from pjinfer.quantization import awq, compressed_tensors, fp8, gguf_blocks, gptq
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.host import HostQuant
from pjinfer.quantization.weight import (
    OUT_MAJOR,
    QuantizedWeight,
    component_axes,
    quantize_int4,
    quantize_per_channel,
)
from pjinfer.sharding.placement import Placer
from pjinfer.sharding.rules import LOGICAL_TO_MESH, spec_for

READERS: dict[str, ModuleType] = {"gptq": gptq, "awq": awq, "fp8": fp8,
                                  "compressed-tensors": compressed_tensors, "gguf": gguf_blocks}


def quantizable(p: ParamSpec) -> bool:
    """A decoder layer's Linear weight (any architecture: on-the-fly methods quantize it)."""
    return p.path[0] == "layers" and str(p.path[-1]).endswith("_proj") and len(p.shape) == 2


def device_bytes(p: ParamSpec, q: QuantConfig | None, itemsize: int) -> int:
    """Bytes a param will take on the device, from its spec alone (memory planning before a
    load): a Linear weight the quantization replaces at its bits plus float32 scales (and
    zeros, and an act-order permutation) per group; anything else at `itemsize` (the model
    dtype's). GGUF tensors, whose types only the file knows, count as float."""
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
    return "weight_scale"


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
    prefix = p.hf_names[0].removesuffix(".weight")
    if not _stored_as_linear(p) or not has(f"{prefix}.{_marker(q)}"):
        return load_float(p)
    try:
        host = READERS[q.method].read(get, prefix, p.shape, q)
    except KeyError as e:
        raise ModelLoadError(f"checkpoint is missing tensor {e.args[0]!r}: a {q.method} layer "
                             f"needs {', '.join(f'{prefix}.{n}' for n in _parts(q))}") from None
    return place_host(host, p, placer)


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
                       placer: Placer) -> QuantizedWeight:
    """A float weight already placed -> the method's quantized form, parts placed like it
    (per output channel for int8 / fp8; symmetric int4 in groups for dummy 4-bit weights)."""
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
