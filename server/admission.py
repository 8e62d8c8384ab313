"""Admission control: who may start a request now, decided before the engine sees it.

Two kinds of refusal, told apart by status so that clients back off the right way:
- 429 (the client's own rate): a token bucket per API key limits requests per second (with a
  burst) and tokens per second, a request costing its prompt tokens plus n * max_tokens.
  Without API keys every request shares one global bucket.
- 503 (the server is full): caps on the requests, and the prompt tokens, the server has
  admitted and that have not finished yet (waiting in the engine or running). They bound the
  work taken on whoever sends it; the engine's own `--max-waiting-requests` still bounds its
  waiting queue alone.
Both carry `Retry-After`. Everything here runs on the event loop, so checks and updates need
no lock.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from pjinfer.server.protocol import APIError
from pjinfer.server.streaming import release_after

QUEUE_FULL_RETRY_S = 1.0  # a full queue drains within about a second of decode steps


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The `pjinfer serve` admission flags; None turns a limit off."""

    rate_limit_requests: float | None = None  # requests per second, per API key
    rate_limit_burst: float | None = None  # requests at once (default: one second's worth)
    rate_limit_tokens: float | None = None  # prompt + max_tokens per second, per API key
    max_num_queued_requests: int | None = None  # admitted, unfinished requests
    max_num_queued_tokens: int | None = None  # their prompt tokens

    def __post_init__(self) -> None:
        for name in ("rate_limit_requests", "rate_limit_tokens", "max_num_queued_requests",
                     "max_num_queued_tokens"):
            _check_positive(name, getattr(self, name))
        _check_positive("rate_limit_burst", self.rate_limit_burst, at_least=1)
        if self.rate_limit_burst is not None and self.rate_limit_requests is None:
            raise ValueError("--rate-limit-burst needs --rate-limit-requests")

    @property
    def burst(self) -> float:
        return self.rate_limit_burst or max(1.0, self.rate_limit_requests or 1.0)


def _check_positive(name: str, value: float | None, at_least: float = 0) -> None:
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value <= 0 or value < at_least:
        bound = f">= {at_least:g}" if at_least else "> 0"
        raise ValueError(f"--{name.replace('_', '-')} must be a number {bound}, got {value!r}")


def read_api_keys(path: str) -> list[str]:
    """--api-key-file: one key per line; blank lines and `#` comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {path!r}: {e.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file: {path!r} holds no key (one key per line)")
    return keys


class TokenBucket:
    """`rate` units per second, holding at most `capacity`; `clock` is injectable for tests.

    A cost above the capacity could never be paid in full, so a request is let through once
    the bucket holds min(cost, capacity), and the rest becomes debt: the level goes negative
    and later requests wait for it to refill, which keeps the long-run rate at `rate`.
    """

    def __init__(self, rate: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic):
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self.level = capacity
        self._updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._updated) * self.rate)
        self._updated = now

    def wait_time(self, cost: float) -> float:
        """Seconds until `cost` may be taken (0: now)."""
        self._refill()
        return max(0.0, (min(cost, self.capacity) - self.level) / self.rate)

    def take(self, cost: float) -> None:
        self._refill()
        self.level -= cost


class Ticket:
    """One admitted request's share of the queue counts, given back exactly once."""

    def __init__(self, release: Callable[[], None]):
        self._release: Callable[[], None] | None = release
        self._handed_off = False

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handed_off:
            self.release()

    def release(self) -> None:
        if self._release is not None:
            self._release, release = None, self._release
            release()

    def hand_off(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """The ticket goes back when the streamed response ends (`release_after`)."""
        self._handed_off = True
        return release_after(events, self.release)


class Admission:
    """The buckets of every API key and the queue counts of one server."""

    def __init__(self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._buckets: dict[str | None, list[tuple[str, TokenBucket]]] = {}
        self.queued_requests = 0
        self.queued_tokens = 0

    def _buckets_of(self, key: str | None) -> list[tuple[str, TokenBucket]]:
        if key not in self._buckets:
            lim, buckets = self.limits, []
            if lim.rate_limit_requests is not None:
                buckets.append(("requests", TokenBucket(lim.rate_limit_requests, lim.burst,
                                                        self.clock)))
            if lim.rate_limit_tokens is not None:  # one second's worth
                buckets.append(("tokens", TokenBucket(lim.rate_limit_tokens,
                                                      lim.rate_limit_tokens, self.clock)))
            self._buckets[key] = buckets
        return self._buckets[key]

    def precheck(self, key: str | None) -> None:
        """The request-rate check alone, before the body is parsed and tokenized: a flooding
        client's surplus is refused for the price of reading its headers. Nothing is taken
        (admit() does that, with the token cost once it is known)."""
        for kind, bucket in self._buckets_of(key):
            wait = bucket.wait_time(1) if kind == "requests" else 0.0
            if wait > 0:
                raise _rate_limited(kind, wait, self.limits)

    def admit(self, key: str | None, prompt_tokens: int, max_new_tokens: int) -> Ticket:
        """Admit a request or raise a 429 / 503 APIError carrying its Retry-After."""
        costs = {"requests": 1, "tokens": prompt_tokens + max_new_tokens}
        buckets = self._buckets_of(key)
        for kind, bucket in buckets:
            wait = bucket.wait_time(costs[kind])
            if wait > 0:
                raise _rate_limited(kind, wait, self.limits)
        self._check_queue(prompt_tokens)
        for kind, bucket in buckets:
            bucket.take(costs[kind])
        self.queued_requests += 1
        self.queued_tokens += prompt_tokens

        def release() -> None:
            self.queued_requests -= 1
            self.queued_tokens -= prompt_tokens

        return Ticket(release)

    def _check_queue(self, prompt_tokens: int) -> None:
        lim = self.limits
        if lim.max_num_queued_requests is not None \
                and self.queued_requests + 1 > lim.max_num_queued_requests:
            raise _queue_full(f"{self.queued_requests} requests are queued, the server's limit "
                              f"is {lim.max_num_queued_requests} (--max-num-queued-requests)")
        # an empty queue takes any one request, or one longer than the cap could never run
        if lim.max_num_queued_tokens is not None and self.queued_requests \
                and self.queued_tokens + prompt_tokens > lim.max_num_queued_tokens:
            raise _queue_full(f"{self.queued_tokens} prompt tokens are queued and this request "
                              f"adds {prompt_tokens}, the server's limit is "
                              f"{lim.max_num_queued_tokens} (--max-num-queued-tokens)")


def _rate_limited(kind: str, wait: float, limits: AdmissionLimits) -> APIError:
    rate = limits.rate_limit_requests if kind == "requests" else limits.rate_limit_tokens
    return APIError(f"Rate limit reached: {rate:g} {kind} per second for this API key "
                    f"(--rate-limit-{kind}); retry in {wait:.2f} s", status=429, type=kind,
                    code="rate_limit_exceeded", retry_after=wait)


def _queue_full(why: str) -> APIError:
    return APIError(f"The server is at capacity: {why}; retry shortly", status=503,
                    type="server_overloaded", code="overloaded", retry_after=QUEUE_FULL_RETRY_S)


def retry_after_header(seconds: float) -> str:
    """Retry-After takes whole seconds: round up, so a client waiting it is let through."""
    return str(max(1, math.ceil(seconds)))
