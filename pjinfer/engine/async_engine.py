"""An asyncio front for the engine: the engine loop runs in its own thread and streams outputs.

The step blocks on the device, so it cannot run on the event loop; requests and aborts cross
into the engine thread through a queue, outputs come back with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from pjinfer.engine.config import EngineConfig
from pjinfer.engine.engine import LLMEngine
from pjinfer.engine.metrics import EngineStats
from pjinfer.errors import EngineDeadError
from pjinfer.lora.request import LoRARequest
from pjinfer.outputs import RequestOutput
from pjinfer.sampling_params import SamplingParams

log = logging.getLogger("pjinfer")
_IDLE_WAIT_S = 0.05
T = TypeVar("T")


class _Stream:
    """Delivers one request's outputs from the engine thread to its asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    """`async for out in engine.generate(prompt, params): ...` yields cumulative outputs."""

    def __init__(self, config: EngineConfig, *, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config)
        self.config = config
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._stats = self.engine.get_stats()
        self._last_progress = time.monotonic()  # the latest finished step, or idle loop turn
        self._thread = threading.Thread(target=self._run, name="pjinfer-engine", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stalled_for(self) -> float:
        """Seconds the loop has had work and finished no step (0 when idle or progressing): a
        step blocked on a hung device leaves the thread alive, so liveness alone misses it."""
        if not self._streams:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Let in-flight requests finish for up to `drain_timeout` s, abort the rest, stop."""
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline and self.is_running:
            time.sleep(_IDLE_WAIT_S)
        for rid in list(self._streams):
            self._inbox.put(lambda rid=rid: self._abort_now(rid))
        self._stop.set()
        self._inbox.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def quantization(self) -> dict[str, str | None]:
        """The weights' quantization method (None: float) and the KV cache dtype."""
        return {"method": self.engine.quantization_method,
                "kv_cache_dtype": self.engine.runner.kv_dtype.name}

    @property
    def eos_token_id(self) -> int | None:
        return self.engine.eos_token_id

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    def check_structured_outputs(self, spec) -> None:
        """Thread-safe: compile `spec` now (the engine caches it); ValueError if invalid."""
        self.engine.structured_output.check(spec)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Thread-safe: read and check an adapter (ValueError if it cannot serve)."""
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_request: LoRARequest) -> bool:
        """Thread-safe: drop its host copy; requests running with it finish with it."""
        return self.engine.remove_lora(lora_request)

    def stats(self) -> EngineStats:
        """The snapshot the engine thread published after its latest step."""
        return self._stats

    # ---- requests -------------------------------------------------------------------------
    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       *, request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the loop early (or a cancel) aborts it."""
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        request_id = request_id or f"req-{next(self._ids)}"
        try:
            stream = await self._add(request_id, prompt, params, priority, lora_request)
        except asyncio.CancelledError:  # the add may still reach the engine: undo it after
            self.abort(request_id)
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def _add(self, request_id, prompt, params, priority, lora_request=None) -> _Stream:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        stream = _Stream(loop)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, priority=priority,
                                        lora_request=lora_request)
                self._streams[request_id] = stream
                loop.call_soon_threadsafe(_resolve, accepted, None)
            except Exception as e:  # validation errors go back to the caller
                loop.call_soon_threadsafe(_resolve, accepted, e)

        self._inbox.put(add)
        error = await accepted
        if error is not None:
            raise error
        return stream

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps (the one safe place to touch
        the engine's state: sleep, wake up, a fresh stats snapshot) and return its result."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_settle, done, None, e)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)

        self._inbox.put(run)
        return await done

    def abort(self, request_id: str) -> None:
        """Thread-safe: the engine drops the request and frees its blocks before its next step."""
        self._inbox.put(lambda: self._abort_now(request_id))

    def fail_all(self, error: BaseException) -> None:
        """Thread-safe: abort every request; each stream raises `error` instead of finishing
        (the server's way to end requests still running when its drain timeout is over)."""
        self._inbox.put(lambda: self._fail_now(error))

    def _fail_now(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(error)
        self._streams.clear()

    def _abort_now(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)

    # ---- the engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._stats = self.engine.get_stats()  # before a client can see a finish
                    self._deliver(outputs)
                    self._deliver_failures()
                else:
                    self._stats = self.engine.get_stats()
                self._last_progress = time.monotonic()
        except Exception as e:  # the loop cannot go on: fail every stream loudly
            log.exception("engine loop failed")
            self._error = e
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"the engine stopped after an error: {e}"))
            self._streams.clear()

    def _drain_inbox(self, *, block: bool) -> None:
        """Run queued adds/aborts; when idle, wait a little for the first one."""
        try:
            if block:
                self._inbox.get(timeout=_IDLE_WAIT_S)()
            while True:
                self._inbox.get_nowait()()
        except queue.Empty:
            pass

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]


    def _deliver_failures(self) -> None:
        """A request a fault ended gets its error (HTTP 500, or an error event) and no more."""
        for request_id, error in self.engine.take_failures().items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        future.set_result(error)
