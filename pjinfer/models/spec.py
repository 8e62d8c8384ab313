"""What an architecture declares so the rest of pjinfer needs no knowledge of it.

A `ModelSpec` bundles the pure model functions with the data the generic machinery reads:
config parsing (pjinfer.config), the parameter list with its checkpoint mapping (pjinfer.weights),
partition rules (pjinfer.sharding.rules) and the rotary setup (the step). Nothing here imports
pjinfer's config (nor jax), so pjinfer.config may look specs up without an import circle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

ParamPath = tuple[str | int, ...]  # ("layers", 3, "q_proj"): dict keys and list indices
Axes = tuple[str | None, ...]  # one logical axis name (or None) per dim
INITS = ("normal", "ones", "zeros")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter: where it sits, its shape and dtype, and how the checkpoint fills it.

    `dtype` None means the model dtype (the engine's `dtype`); an explicit dtype ("int8",
    "float8_e4m3fn", a scale's "float32") is kept whatever the model dtype, so quantized tensors
    and their scales are loaded as they are. `transform(*tensors)` turns the checkpoint tensors
    named by `hf_names` (in that order) into this parameter: a transpose, a fuse, a stack. It
    runs on host arrays; a transpose is a free view of the memory map, a fuse or stack copies.
    `init`/`init_scale` say how `load_format="dummy"` draws it (scale None: 1/sqrt(shape[0])).
    `fallback` (hf_names, transform) is a second checkpoint layout, read when the first's
    tensors are absent (per-expert MoE weights, or the fused 3-D ones of transformers 5).
    """

    path: ParamPath
    shape: tuple[int, ...]
    dtype: str | None = None
    hf_names: tuple[str, ...] = ()
    transform: Callable[..., np.ndarray] | None = None
    init: str = "normal"
    init_scale: float | None = None
    fallback: tuple[tuple[str, ...], Callable[..., np.ndarray]] | None = None

    def __post_init__(self) -> None:
        if self.init not in INITS:
            raise ValueError(f"ParamSpec {self.path}: init must be one of {INITS}")

    def target_dtype(self, model_dtype: Any) -> Any:
        """The dtype the loaded parameter has: its own when declared, else the model's."""
        return self.dtype if self.dtype is not None else model_dtype

    def from_checkpoint(self, tensors: list[np.ndarray]) -> np.ndarray:
        if self.transform is not None:
            return self.transform(*tensors)
        if len(tensors) != 1:
            raise ValueError(f"ParamSpec {self.path} reads {len(tensors)} tensors: give it a "
                             "transform that combines them")
        return tensors[0]


def no_config_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Default `parse_config`: the architecture adds nothing to the generic fields."""
    return {}


def same_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Default `normalize_config`: config.json already uses the generic (Llama) spelling."""
    return raw


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The pure functions and declarations that make up one architecture.

    forward(params, cfg, token_ids [T], positions [T], kv_caches, metadata, *, attention,
            rotary) -> (hidden [T, D], kv_caches)
    compute_logits(params, hidden [N, D]) -> logits [N, V] float32
    param_specs(cfg) -> list[ParamSpec]
    partition_rules: (regex on "layers/3/q_proj", logical axes) pairs, first match wins; the
        logical names are those of pjinfer.sharding.rules.LOGICAL_TO_MESH. A param whose last
        axis is "kv_heads" has kv heads x head_dim there, duplicated when tp > kv heads.
    rotary(cfg, max_len | None) -> the `rotary` argument of forward (e.g. a `layers.Rope`);
        max_len is the longest sequence the caller serves (the engine's max_model_len)
    parse_config(hf config.json dict) -> ModelConfig fields specific to the architecture
    normalize_config(hf config.json dict) -> the same with the generic field names (hidden_size,
        num_attention_heads ...), applied before anything is read (GPT-2 says n_embd, n_head)
    """

    forward: Callable[..., tuple[Any, list]]
    compute_logits: Callable[..., Any]
    param_specs: Callable[..., list[ParamSpec]]
    partition_rules: tuple[tuple[str, Axes], ...]
    rotary: Callable[..., Any]
    parse_config: Callable[[dict[str, Any]], dict[str, Any]] = no_config_fields
    normalize_config: Callable[[dict[str, Any]], dict[str, Any]] = same_config


# ---- checkpoint transforms ------------------------------------------------------------------
def transpose(w: np.ndarray) -> np.ndarray:
    """HF Linear weight [out, in] -> input-major [in, out] (a view, no copy)."""
    return w.T


def _fuse(*tensors: np.ndarray, axis: int, pre: Callable | None) -> np.ndarray:
    return np.concatenate([pre(t) if pre else t for t in tensors], axis=axis)


def fuse(axis: int = -1, *, pre: Callable[[np.ndarray], np.ndarray] | None = None) -> Callable:
    """Concatenate several tensors (e.g. q, k, v into one qkv) after `pre` (e.g. transpose)."""
    return partial(_fuse, axis=axis, pre=pre)


def _part(t: np.ndarray, *, start: int, stop: int, pre: Callable | None) -> np.ndarray:
    t = pre(t) if pre else t
    return t[..., start:stop]


def part(start: int, stop: int, *, pre: Callable[[np.ndarray], np.ndarray] | None = None
         ) -> Callable:
    """Columns start:stop of one fused tensor after `pre` (e.g. q out of a fused qkv): a view
    of the memory map, so each split param is sharded on its own like an unfused one."""
    return partial(_part, start=start, stop=stop, pre=pre)


def _stack(*tensors: np.ndarray, axis: int, pre: Callable | None) -> np.ndarray:
    return np.stack([pre(t) if pre else t for t in tensors], axis=axis)


def stack(axis: int = 0, *, pre: Callable[[np.ndarray], np.ndarray] | None = None) -> Callable:
    """Stack same-shaped tensors on a new axis (e.g. per-expert weights into [E, ...])."""
    return partial(_stack, axis=axis, pre=pre)


# ---- param pytrees ---------------------------------------------------------------------------
def get_path(tree: Any, path: ParamPath) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _child(node: Any, key: str | int, next_key: str | int) -> Any:
    empty: Any = [] if isinstance(next_key, int) else {}
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = empty
        return node[key]
    return node.setdefault(key, empty)


def build_tree(items: Iterable[tuple[ParamPath, Any]]) -> dict:
    """Nested dicts (str keys) and lists (int keys) holding each value at its path."""
    root: dict = {}
    for path, value in items:
        node = root
        for key, next_key in zip(path[:-1], path[1:], strict=True):
            node = _child(node, key, next_key)
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


def shape_tree(specs: Iterable[ParamSpec]) -> dict:
    """The param pytree with each parameter's shape tuple as its leaf."""
    return build_tree((p.path, p.shape) for p in specs)
