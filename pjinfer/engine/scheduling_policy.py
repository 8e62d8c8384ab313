"""Scheduling policies: the order of the waiting queue, and (reversed) who is preempted first.

A policy gives each request a key when it is queued; a smaller key is served first and
preempted last. Keys never change while a request waits (the queue is a heap), so time-based
fairness is folded into the key itself (see `SJFPolicy`). Plugins add policies with
`register_scheduling_policy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pjinfer.registry import Registry

if TYPE_CHECKING:
    from pjinfer.engine.request import Request


class SchedulingPolicy(Protocol):
    """Orders requests: a smaller key is served first and preempted last. Replaceable."""

    def key(self, request: Request) -> tuple: ...


class FCFSPolicy:
    """First come, first served."""

    def key(self, request: Request) -> tuple:
        return (request.arrival_time,)


class PriorityPolicy:
    """Lower `priority` value first (vLLM's convention), then arrival order."""

    def key(self, request: Request) -> tuple:
        return (request.priority, request.arrival_time)


class SJFPolicy:
    """Shortest prompt first, with aging so that long prompts cannot starve.

    The key is prompt_tokens + aging_rate * arrival_time: waiting one second counts as
    `aging_rate` prompt tokens fewer (the common "- aging_rate * now" term of every key drops
    out of the comparison, so keys stay fixed in the heap). Bound: a prompt of L tokens is
    served before any request that arrives more than L / aging_rate seconds after it (with the
    default 1,000 tokens/s, an 8k-token prompt yields to newer short ones for at most ~8 s).
    """

    def __init__(self, aging_rate: float = 1000.0):
        if not aging_rate > 0:
            raise ValueError(f"aging_rate must be > 0 prompt tokens per second, got {aging_rate}")
        self.aging_rate = aging_rate

    def key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens + self.aging_rate * request.arrival_time,
                request.arrival_time)


POLICIES: Registry[type] = Registry(
    "scheduling_policy", "pjinfer.engine.scheduling_policy.register_scheduling_policy",
    {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "sjf": SJFPolicy})


def register_scheduling_policy(name: str, policy: type, *, overwrite: bool = False) -> None:
    """Make `scheduling_policy=name` build `policy()` (a class with `key(request)`)."""
    POLICIES.register(name, policy, overwrite=overwrite)


def scheduling_policies() -> list[str]:
    return POLICIES.names()


def make_policy(name: str) -> SchedulingPolicy:
    return POLICIES.get(name)()
