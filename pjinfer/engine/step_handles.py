"""A step while it runs and once fetched: what the runner hands the engine at each stage.

The runner launches a forward (`LaunchedForward`, when a structured-output row's sampler must
wait for its token mask) or a whole step (`LaunchedStep`); the engine keeps either with its
schedule (`InFlightStep`) until it fetches the host copies (`StepResult`).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import jax
import numpy as np

from pjinfer.engine.inputs import BatchLayout
from pjinfer.engine.sampling_metadata import SamplingMetadata
from pjinfer.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class LaunchedForward:
    """A dispatched model forward whose sampler is not launched yet: a structured-output
    row's token mask needs the previous step's tokens on the host first."""

    logits: jax.Array  # [S, V] f32
    md: SamplingMetadata
    prev_tokens: jax.Array  # [P]
    prompt_logprobs: tuple[jax.Array, ...] | None
    layout: BatchLayout
    max_logprobs: int


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A dispatched step whose outputs are still on (or on their way to) the device."""

    sampled: jax.Array  # SamplerOutput.to_words() of the padded rows ([J, W]: J steps)
    prompt_logprobs: tuple[jax.Array, ...] | None
    next_tokens: jax.Array  # [P] sampled tokens padded to max_padded_seqs: the next prev_tokens
    layout: BatchLayout


@dataclass(frozen=True, slots=True)
class StepResult:
    """Host copies of what one step produced, for the real (unpadded) sequences; J = the
    step's decode steps (1, or num_scheduler_steps for a multi-step decode)."""

    token_ids: np.ndarray  # [S, J]
    logprobs: np.ndarray  # [S, J, 1+K], column 0 = chosen token
    logprob_token_ids: np.ndarray  # [S, J, 1+K]
    ranks: np.ndarray  # [S, J]
    prompt_logprobs: tuple[np.ndarray, ...] | None = None  # per token: (lp, rank, top, ids)


@dataclass(slots=True)
class InFlightStep:
    """A step on the device, with the schedule that produced it. A step with structured-output
    rows is launched in two halves: `forward` first, `step` (its sampler) once the token mask
    can be filled, i.e. once the step before has been finished."""

    sched: SchedulerOutput
    forward: LaunchedForward | None
    step: LaunchedStep | None
    start: float
    mask: Future | None = None  # the constrained rows' token bitmask, once its fill started
