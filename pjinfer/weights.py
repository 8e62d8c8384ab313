"""The one loader: checkpoint tensors -> the architecture's `ParamSpec`s -> device arrays.

Formats: safetensors (single or sharded files), orbax (a `pjinfer convert` folder), dummy
(random weights of the right shapes, no files), auto (orbax when the folder has the marker, else
safetensors). The same path serves one device (mesh None) and a tp mesh, where every tensor goes
straight into its shards (pjinfer.sharding.placement). Files are memory-mapped and each tensor
goes to the device on its own, so host memory never holds an extra copy of the whole model;
dtype casts happen on the device. Each param gets its spec's dtype when it declares one
(quantized weights, their scales), else the model dtype.
"""

from __future__ import annotations

import json
import os
import struct
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh

from pjinfer.config import ModelConfig, resolve_dtype
from pjinfer.errors import ModelLoadError
from pjinfer.models.spec import ParamSpec, build_tree
from pjinfer.quantization.config import QuantConfig
from pjinfer.quantization.gguf_file import GGUFIndex, gguf_path
from pjinfer.quantization.loader import (
    load_quantized,
    loads_quantized,
    quantizable,
    quantizable_experts,
    quantize_on_device,
)
from pjinfer.sharding.checkpoint import is_orbax_checkpoint, restore_params
from pjinfer.sharding.mesh import make_mesh
from pjinfer.sharding.placement import Placer, shard_params
from pjinfer.sharding.rules import expert_layout

# auto = orbax when the folder holds a `pjinfer convert` checkpoint, else safetensors
LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32, "I8": np.int8,
              "U8": np.uint8, "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
              "F8_E5M2": ml_dtypes.float8_e5m2}
Params = dict[str, Any]
_READ_AHEAD = 8  # tensors read in parallel ahead of the one being placed


