"""Every error a request can end in, and what each tells a client: a gRPC status and a
message that says what to do (never a remote traceback or a node address)."""

from __future__ import annotations

import grpc


class InvalidRequestError(ValueError):
    """A request field is out of range; `field` names it (INVALID_ARGUMENT)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message

    def __reduce__(self):  # crosses Ray process boundaries intact
        return (type(self), (self.field, self.message))


class OverloadedError(RuntimeError):
    """Refused: every slot is taken and the wait queue is full (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        return (type(self), (str(self), self.retry_after_s))


class DrainingError(RuntimeError):
    """Refused: the server is shutting down and finishing the requests it has."""


class NoWorkerError(RuntimeError):
    """No live engine of the pool a request needs."""


class HandleExpiredError(RuntimeError):
    """The producer's lease on this request's blocks has run out (or nearly so)."""


class TransferFailedError(RuntimeError):
    """Decode could not load the request's state from its producer."""


class PrefillFailedError(RuntimeError):
    """The prefill engine did not hand out the request's state."""


class PrefillTimeoutError(RuntimeError):
    """The prefill engine did not finish in the router's time limit."""


class DecodeFailedError(RuntimeError):
    """The decode engine serving the request died or stalled."""


class LegStalledError(DecodeFailedError):
    """A leg heard nothing for the stall timeout: its engine is stuck, or cut off from this
    router while still alive; its request moves to another actor of the pool."""


class FeedLostError(ConnectionError):
    """A worker actor's feed to this router broke: the actor died (or the network failed);
    its legs move to another actor of the pool, as for any actor's death."""


class LegAbortedError(RuntimeError):
    """A worker stopped a leg at its router's word (the caller left; its prefill timed out or stalled)."""


class EngineDeadError(RuntimeError):
    """The engine can no longer serve: its actor exits so that Ray restarts it."""


# Failures of the serving side a client can retry (UNAVAILABLE), with what to tell it.
UNAVAILABLE: dict[type[BaseException], str] = {
    NoWorkerError: "no live engine for this request: retry shortly",
    TransferFailedError: "decode could not load the request's state from prefill: retry",
    HandleExpiredError: "the prefilled state expired before decode read it: retry",
    PrefillFailedError: "prefill failed: retry",
    PrefillTimeoutError: "prefill timed out: retry",
    DecodeFailedError: "the decode engine serving this request failed: retry",
    FeedLostError: "the engine serving this request failed: retry",
    EngineDeadError: "an engine serving this request died: retry",
    DrainingError: "this router is shutting down: retry on another",
}


def client_status(err: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status and message for a known error; None for anything else (a bug: INTERNAL)."""
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)
    for kind, text in UNAVAILABLE.items():
        if isinstance(err, kind):
            return grpc.StatusCode.UNAVAILABLE, text
    return None
