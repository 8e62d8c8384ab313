"""orbax checkpoints of the param pytree, restored straight onto the mesh.

Folder layout written by `pjinfer convert` (a loadable model folder):
  config.json, tokenizer files ...   copied from the HF folder
  params/                            orbax StandardCheckpointer tree (canonical layout)
  pjinfer_orbax.json                 the marker: {"format": "orbax", "params": "params",
                                     "dtype": "bfloat16"}; written last, so a folder with it
                                     holds a complete checkpoint
The checkpoint stores the canonical layout (kv heads not duplicated), so one checkpoint serves
any tensor_parallel_size; duplication for tp > KVH is applied on the device after restore.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, SingleDeviceSharding

from pjinfer.config import ModelConfig
from pjinfer.errors import ModelLoadError
from pjinfer.models.registry import get_model_spec
from pjinfer.weights import empty_param_tree, resolve_dtype, set_param, walk_param_shapes

from .loading import expand_kv_fn, get_path
from .mesh import tp_size
from .rules import (
    KV_PARAMS,
    canonical_sharding,
    kv_head_replicas,
    layout_config,
    param_shardings,
)

MARKER = "pjinfer_orbax.json"
PARAMS_DIR = "params"


def is_orbax_checkpoint(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def save_params(params: dict, model_dir: str | Path) -> Path:
    """Write `params` (any sharding; each process writes its shards) and then the marker."""
    model_dir = Path(model_dir).absolute()
    import orbax.checkpoint as ocp  # lazy: 0.7 s to import, only needed for orbax folders

    leaves = jax.tree.leaves(params)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(model_dir / PARAMS_DIR, params, force=True)
        ckptr.wait_until_finished()
    marker = {"format": "orbax", "params": PARAMS_DIR, "dtype": str(leaves[0].dtype)}
    if jax.process_index() == 0:
        (model_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return model_dir / PARAMS_DIR


def _abstract_params(cfg: ModelConfig, mesh: Mesh | None, dtype) -> dict:
    tree = empty_param_tree(get_model_spec(cfg.architecture).param_shapes(cfg))
    for path, _, _, shape in walk_param_shapes(cfg):
        sharding = (SingleDeviceSharding(jax.local_devices()[0]) if mesh is None
                    else canonical_sharding(path, shape, cfg, mesh))
        set_param(tree, path, jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return tree


def _to_layout(params: dict, cfg: ModelConfig, mesh: Mesh | None, target) -> dict:
    """Cast, and duplicate kv heads into the device layout (on device, per tensor)."""
    reps = kv_head_replicas(cfg, tp_size(mesh))
    shardings = param_shardings(layout_config(cfg, tp_size(mesh)), mesh) if mesh else None
    for path, *_ in walk_param_shapes(cfg):
        w = get_path(params, path)
        if mesh is not None and path[-1] in KV_PARAMS and reps > 1:
            w = expand_kv_fn(reps, cfg.head_dim, get_path(shardings, path))(w)
        set_param(params, path, w if w.dtype == target else w.astype(target))
    return params


def restore_params(model_dir: str | Path, cfg: ModelConfig, *, mesh: Mesh | None = None,
                   dtype: str = "auto") -> dict:
    """Restore every tensor directly into its target sharding (no host-side full copy)."""
    model_dir = Path(model_dir).absolute()
    if not is_orbax_checkpoint(model_dir):
        raise ModelLoadError(f"{model_dir} holds no orbax checkpoint (no {MARKER}); create one "
                             "with `pjinfer convert HF_DIR DST_DIR`")
    marker = json.loads((model_dir / MARKER).read_text())
    stored = jax.numpy.dtype(marker["dtype"])
    target = stored if dtype == "auto" else resolve_dtype(dtype, cfg)
    abstract = _abstract_params(cfg, mesh, stored)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        params: Any = ckptr.restore(model_dir / marker.get("params", PARAMS_DIR), abstract)
    return _to_layout(params, cfg, mesh, target)