class SafetensorsIndex:
    """Tensor name -> zero-copy memmap view across one or several .safetensors files."""

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._entries: dict[str, tuple[Path, dict[str, Any], int]] = {}
        self._maps: dict[Path, np.memmap] = {}
        for path in self._files():
            self._read_header(path)

    def _files(self) -> list[Path]:
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return sorted({self.model_dir / f for f in weight_map.values()})
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"no *.safetensors files in {self.model_dir}; pjinfer loads "
                                 "safetensors checkpoints (or use load_format='dummy')")
        return files

    def _read_header(self, path: Path) -> None:
        if not path.is_file():
            raise ModelLoadError(f"checkpoint shard {path} listed in the index is missing")
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        for name, info in header.items():
            self._entries[name] = (path, info, 8 + size)

    def _key(self, name: str) -> str:
        """`name`, or the same without its first component when only that is stored: a base
        model saved without its head (transformers' base_model_prefix; e.g. the Hub's GPT-2
        says `h.0.attn.c_attn.weight` where GPT2LMHeadModel says `transformer.h.0...`)."""
        if name in self._entries or "." not in name:
            return name
        bare = name.split(".", 1)[1]
        return bare if bare in self._entries else name

    def __contains__(self, name: str) -> bool:
        return self._key(name) in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def _entry(self, name: str) -> tuple[Path, dict[str, Any], int, int]:
        path, info, data_start = self._entries[self._key(name)]
        if info["dtype"] not in _ST_DTYPES:
            raise ModelLoadError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        return path, info, data_start + begin, data_start + end

    def get(self, name: str) -> np.ndarray:
        """A zero-copy memmap view: pages are read when first touched."""
        path, info, begin, end = self._entry(name)
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path][begin:end].view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor copied into host memory with large `preadv` calls, which release the GIL
        (a memmap copy faults pages in one at a time): parallel reads keep the disk busy."""
        path, info, begin, end = self._entry(name)
        out = np.empty(end - begin, np.uint8)
        view, done = memoryview(out), 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while done < len(out):
                n = os.preadv(fd, [view[done:]], begin + done)
                if n == 0:
                    raise ModelLoadError(f"checkpoint shard {path} is truncated at tensor "
                                         f"{name!r}; re-download it")
                done += n
        finally:
            os.close(fd)
        return out.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def read_param(index: SafetensorsIndex, p: ParamSpec, cfg: ModelConfig, *,
               copy: bool = False) -> np.ndarray:
    """The host tensor of `p`, shape-checked: read into memory (`copy`) or a memmap view
    (unless its transform copies)."""
    if not p.hf_names:
        raise ModelLoadError(f"param {p.path} of {cfg.architecture} names no checkpoint tensor")
    names, transform = p.hf_names, p.transform
    missing = [name for name in names if name not in index]
    if missing and p.fallback and all(name in index for name in p.fallback[0]):
        (names, transform), missing = p.fallback, []
    if missing:
        packed = [f"{missing[0].removesuffix('.weight')}.{part}"
                  for part in ("qweight", "weight_packed")]
        stored = next((n for n in packed if n in index), None)
        if stored is not None:  # e.g. Phi-3's fused qkv_proj in a GPTQ / AWQ checkpoint
            raise ModelLoadError(f"tensor {stored!r} is stored int-packed, which pjinfer reads "
                                 f"only for unfused Linear weights; {cfg.architecture} slices "
                                 f"{missing[0]!r} at load: use a float or fp8 checkpoint")
        raise ModelLoadError(_missing(index, p, missing[0], cfg.architecture))
    fetch = index.read if copy else index.get
    tensors = [_scaled(index, name, fetch(name)) for name in names]
    try:
        host = transform(*tensors) if transform else p.from_checkpoint(tensors)
    except ValueError as e:  # e.g. experts of different shapes cannot be stacked
        shapes = ", ".join(f"{n!r} {tuple(t.shape)}" for n, t in zip(names[:4], tensors[:4],
                                                                  strict=True))
        raise ModelLoadError(f"tensors {shapes} do not combine into {p.path} of shape "
                             f"{p.shape}: {e}") from None
    if tuple(host.shape) != p.shape:
        shown = ", ".join(map(repr, names[:2])) + (" ..." if len(names) > 2 else "")
        raise ModelLoadError(f"tensor {shown} has shape "
                             f"{tuple(host.shape)} (after its transform), expected {p.shape} "
                             "from config.json")
    return host


def _missing(index: Any, p: ParamSpec, name: str, architecture: str) -> str:
    """What a checkpoint lacks for `p`: its name, the fallback's, and a GGUF file's own."""
    other = f" (or {', '.join(map(repr, p.fallback[0]))})" if p.fallback else ""
    stored_names = getattr(index, "stored_names", None)
    if stored_names is not None:  # GGUF: the tensors llama.cpp names
        found = (p.fallback and stored_names(p.fallback[0][0])) or stored_names(name)
        other += f" (in the file: {', '.join(map(repr, found))})" if found else ""
    return (f"checkpoint in {index.model_dir} is missing tensor {name!r}{other} (needed for "
            f"{architecture} with this {'file' if stored_names else 'config.json'})")


def _scaled(index: SafetensorsIndex, name: str, tensor: np.ndarray) -> np.ndarray:
    """A tensor read as a float param: an fp8 weight that has a `weight_scale` beside it
    (an fp8 checkpoint's tensor that pjinfer does not keep quantized, e.g. Phi-3's fused
    qkv_proj, sliced at load) is dequantized, value x scale per tensor or per output row (or
    per block: `weight_scale_inv`), in float32; taken as stored it would be off by its
    scale."""
    if not tensor.dtype.name.startswith("float8") or not name.endswith(".weight"):
        return tensor
    prefix = name.removesuffix(".weight")
    if f"{prefix}.weight_scale_inv" in index:
        return tensor.astype(np.float32) * _block_scales(
            f"{prefix}.weight_scale_inv", index.get(f"{prefix}.weight_scale_inv"), tensor.shape)
    if f"{prefix}.weight_scale" not in index:
        return tensor
    scale = np.asarray(index.get(f"{prefix}.weight_scale"), np.float32)
    if scale.ndim == 2 and scale.size > 1 and scale.shape != (tensor.shape[0], 1):  # blocks
        # (compressed-tensors' block strategy names its block scales weight_scale)
        return tensor.astype(np.float32) * _block_scales(f"{prefix}.weight_scale", scale,
                                                         tensor.shape)
    if scale.size not in (1, tensor.shape[0]):
        raise ModelLoadError(f"tensor {prefix}.weight_scale has shape {scale.shape}: expected "
                             f"one scale per tensor or one per output row ({tensor.shape[0]})")
    rows = scale.reshape(-1, *([1] * (tensor.ndim - 1))) if scale.size > 1 else scale.reshape(())
    return tensor.astype(np.float32) * rows


def _block_scales(name: str, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Block scales [cdiv(out, bo), cdiv(in, bi)] spread over a [out, in] weight; the blocks
    (powers of two, 128 in every checkpoint seen) are read back from the two shapes."""
    scale = np.asarray(scale, np.float32)
    ok = scale.ndim == 2 and len(shape) == 2
    blocks = [1 << max(0, -(-n // s) - 1).bit_length()
              for n, s in zip(shape, scale.shape, strict=True)] if ok else []
    if not ok or any(-(-n // b) != s for n, b, s in zip(shape, blocks, scale.shape,
                                                        strict=True)):
        raise ModelLoadError(f"tensor {name!r} has shape {scale.shape}: not block scales of "
                             f"power-of-two blocks over a {tuple(shape)} weight")
    spread = np.repeat(np.repeat(scale, blocks[0], axis=0), blocks[1], axis=1)
    return spread[:shape[0], :shape[1]]


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")


def load_params(model_dir: str | Path | None, cfg: ModelConfig, *, dtype: str = "auto",
                load_format: str = "auto", seed: int = 0, mesh: Mesh | None = None,
                canonical: bool = False, quantization: QuantConfig | None = None) -> Params:
    """Every parameter of `cfg`, on the default device (mesh None) or in its shards of `mesh`.

    `canonical` keeps the checkpoint's kv-head layout on the mesh (for `pjinfer convert`);
    `seed` picks the dummy weights, which need no `model_dir`; `quantization` makes the
    layers' Linear weights `QuantizedWeight`s (pjinfer.quantization).
    """
    check_load_format(load_format)
    model_dtype = resolve_dtype(dtype, cfg)  # a bad dtype fails before any file is read
    placer = Placer(cfg, mesh, canonical=canonical)
    if load_format == "dummy":
        return _dummy(cfg, placer, model_dtype, seed, quantization)
    if load_format == "orbax" or (load_format == "auto" and is_orbax_checkpoint(model_dir)):
        if quantization is not None:
            raise ModelLoadError("quantization is not supported with orbax checkpoints; load "
                                 "the safetensors checkpoint")
        return restore_params(model_dir, cfg, placer, dtype=dtype)
    gguf = gguf_path(model_dir)
    index = GGUFIndex(gguf) if gguf is not None else SafetensorsIndex(model_dir)
    return _safetensors(index, cfg, placer, model_dtype, quantization)


def _safetensors(index: SafetensorsIndex | GGUFIndex, cfg: ModelConfig, placer: Placer,
                 model_dtype: Any, quantization: QuantConfig | None = None) -> Params:
    specs = cfg.param_specs()
    quantized = {p.path for p in specs if loads_quantized(p, quantization)}
    floats = _read_ahead(index, [p for p in specs if p.path not in quantized], cfg)

    def load_float(p: ParamSpec, host: np.ndarray | None = None) -> jax.Array:
        host = read_param(index, p, cfg) if host is None else host
        return placer.from_host(p, host).astype(p.target_dtype(model_dtype))

    def load(p: ParamSpec) -> Any:
        if p.path in quantized:
            return load_quantized(index.get, index.__contains__, p, quantization, placer,
                                  load_float)
        return load_float(p, next(floats))
    return build_tree((p.path, load(p)) for p in specs)


def _read_ahead(index: SafetensorsIndex | GGUFIndex, specs: list[ParamSpec],
                cfg: ModelConfig) -> Iterator[np.ndarray]:
    """Host tensors in spec order; the next `_READ_AHEAD` are read by a thread pool while the
    current one goes to the device, so disk reads overlap each other and the transfers. Host
    memory holds at most that many tensors."""
    with ThreadPoolExecutor(_READ_AHEAD) as pool:
        pending: deque[Future] = deque()
        for p in specs:
            pending.append(pool.submit(read_param, index, p, cfg, copy=True))
            if len(pending) > _READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _dummy(cfg: ModelConfig, placer: Placer, model_dtype: Any, seed: int,
           quantization: QuantConfig | None = None) -> Params:
    """Random weights (see `ParamSpec.init`), one key per param in spec order; quantized
    from those float draws when `quantization` is given."""
    key = jax.random.key(seed)

    def make(n: int, p: ParamSpec) -> Any:
        w = placer.generate(p, p.target_dtype(model_dtype), jax.random.fold_in(key, n))
        if quantization is not None and (quantizable(p)
                                         or quantizable_experts(p, quantization)):
            return quantize_on_device(w, p, quantization, placer)
        return w
    return build_tree((p.path, make(n, p)) for n, p in enumerate(cfg.param_specs()))


def read_model_config(model_dir: str | Path, hf_config_path: str | Path | None = None
                      ) -> ModelConfig:
    """config.json of a model folder (or of `hf_config_path`), or the metadata of a GGUF
    file."""
    if hf_config_path is not None:
        if not (Path(hf_config_path) / "config.json").is_file():
            raise ModelLoadError(f"hf_config_path {str(hf_config_path)!r} has no config.json: "
                                 "pass the folder that holds the model's config.json")
        return ModelConfig.from_pretrained(hf_config_path)
    gguf = gguf_path(model_dir)
    if gguf is None:
        return ModelConfig.from_pretrained(model_dir)
    try:
        return ModelConfig.from_hf_dict(GGUFIndex(gguf).hf_config())
    except ValueError as e:
        raise ModelLoadError(f"{gguf}: {e}") from None


def load_engine_model(model_dir: str | Path, *, tensor_parallel_size: int = 1,
                      data_parallel_size: int = 1, dtype: str = "auto",
                      load_format: str = "auto", seed: int = 0, params: Params | None = None,
                      enable_expert_parallel: bool = False, devices: list | None = None,
                      quantization: QuantConfig | None = None,
                      hf_config_path: str | Path | None = None,
                      ) -> tuple[ModelConfig, Params, Mesh | None]:
    """(config, params, mesh) for an engine: a ("dp", "tp") mesh when either size is > 1 (None
    otherwise, unless `devices` pins the engine to some: a data-parallel replica), validated
    against the model before any weight is read.
    `enable_expert_parallel` places a MoE model's whole experts on the tp axis (the returned
    config says so), instead of splitting every expert. `hf_config_path`: a folder whose
    config.json describes the model instead of the model folder's (or GGUF metadata).

    Given `params` (unsharded, checkpoint layout) only config.json is read; they are returned as
    they are without a mesh, else placed onto it.
    """
    check_load_format(load_format)
    cfg = read_model_config(model_dir, hf_config_path)
    mesh = None
    if tensor_parallel_size > 1 or data_parallel_size > 1 or devices is not None:
        mesh = make_mesh(tensor_parallel_size, data_parallel_size, cfg=cfg, devices=devices)
    cfg = expert_layout(cfg, tensor_parallel_size, enable_expert_parallel)
    if params is not None:
        return cfg, (params if mesh is None else shard_params(params, cfg, mesh)), mesh
    return cfg, load_params(model_dir, cfg, dtype=dtype, load_format=load_format, seed=seed,
                            mesh=mesh, quantization=quantization), mesh


def load_model(model_dir: str | Path, *, dtype: str = "auto", load_format: str = "auto",
               seed: int = 0) -> tuple[ModelConfig, Params]:
    """Config and params of a local HF model folder on one device; `dummy` makes random ones."""
    cfg, params, _ = load_engine_model(model_dir, dtype=dtype, load_format=load_format, seed=seed)
    return cfg, params
