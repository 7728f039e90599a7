"""The API key every HTTP request must carry when the gateway has any (auth.py says whose it is)."""

from __future__ import annotations

from services.gateway.auth import OPEN_PATHS, Authenticator, DuplicateCredentials, single_authorization
from services.gateway.http_errors import error_response
from shared.grpc_errors import ServiceUnavailable, Unauthenticated

API_KEY = "pagedserve.api_key"  # where the auth middleware leaves the caller's ApiKey in the ASGI scope


class ApiKeyAuth:
    """Pure ASGI, innermost: every request but OPEN_PATHS' and CORS preflights needs a known API key
    (when the gateway has any); the caller's ApiKey goes into the scope for the rate limits."""

    def __init__(self, app, auth: Authenticator, metrics):
        self.app, self.auth, self.metrics = app, auth, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        try:
            authorization = single_authorization([value.decode("latin-1") for name, value in scope.get("headers") or ()
                                                  if name == b"authorization"])
            scope[API_KEY] = await self.auth.authenticate(authorization)
        except (Unauthenticated, ServiceUnavailable, DuplicateCredentials) as exc:
            if isinstance(exc, Unauthenticated):
                self.metrics.unauthenticated.inc()
            return await error_response(exc)(scope, receive, send)
        return await self.app(scope, receive, send)
