"""Domain errors -> gRPC status codes, in one place, for every servicer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class ServiceUnavailable(Exception):
    """A backend (worker, scheduler) cannot be reached or has failed; retrying later may work."""


class NotFound(Exception):
    """The named thing (model, request) does not exist."""


class AlreadyExists(ValueError):
    """A request id that is still in use (a ValueError to Python callers, ALREADY_EXISTS over gRPC)."""


class Unauthenticated(Exception):
    """No API key, or one the gateway does not accept (HTTP 401, UNAUTHENTICATED)."""


class ResourceExhausted(Exception):
    """A limit was reached: the gateway's concurrency, or an API key's rate (HTTP 429, RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s  # when the client may try again (HTTP's Retry-After)


STATUS_OF: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (  # first match wins
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (TypeError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ServiceUnavailable, grpc.StatusCode.UNAVAILABLE),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


@contextlib.contextmanager
def grpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Turn a domain exception raised inside a servicer method into the matching status."""
    try:
        yield
    except grpc.RpcError:
        raise
    except Exception as exc:  # every failure must reach the client as a status, never a hang
        context.abort(status_for(exc), str(exc) or type(exc).__name__)


def error_from_status(error: grpc.RpcError) -> Exception:
    """The other direction, for clients: a status back into a domain exception."""
    return error_for_code(error.code(), error.details() or str(error.code()))


def status_from_int(value: int) -> grpc.StatusCode:
    """A status code sent as its number (inside a message rather than as the call's status)."""
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)


def error_for_code(code: grpc.StatusCode, details: str) -> Exception:
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return AlreadyExists(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ServiceUnavailable(details)
    return RuntimeError(f"{code.name}: {details}")
