"""Multi-LoRA serving: PEFT adapters applied per token inside one batched step.

`request` (LoRARequest, vLLM's name), `adapter` (PEFT folder -> host arrays), `ops` (the
shrink/expand math and the adapted weight `layers.linear` dispatches to), `weights` (the
stacked device arrays of the adapter slots), `manager` (host cache and slot LRU), `served`
(the server's name -> adapter table).
"""
