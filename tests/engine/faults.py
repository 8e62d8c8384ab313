"""Faults injected into a live engine, for the tests of what it does with them."""

from __future__ import annotations


def fail_launch(monkeypatch, engine, call: int, message: str) -> None:
    """The engine's model launch number `call` (from 0) raises RuntimeError(message); the
    others run as before."""
    forward = engine.runner.forward  # what the engine launches a step's model with
    calls = iter(range(1_000_000))

    def faulty(*args, **kwargs):
        if next(calls) == call:
            raise RuntimeError(message)
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", faulty)
