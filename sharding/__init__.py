"""Tensor parallelism applied from outside the (unsharded) model code, gpt-fast style.

mesh.py        ("dp", "tp") Mesh + validation of tensor_parallel_size against model and devices
rules.py       param path -> logical axes (the ModelSpec's table) -> mesh axes; kv-head duplication
attention.py   shard_map of q/k norm + RoPE, KV write, paged attention over tp (kernels see a shard)
placement.py   each tensor straight into its shards (memmap slices, generated, or already loaded)
checkpoint.py  orbax save/restore onto the mesh; convert.py is `pjinfer convert`
distributed.py jax.distributed start-up for multi-host (PJINFER_* environment variables)
"""

from .mesh import AXES, check_parallelism, make_mesh
from .rules import LOGICAL_TO_MESH, layout_config, param_shardings

__all__ = ["AXES", "LOGICAL_TO_MESH", "check_parallelism", "layout_config", "make_mesh",
           "param_shardings"]
