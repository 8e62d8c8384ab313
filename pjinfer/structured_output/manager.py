"""The engine's structured-output state: requests waiting for their grammar, masks, matchers.

A constrained request is parked here (not scheduled, holding no KV blocks) until its grammar
has compiled; then each of its sequences gets its own matcher (`Request.grammar`). Every step
with constrained rows gets a packed token bitmask filled from the matchers, and after the step
the matchers consume the accepted tokens; a request ends when its grammar is complete.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np

from pjinfer.engine.request import Request, RequestStatus
from pjinfer.engine.scheduler import NewTokens, Scheduler, SchedulerOutput
from pjinfer.structured_output.grammar import MASK_THREADS, GrammarCompiler, result_of
from pjinfer.structured_output.params import StructuredOutputsParams

log = logging.getLogger("pjinfer")
GRAMMAR_WAIT_S = 0.01  # an engine with only requests waiting for their grammar blocks this long


class StructuredOutputManager:
    """Owns the grammar compiler and the groups waiting for it; builds each step's mask."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | None):
        """`eos_token_ids`: what ends a complete grammar (None: the tokenizer's EOS)."""
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self._parked: list[tuple[list[Request], Future]] = []
        self._live: list[Request] = []  # admitted with a matcher, maybe finished since
        self._executor: llguidance.LLExecutor | None = None  # parallel mask fills
        # the fill runs beside the engine loop's own host work (llguidance drops the GIL)
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="pjinfer-mask")

    def check(self, spec: StructuredOutputsParams) -> None:
        """Compile now (or find the cached compile) and raise its ValueError: for callers off
        the engine loop that want the error before the request exists (server, LLM)."""
        self.compiler.compile(spec)

    # ---- waiting for grammars -------------------------------------------------------------
    def park(self, group: list[Request]) -> bool:
        """Hold a constrained group until its grammar is ready; False for an unconstrained one.
        A grammar already known to be invalid raises its ValueError here."""
        spec = group[0].params.structured_outputs
        if spec is None:
            return False
        future = self.compiler.submit(spec)
        if future.done():
            result_of(future)  # raises if the grammar is known to be invalid
        self._parked.append((group, future))
        return True

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def admit_compiled(self, scheduler: Scheduler) -> set[str]:
        """Queue the groups whose grammar has compiled (each sequence gets its own matcher);
        end, aborted, those whose grammar failed: returns their ids (changed groups). With
        nothing else to run, wait a little for a compile rather than spin."""
        if not self._parked:
            return set()
        failed, parked = [], []
        for group, future in self._parked:
            if group[0].is_finished:  # aborted while waiting
                continue
            if not future.done():
                parked.append((group, future))
            elif future.exception() is not None:
                log.warning("request %s: %s", group[0].group_id, future.exception())
                scheduler.finish_requests(group, RequestStatus.FINISHED_ABORTED,
                                          str(future.exception()))
                failed.append(group[0].group_id)
            else:
                for r in group:
                    r.grammar_template, r.grammar = future.result().matcher()
                self._live.extend(group)
                scheduler.add(group)
        self._parked = parked
        if parked and not scheduler.has_unfinished():
            concurrent.futures.wait([f for _, f in parked], GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return set(failed)

    # ---- the step -------------------------------------------------------------------------
    @property
    def num_live(self) -> int:
        """Unfinished requests with a matcher (finished ones are forgotten here)."""
        if self._live:
            self._live = [r for r in self._live if not r.is_finished]
        return len(self._live)

    def constrained(self, sched: SchedulerOutput) -> bool:
        """Does any row of the step sample under a grammar? Without a live constrained
        request (the usual case) this looks at no row."""
        return self.num_live > 0 and any(c.samples and c.request.grammar is not None
                                         for c in sched.scheduled)

    def bitmask(self, sched: SchedulerOutput, num_rows: int) -> np.ndarray | None:
        """[num_rows, ceil(V/32)] i32 allowed tokens of every row (all ones for rows without
        a grammar), from the matchers as they are now: call once the previous step's tokens
        are consumed. None when no row is constrained. Rows go to llguidance ordered by
        template, so each fill thread mostly works on matchers of one template."""
        rows = sorted(((c.request.grammar_template, i) for i, c in enumerate(sched.scheduled)
                       if c.samples and c.request.grammar is not None))
        if not rows:
            return None
        rows = [(sched.scheduled[i].request.grammar, i) for _, i in rows]
        mask = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask

    def start_bitmask(self, sched: SchedulerOutput, num_rows: int) -> Future:
        """`bitmask` on the mask thread: the engine turns the previous step into text
        meanwhile. Nothing else touches the matchers until the future is done."""
        return self._filler.submit(self.bitmask, sched, num_rows)

    def advance(self, new_tokens: Iterable[NewTokens]) -> list[Request]:
        """Feed each live constrained request its accepted tokens; returns those whose grammar
        is now complete (or broken: a token it rejected), which the caller ends."""
        if not self._live:  # nothing constrained was admitted since the last prune
            return []
        done = []
        for nt in new_tokens:
            r, matcher = nt.request, nt.request.grammar
            if matcher is None or r.is_finished:
                continue
            for token in nt.token_ids:
                matcher.consume_token(token)
            if matcher.is_error():
                log.warning("request %s: its grammar rejected a sampled token: %s",
                            r.request_id, matcher.get_error().splitlines()[0])
            if matcher.is_stopped():  # also true in the error state
                done.append(r)
        return done

    def shutdown(self) -> None:
        self.compiler.shutdown()
        self._filler.shutdown(wait=False, cancel_futures=True)
