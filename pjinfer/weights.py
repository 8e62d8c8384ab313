"""Load a Hugging Face checkpoint (single or sharded safetensors) into pjinfer's param pytree.

Files are memory-mapped and each tensor goes to the device on its own, so host memory never holds
an extra copy of the whole model; transposes and dtype casts happen on the device.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pjinfer.config import ModelConfig, normalize_dtype
from pjinfer.errors import ModelLoadError
from pjinfer.models.registry import get_model_spec

# auto = orbax when the folder holds a `pjinfer convert` checkpoint, else safetensors
LOAD_FORMATS = ("auto", "safetensors", "dummy", "orbax")
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
              "F64": np.float64, "I64": np.int64, "I32": np.int32, "I8": np.int8,
              "U8": np.uint8, "BOOL": np.bool_}


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

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        path, info, data_start = self._entries[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ModelLoadError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = info["data_offsets"]
        raw = self._maps[path][data_start + begin:data_start + end]
        return raw.view(_ST_DTYPES[info["dtype"]]).reshape(info["shape"])


def resolve_dtype(dtype: str, cfg: ModelConfig) -> jnp.dtype:
    """'auto' takes the checkpoint's `torch_dtype`/`dtype`; otherwise float32/bfloat16/float16."""
    name = cfg.dtype if dtype == "auto" else normalize_dtype(dtype)
    return jnp.dtype(name)


def set_param(tree: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def empty_param_tree(shapes: Any) -> Any:
    """Copy the nested dict/list structure of `param_shapes` so leaves can be filled in."""
    if isinstance(shapes, dict):
        return {k: empty_param_tree(v) for k, v in shapes.items()}
    if isinstance(shapes, list):
        return [empty_param_tree(v) for v in shapes]
    return None


def walk_param_shapes(cfg: ModelConfig) -> Iterator[tuple[tuple, str, bool, tuple[int, ...]]]:
    spec = get_model_spec(cfg.architecture)
    shapes = spec.param_shapes(cfg)
    for path, hf_name, transpose in spec.hf_weight_names(cfg):
        shape = shapes
        for key in path:
            shape = shape[key]
        yield path, hf_name, transpose, tuple(shape)


def load_params(model_dir: str | Path, cfg: ModelConfig, *, dtype: str = "auto",
                place: Callable[[tuple, np.ndarray], jax.Array] | None = None) -> dict:
    """Read every parameter, checking names and shapes against the checkpoint.

    `place(path, host_array)` puts one tensor on its device(s); the sharded loader passes one
    that transfers only each device's slice.
    """
    target = resolve_dtype(dtype, cfg)
    index = SafetensorsIndex(model_dir)
    params = empty_param_tree(get_model_spec(cfg.architecture).param_shapes(cfg))
    place = place or (lambda _path, host: jnp.asarray(host))
    for path, hf_name, transpose, shape in walk_param_shapes(cfg):
        if hf_name not in index:
            raise ModelLoadError(f"checkpoint in {model_dir} is missing tensor {hf_name!r} "
                                 f"(needed for {cfg.architecture} with this config.json)")
        host = index.get(hf_name)
        host = host.T if transpose else host
        if tuple(host.shape) != shape:
            raise ModelLoadError(f"tensor {hf_name!r} has shape {tuple(host.shape)} (after "
                                 f"transpose={transpose}), expected {shape} from config.json")
        set_param(params, path, place(path, host).astype(target))
    return params


def dummy_params(cfg: ModelConfig, *, dtype: str = "auto", seed: int = 0) -> dict:
    """Random weights of the right shapes made on the device (benchmarks without files).

    Scaled like a trained model (norms 1, projections ~1/sqrt(fan_in)) so activations stay finite.
    """
    target = resolve_dtype(dtype, cfg)
    key = jax.random.key(seed)
    params = empty_param_tree(get_model_spec(cfg.architecture).param_shapes(cfg))
    for n, (path, _, _, shape) in enumerate(walk_param_shapes(cfg)):
        set_param(params, path, dummy_tensor(jax.random.fold_in(key, n), path[-1], shape, target))
    return params


def dummy_tensor(key: jax.Array, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.endswith("bias"):
        return jnp.zeros(shape, dtype)
    scale = 0.02 if name == "embed" else shape[0] ** -0.5
    return _random_normal(key, shape, dtype, scale)


@partial(jax.jit, static_argnames=("shape", "dtype", "scale"))
def _random_normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float) -> jax.Array:
    """Jitted so the float32 draw fuses with the cast instead of landing in memory first."""
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def load_model(model_dir: str | Path, *, dtype: str = "auto", load_format: str = "auto",
               seed: int = 0) -> tuple[ModelConfig, dict]:
    """Config and params of a local HF model folder; `dummy` makes random weights instead."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, "
                         f"got {load_format!r}")
    cfg = ModelConfig.from_pretrained(model_dir)
    get_model_spec(cfg.architecture)
    if load_format == "dummy":
        return cfg, dummy_params(cfg, dtype=dtype, seed=seed)
    # ---- orbax checkpoints (written by `pjinfer convert`; see pjinfer.sharding.checkpoint) ----
    from pjinfer.sharding.checkpoint import is_orbax_checkpoint, restore_params

    if load_format == "orbax" or (load_format == "auto" and is_orbax_checkpoint(model_dir)):
        return cfg, restore_params(model_dir, cfg, dtype=dtype)
    return cfg, load_params(model_dir, cfg, dtype=dtype)
