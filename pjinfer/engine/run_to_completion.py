"""Step an engine until a batch of requests is finished: the offline loop of `LLM.generate`
and the benchmarks.

A request the engine fails never finishes, so the loop must also watch the failures: without
that it steps forever (round 44's int4 benchmark, every request out of memory, did).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pjinfer.engine.engine import LLMEngine
from pjinfer.outputs import RequestOutput


def run_to_completion(engine: LLMEngine, request_ids: Sequence[str],
                      on_finished: Callable[[RequestOutput], None] | None = None,
                      ) -> dict[str, RequestOutput]:
    """Each request's final output by id, once all of `request_ids` (already added) finished;
    `on_finished` sees each as it finishes. If the engine fails any, the rest are aborted (their
    blocks freed) and the first failure is raised, noted with how many of the batch failed
    (other requests' failures are taken and dropped: run this loop only where it alone drives
    the engine)."""
    wanted = set(request_ids)
    done: dict[str, RequestOutput] = {}
    while len(done) < len(wanted):
        for out in engine.step():
            if out.finished and out.request_id in wanted and out.request_id not in done:
                done[out.request_id] = out
                if on_finished is not None:
                    on_finished(out)
        failed = [e for rid, e in engine.take_failures().items() if rid in wanted]
        if failed:
            for request_id in request_ids:
                engine.abort_request(request_id)
            _collect_in_flight(engine)
            failed[0].add_note(f"{len(failed)} of {len(wanted)} requests of the batch failed in "
                               "the engine; the others were aborted")
            raise failed[0]
    _collect_in_flight(engine)
    return done


def _collect_in_flight(engine: LLMEngine) -> None:
    """With asynchronous scheduling a step launched before its requests were seen to stop
    (EOS, a stop string) is still in flight; with nothing else queued, finish it now, so the
    engine is idle when the batch is returned (as vLLM's `LLM.generate` leaves it)."""
    while engine.has_unfinished_requests() and not engine.has_queued_requests():
        engine.step()
