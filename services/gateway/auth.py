"""Who is calling: the API key of an HTTP request's `Authorization: Bearer` header or a gRPC call's
`authorization` metadata, checked against the gateway's keys (--api-key) and the Redis key store
(--api-key-store). Without either, the gateway is open, as vLLM's is without --api-key.

Open to everyone whatever the setting: /health (and /ping), /metrics, /load, /version, the OpenAPI docs
and the gRPC health service (probes, scrapers and load-aware routers carry no keys), and CORS preflights
(browsers send them without credentials).
"""

from __future__ import annotations

from services.gateway.api_keys import ApiKey, RedisKeyStore, StaticKeys
from shared.grpc_errors import ServiceUnavailable, Unauthenticated
from shared.logging import setup_logging

log = setup_logging("gateway")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/load",
                        "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})  # (the API's own description)


class DuplicateCredentials(ValueError):
    """A request with more than one Authorization header (or gRPC authorization entry): which one counts would
    be a guess (a proxy may have added one), so neither does. A 400, or INVALID_ARGUMENT."""


def single_authorization(values: list[str], what: str = "Authorization headers") -> str | None:
    """The request's one Authorization value (None: none)."""
    if len(values) > 1:
        raise DuplicateCredentials(f"the request carries {len(values)} {what}: send one")
    return values[0] if values else None


class Authenticator:
    def __init__(self, static: StaticKeys | None = None, store: RedisKeyStore | None = None):
        self.static = static
        self.store = store
        self._store_down = False  # the last health check found it unreachable

    @property
    def enabled(self) -> bool:
        return self.static is not None or self.store is not None

    async def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The caller's key (None when the gateway is open), or Unauthenticated."""
        if not self.enabled:
            return None
        key = bearer_token(authorization)
        found = await self.static.lookup(key) if self.static is not None else None
        if found is None and self.store is not None:
            try:
                found = await self.store.lookup(key)
            except Exception as exc:  # redis' errors: the store is down, not the key wrong
                log.warning("API key store unreachable", store=self.store.url, error=str(exc))
                raise ServiceUnavailable("the API key store is unreachable; retry later") from exc
        if found is None:
            raise Unauthenticated(f"incorrect API key provided: {_masked(key)}")
        return found

    async def store_reachable(self) -> bool:
        """Whether the key store answers (True without one): /health says so. Logged when that changes (the
        health checks ask every second)."""
        if self.store is None:
            return True
        try:
            await self.store.redis.ping()
        except Exception as exc:  # redis' errors
            if not self._store_down:
                log.warning("API key store unreachable: /health says degraded", store=self.store.url, error=str(exc))
            self._store_down = True
            return False
        if self._store_down:
            log.info("API key store reachable again", store=self.store.url)
        self._store_down = False
        return True

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()


def bearer_token(authorization: str | None) -> str:
    if not authorization:
        raise Unauthenticated("no API key provided: send 'Authorization: Bearer <key>' (an HTTP header, or gRPC "
                              "metadata 'authorization')")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("the Authorization header must be 'Bearer <key>'")
    return token.strip()


def _masked(key: str) -> str:
    """Enough of a key to recognise it in an error, too little to use it (as OpenAI shows them)."""
    return f"{key[:3]}***{key[-4:]}" if len(key) > 10 else "***"
