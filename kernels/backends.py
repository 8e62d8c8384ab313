"""The names of the attention backends (pjinfer.kernels.ops dispatches on them), importable
without JAX, so the engine-argument table can check `attention_backend` and list it in --help."""

BACKENDS = ("auto", "reference", "pallas", "triton")
