"""pjinfer: LLM inference and serving on JAX/XLA with paged attention."""

__version__ = "0.1.0"

from pjinfer.generate import LLM, generate  # noqa: E402
from pjinfer.outputs import CompletionOutput, RequestOutput  # noqa: E402
from pjinfer.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__",
           "generate"]
