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

from pjinfer.config import ModelConfig, resolve_dtype
from pjinfer.errors import ModelLoadError
from pjinfer.models.spec import build_tree, get_path

from .placement import Placer

MARKER = "pjinfer_orbax.json"
PARAMS_DIR = "params"


def is_orbax_checkpoint(model_dir: str | Path) -> bool:
    return (Path(model_dir) / MARKER).is_file()


def save_params(params: dict, model_dir: str | Path, *, dtype: str) -> Path:
    """Write `params` (any sharding; each process writes its shards), then the marker naming
    the model dtype `dtype` (params whose spec declares a dtype of their own keep theirs)."""
    model_dir = Path(model_dir).absolute()
    import orbax.checkpoint as ocp  # lazy: 0.7 s to import, only needed for orbax folders

    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(model_dir / PARAMS_DIR, params, force=True)
        ckptr.wait_until_finished()
    marker = {"format": "orbax", "params": PARAMS_DIR, "dtype": dtype}
    if jax.process_index() == 0:
        (model_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return model_dir / PARAMS_DIR


def restore_params(model_dir: str | Path, cfg: ModelConfig, placer: Placer, *,
                   dtype: str = "auto") -> dict:
    """Restore every tensor directly into its stored sharding (no host-side full copy), then
    into the placer's layout (kv heads duplicated on the device) and dtype."""
    model_dir = Path(model_dir).absolute()
    if not is_orbax_checkpoint(model_dir):
        raise ModelLoadError(f"{model_dir} holds no orbax checkpoint (no {MARKER}); create one "
                             "with `pjinfer convert HF_DIR DST_DIR`")
    marker = json.loads((model_dir / MARKER).read_text())
    stored = jax.numpy.dtype(marker["dtype"])
    target = stored if dtype == "auto" else resolve_dtype(dtype, cfg)
    specs = cfg.param_specs()
    abstract = build_tree((p.path, jax.ShapeDtypeStruct(p.shape, p.target_dtype(stored),
                                                        sharding=placer.stored_sharding(p)))
                          for p in specs)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        params: Any = ckptr.restore(model_dir / marker.get("params", PARAMS_DIR), abstract)
    return build_tree((p.path, placer.from_device(p, get_path(params, p.path))
                       .astype(p.target_dtype(target))) for p in specs)
