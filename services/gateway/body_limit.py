"""The request body's size limit (--http-max-body-size): a body over it is refused with 413 before the app
parses any of it: at once when its Content-Length says so, else (a chunked body) as soon as it passes the
limit, without keeping what came."""

from __future__ import annotations

from starlette.exceptions import HTTPException


class RequestTooLarge(HTTPException):
    """A request body over the limit (an HTTPException, so that a handler reading the body passes it on)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes (--http-max-body-size)")


class BodySizeLimit:
    """Pure ASGI, outside the app's routes."""

    def __init__(self, app, max_bytes: int, refuse):
        """refuse(exc) -> the ASGI response for an error (http_errors.py's error_response)."""
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            declared = declared_length(scope)
        except ValueError as exc:
            return await self.refuse(exc)(scope, receive, send)
        if declared is not None and declared > self.max_bytes:
            return await self.refuse(RequestTooLarge(self.max_bytes))(scope, receive, send)
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, receive_within_limit, send)


def declared_length(scope) -> int | None:
    """The request's Content-Length (None: none given, as with a chunked body)."""
    values = [value for name, value in scope.get("headers") or () if name == b"content-length"]
    if not values:
        return None
    if len(set(values)) > 1 or not values[0].isdigit():
        raise ValueError(f"Content-Length must be one number of bytes, got {b', '.join(values).decode('latin-1')!r}")
    return int(values[0])
