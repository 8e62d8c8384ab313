"""`LoRARequest`: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, id and local PEFT folder (adapter_config.json +
    adapter_model.safetensors).

    Requests with equal (name, id, path) share one loaded copy, one device slot and their
    prefix-cache blocks; a different id or path is another adapter, even under the same name
    (the server gives every load a new id, so a reloaded adapter never reuses stale KV).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r}: lora_path must name the adapter's "
                             "local folder")

    @property
    def cache_key(self) -> tuple[str, int, str]:
        """What keys its KV blocks in the prefix cache apart from the base model's."""
        return (self.lora_name, self.lora_int_id, self.lora_path)
