"""pjinfer: LLM inference and serving on JAX/XLA with paged attention."""

__version__ = "0.1.0"
