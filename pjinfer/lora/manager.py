"""Which adapters are where: a host cache of loaded folders and the device slots, both LRU.

A request's adapter is read and checked when the request arrives (`load`: a bad folder is an
error for that request alone). Before each step `activate` gives every adapter of the batch a
device row, reusing the row of the adapter used least recently among those the batch does not
need; the scheduler never puts more than max_loras distinct adapters into the running batch,
so there is always one. The host cache keeps `max_cpu_loras` adapters, so switching back to an
evicted slot's adapter costs a host-to-device copy, not a disk read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from pjinfer.config import ModelConfig
from pjinfer.lora.adapter import LoRAAdapter, load_adapter
from pjinfer.lora.request import LoRARequest

WriteSlot = Callable[[int, LoRAAdapter], None]  # (device row, adapter) -> None


class LoRAManager:
    """Host cache and device-slot table; `load` is thread-safe (the server checks adapters
    off the engine thread), `activate` runs on the engine thread."""

    def __init__(self, cfg: ModelConfig, *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, write_slot: WriteSlot):
        self.cfg, self.max_loras, self.max_lora_rank = cfg, max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._write_slot = write_slot
        self._lock = threading.Lock()
        self._host: OrderedDict[LoRARequest, LoRAAdapter] = OrderedDict()  # LRU first
        self._rows: OrderedDict[LoRARequest, int] = OrderedDict()  # on the device, LRU first
        self._free_rows = list(range(max_loras - 1, -1, -1))
        self.num_slot_writes = 0

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, from the host cache or its folder (LoRALoadError if unusable)."""
        with self._lock:
            adapter = self._host.get(request)
            if adapter is not None:
                self._host.move_to_end(request)
                return adapter
        adapter = load_adapter(request.lora_name, request.lora_path, self.cfg,
                               self.max_lora_rank)
        with self._lock:
            self._host[request] = adapter
            while len(self._host) > self.max_cpu_loras:
                self._host.popitem(last=False)
        return adapter

    def remove(self, request: LoRARequest) -> bool:
        """Forget the host copy; its device row is reused once another adapter needs one
        (requests still running with it keep it until they finish)."""
        with self._lock:
            return self._host.pop(request, None) is not None

    def step_slots(self, requests: Sequence[LoRARequest | None],
                   fail: Callable[[LoRARequest, Exception], None]) -> list[int]:
        """A step's slot per entry. An adapter that can no longer be read (evicted from the
        host cache, its folder gone since its requests arrived) goes to `fail` and its
        entries run on the base model (slot 0)."""
        for lora in dict.fromkeys(r for r in requests if r is not None):
            try:
                self.load(lora)  # a host-cache hit unless it was evicted
            except ValueError as e:
                fail(lora, e)
                requests = [None if r == lora else r for r in requests]
        return self.activate(requests)

    def activate(self, requests: Sequence[LoRARequest | None]) -> list[int]:
        """Slot of each entry (0 = base model, row + 1 otherwise), loading what is missing."""
        needed = dict.fromkeys(r for r in requests if r is not None)
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, max_loras is "
                               f"{self.max_loras}")
        for r in needed:
            if r in self._rows:
                self._rows.move_to_end(r)
        for r in needed:
            if r not in self._rows:
                row = self._take_row(needed)
                try:
                    self._write_slot(row, self.load(r))
                except Exception:
                    self._free_rows.append(row)  # the row held nothing usable
                    raise
                self._rows[r] = row
                self.num_slot_writes += 1
        return [0 if r is None else self._rows[r] + 1 for r in requests]

    def _take_row(self, keep: dict[LoRARequest, None]) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        victim = next(r for r in self._rows if r not in keep)  # least recently used
        return self._rows.pop(victim)

    @property
    def resident(self) -> list[LoRARequest]:
        """Adapters with a device row, least recently used first."""
        return list(self._rows)
