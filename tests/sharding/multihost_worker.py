"""One process of the two-process test: join the group, generate greedily over a global mesh.

Run as `python multihost_worker.py ADDRESS NUM_PROCESSES PROCESS_ID TP`; prints one JSON line
`{"process": id, "devices": n, "tokens": [[...], ...]}`. The environment (JAX_PLATFORMS=cpu,
XLA_FLAGS with the per-process device count) is set by the launching test.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [1, 5, 6]]
MAX_TOKENS = 8


def main(argv: list[str]) -> None:
    address, num_processes, process_id, tp = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    from pjinfer.sharding import distributed

    distributed.initialize(address, num_processes, process_id)
    import jax

    import pjinfer

    llm = pjinfer.LLM(None, tensor_parallel_size=tp, dtype="float32")
    outs = llm.generate(PROMPTS, pjinfer.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    tokens = [o.outputs[0].token_ids for o in outs]
    print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                      "tokens": tokens}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
