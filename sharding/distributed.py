"""Multi-host start-up: one `jax.distributed.initialize` per process, before any JAX work.

Every process then runs the same engine code on the same requests (multi-controller SPMD): the
mesh spans all processes' devices, each process loads only its devices' weight slices, and step
inputs/outputs are replicated so every process schedules and samples identically.

    from pjinfer.sharding import distributed
    distributed.initialize()            # reads PJINFER_* below, or pass the three values
    llm = pjinfer.LLM(model, tensor_parallel_size=jax.device_count())

`initialize` also sizes XLA's GPU memory pool (`gpu_memory_utilization`, as the engine would):
`jax.device_count()` starts JAX before the engine could.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from pjinfer.engine.config import ENGINE_ARGS
from pjinfer.engine.kv_budget import claim_device_memory

ENV_COORDINATOR = "PJINFER_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "PJINFER_NUM_PROCESSES"
ENV_PROCESS_ID = "PJINFER_PROCESS_ID"


@dataclass(frozen=True, slots=True)
class DistributedConfig:
    """Where the coordinator listens, how many processes join, and which one this is."""

    coordinator_address: str  # host:port of process 0
    num_processes: int
    process_id: int

    def __post_init__(self) -> None:
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator_address must be host:port, got "
                             f"{self.coordinator_address!r} (e.g. 10.0.0.1:1234)")
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), "
                             f"got {self.process_id}")

    @classmethod
    def resolve(cls, coordinator_address: str | None = None, num_processes: int | None = None,
                process_id: int | None = None) -> DistributedConfig | None:
        """Arguments first, then PJINFER_* environment variables; None when neither is set."""
        address = coordinator_address or os.environ.get(ENV_COORDINATOR)
        if address is None:
            return None
        n = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
        pid = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
        return cls(address, n, pid)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None or not value.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be set to an integer when {ENV_COORDINATOR} is set "
                         f"(got {value!r})")
    return int(value)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_ids: list[int] | None = None,
               gpu_memory_utilization: float = ENGINE_ARGS["gpu_memory_utilization"].default,
               ) -> DistributedConfig | None:
    """Join the process group; a no-op (returns None) when nothing configures one. Either
    way, first size XLA's memory pool for the engine (`kv_budget.claim_device_memory`)."""
    claim_device_memory(gpu_memory_utilization)
    cfg = DistributedConfig.resolve(coordinator_address, num_processes, process_id)
    if cfg is None or cfg.num_processes == 1:
        return cfg
    jax.distributed.initialize(coordinator_address=cfg.coordinator_address,
                               num_processes=cfg.num_processes, process_id=cfg.process_id,
                               local_device_ids=local_device_ids)
    return cfg
