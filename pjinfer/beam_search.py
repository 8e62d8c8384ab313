"""Beam search on top of the engine, as vLLM does it since v1: outside the engine core.

Each step asks the engine for one token of every live beam with the top 2W log-probabilities
(W = beam width), keeps the W best continuations per prompt by score, and moves beams that end
in EOS to the finished set. The engine sees plain one-token requests whose prompts are the
beams' token lists; with prefix caching on, a beam's prompt and history are cache hits, so a step
only computes each beam's newest token. The same `BeamSearch` state drives the offline
`LLM.beam_search` and the server's `use_beam_search`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pjinfer.outputs import PositionLogprobs
from pjinfer.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's beam search settings. The score of a sequence is its cumulative log-probability
    divided by len(tokens) ** length_penalty (prompt included, a final EOS not counted)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got "
                             f"{self.length_penalty}")

    def check_logprobs(self, max_logprobs: int) -> None:
        """Each step needs the top 2W log-probabilities of every beam."""
        if 2 * self.beam_width > max_logprobs:
            raise ValueError(
                f"beam_width {self.beam_width} needs {2 * self.beam_width} logprobs per step "
                f"but max_logprobs is {max_logprobs}: lower beam_width to at most "
                f"{max_logprobs // 2} or raise max_logprobs")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the generated tokens (as in vLLM)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    num_prompt_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(seq: BeamSearchSequence, eos_token_id: int | None,
               length_penalty: float) -> float:
    length = len(seq.tokens)
    if eos_token_id is not None and seq.tokens and seq.tokens[-1] == eos_token_id:
        length -= 1
    return seq.cum_logprob / (length ** length_penalty)


class BeamSearch:
    """The beams of several prompts; `requests()` -> engine -> `advance()` until `done`."""

    def __init__(self, prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                 eos_token_id: int | None):
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self._beams = [[BeamSearchSequence(list(p), num_prompt_tokens=len(p))] for p in prompts]
        self._finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    @property
    def done(self) -> bool:
        return self._steps >= self.params.max_tokens or not any(self._beams)

    def requests(self) -> list[list[int]]:
        """The token lists to extend by one token, all prompts' live beams in order."""
        return [beam.tokens for beams in self._beams for beam in beams]

    def sampling_params(self) -> SamplingParams:
        p = self.params
        return SamplingParams(max_tokens=1, logprobs=2 * p.beam_width,
                              temperature=p.temperature, ignore_eos=True)

    def advance(self, logprobs: Sequence[PositionLogprobs]) -> None:
        """Apply one step: `logprobs[i]` are the top log-probabilities after request i."""
        it = iter(logprobs)
        for i, beams in enumerate(self._beams):
            candidates = [self._extend(beam, next(it)) for beam in beams]
            flat = [c for group in candidates for c in group]
            live = []
            for c in sorted(flat, key=self._score, reverse=True):
                if c.tokens[-1] == self.eos_token_id:
                    c.finish_reason = "stop"
                    self._finished[i].append(c)
                else:
                    live.append(c)
            self._beams[i] = live[:self.params.beam_width]
        self._steps += 1

    def _extend(self, beam: BeamSearchSequence,
                top: PositionLogprobs) -> list[BeamSearchSequence]:
        return [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                   beam.cum_logprob + lp.logprob,
                                   num_prompt_tokens=beam.num_prompt_tokens)
                for token, lp in top.items()]

    def _score(self, seq: BeamSearchSequence) -> float:
        return beam_score(seq, self.eos_token_id, self.params.length_penalty)

    def results(self, decode: Callable[[list[int]], str] | None) -> list[BeamSearchOutput]:
        """The best `beam_width` finished-or-live sequences per prompt, best first."""
        outputs = []
        for live, finished in zip(self._beams, self._finished, strict=True):
            for beam in live:
                beam.finish_reason = "length"
            best = sorted(finished + live, key=self._score, reverse=True)
            best = best[:self.params.beam_width]
            for beam in best:
                beam.text = decode(beam.tokens) if decode is not None else None
            outputs.append(BeamSearchOutput(best))
        return outputs
