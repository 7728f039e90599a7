"""Errors over HTTP, mapped in one place (error_body): a domain error, or the router's or the HTTP layer's, as its
status and an OpenAI error object. ``install_error_handlers`` has the app answer every error that way: FastAPI's
422 for invalid input becomes a 400 naming the field, and a failure of the gateway a 500 error object."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.gateway.rate_limits import RateLimited
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable, Unauthenticated
from shared.invalid_parameter import InvalidParameter
from shared.logging import setup_logging

log = setup_logging("gateway")

HTTP_KINDS = {404: ("NotFoundError", "not_found"), 405: ("MethodNotAllowedError", "method_not_allowed"),
              408: ("RequestTimeoutError", "request_timeout"), 413: ("RequestTooLargeError", "request_too_large"),
              431: ("RequestHeaderFieldsTooLargeError", "request_header_fields_too_large"),
              503: ("ServiceUnavailableError", "service_unavailable")}


def error_body(exc: BaseException) -> tuple[int, dict]:
    """The status and OpenAI error object for a domain error."""
    if isinstance(exc, RateLimited):
        status, kind, code = 429, exc.kind, "rate_limit_exceeded"  # OpenAI's type: what ran out
    elif isinstance(exc, ResourceExhausted):
        status, kind, code = 429, "TooManyRequestsError", "too_many_requests"
    elif isinstance(exc, Unauthenticated):
        status, kind, code = 401, "AuthenticationError", "invalid_api_key"
    elif isinstance(exc, NotFound):
        status, kind, code = 404, "NotFoundError", "model_not_found"
    elif isinstance(exc, (ValueError, TypeError)):
        status, kind, code = 400, "BadRequestError", "invalid_request"
    elif isinstance(exc, (ServiceUnavailable, TimeoutError)):
        status, kind, code = 503, "ServiceUnavailableError", "service_unavailable"
    elif isinstance(exc, HTTPException):  # the router's and the HTTP layer's (http_protocol.py, body_limit.py)
        status = exc.status_code
        kind, code = HTTP_KINDS.get(status, ("BadRequestError", "invalid_request") if status < 500 else
                                    ("InternalServerError", "internal_error"))
        return status, {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": code}}
    else:
        status, kind, code = 500, "InternalServerError", "internal_error"
    message = str(exc) or type(exc).__name__
    return status, {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None), "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    if status >= 500:
        log.warning("request failed", status=status, error=body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=error_headers(exc))


def error_headers(exc: BaseException) -> dict[str, str] | None:
    if isinstance(exc, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if not isinstance(exc, ResourceExhausted):
        return None
    headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, RateLimited):  # as OpenAI's: which limit, and when it has room again
        headers[f"x-ratelimit-limit-{exc.kind}"] = str(exc.limit)
        headers[f"x-ratelimit-reset-{exc.kind}"] = f"{exc.retry_after_s}s"
    return headers


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        message = f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return error_response(InvalidParameter(message))
    if not where:  # the body as a whole: not JSON at all, or not an object
        content_type = request.headers.get("content-type", "")
        hint = "" if "json" in content_type else f" (it was sent as {content_type or 'no content type'!r})"
        return error_response(InvalidParameter(f"the request body must be a JSON object with Content-Type: "
                                               f"application/json{hint}"))
    # With pydantic's error type, as pydantic words it (vLLM's clients match it, e.g. greater_than_equal).
    return error_response(InvalidParameter(f"{'.'.join(where)}: {first.get('msg')} [type={first.get('type')}]",
                                           where[0] if where else None))


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("request failed", error=repr(exc), exc_info=exc)
    return error_response(exc)


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for kind in (ValueError, TypeError, NotFound, ServiceUnavailable, ResourceExhausted, Unauthenticated, TimeoutError):
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))
    app.add_exception_handler(Exception, _internal_error)  # still an OpenAI error object, never a bare 500
