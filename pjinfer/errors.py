"""Errors raised at pjinfer's boundaries; each message says what was wrong and how to fix it."""


class PjinferError(Exception):
    """Base class of pjinfer's own errors."""


class UsageError(PjinferError):
    """A bad flag or config value; `pjinfer` prints it as one line and exits 2."""


class ModelLoadError(PjinferError, ValueError):
    """A model directory, config or checkpoint cannot be used as given."""


class EngineOverloadedError(PjinferError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDeadError(PjinferError):
    """The engine loop stopped after an internal error; no more requests can be served."""


class ServerShuttingDownError(PjinferError):
    """The server is stopping and this request outlived the drain timeout (HTTP 503)."""


class RequestFailedError(PjinferError):
    """One request hit a fault inside the engine (HTTP 500); the engine went on serving the
    others. The original exception is its `__cause__`."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id} failed inside the engine: "
                         f"{type(cause).__name__}: {cause}")
        self.request_id = request_id
        self.__cause__ = cause
