"""API keys: what a key may do, and where keys live (given on the command line, or in Redis).

A key is never stored, only its SHA-256 (a leaked store leaks no key). In Redis, under a prefix:

    {prefix}key:{sha256 hex}   hash: name, requests_per_minute, tokens_per_minute, created
    {prefix}names              hash: name -> sha256 hex (names are unique: list and revoke by name)

`pagedserve api-keys create|list|revoke` manages them; every gateway pointed at the same Redis
sees a change at its next request (lookups are not cached, so a revoked key stops at once).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
import urllib.parse
from dataclasses import dataclass

DEFAULT_PREFIX = "pagedserve:api_keys:"
KEY_PREFIX = "ps-"  # what a made key starts with, so it is recognisable in a config file or a leak scanner


@dataclass(frozen=True)
class ApiKey:
    """Who is calling, and their limits (None: unlimited)."""
    name: str
    key_id: str  # the key's SHA-256, hex: rate windows are counted under it
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt plus completion tokens

    def __post_init__(self):
        for field, value in (("requests_per_minute", self.requests_per_minute),
                             ("tokens_per_minute", self.tokens_per_minute)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer or None, got {value!r}")

    @property
    def is_limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class StaticKeys:
    """Keys given to the gateway itself (--api-key): no limits, named by their position."""

    def __init__(self, keys: list[str]):
        if any(not key for key in keys):
            raise ValueError("an --api-key must not be empty")
        self._ids = [key_id(key) for key in keys]

    async def lookup(self, key: str) -> ApiKey | None:
        wanted = key_id(key)
        found = None
        for i, known in enumerate(self._ids):  # compare with every key, in constant time each
            if hmac.compare_digest(known, wanted):
                found = ApiKey(name=f"api-key-{i}", key_id=known)
        return found


class RedisKeyStore:
    """Keys in Redis, shared by every gateway (and the `pagedserve api-keys` command)."""

    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX):
        import redis.asyncio  # only a deployment that keeps keys in Redis needs the client

        self.url = redacted_url(url)  # for messages and logs
        self.prefix = prefix
        self.redis = redis.asyncio.Redis.from_url(url, decode_responses=True, socket_timeout=2.0,
                                                  socket_connect_timeout=2.0)

    def _key(self, ident: str) -> str:
        return f"{self.prefix}key:{ident}"

    async def lookup(self, key: str) -> ApiKey | None:
        ident = key_id(key)
        fields = await self.redis.hgetall(self._key(ident))
        return _from_fields(ident, fields) if fields else None

    async def create(self, name: str, requests_per_minute: int | None = None,
                     tokens_per_minute: int | None = None) -> tuple[str, ApiKey]:
        """A new key (shown once, never stored) and its record; a name already in use is refused."""
        if not name or not name.isprintable():
            raise ValueError(f"a key's name must be a non-empty printable string, got {name!r}")
        key = new_key()
        record = ApiKey(name, key_id(key), requests_per_minute, tokens_per_minute)
        if not await self.redis.hsetnx(f"{self.prefix}names", name, record.key_id):
            raise ValueError(f"a key named {name!r} exists already: revoke it first, or pick another name")
        fields = {"name": name, "created": str(int(time.time()))}
        for field in ("requests_per_minute", "tokens_per_minute"):
            if getattr(record, field) is not None:
                fields[field] = str(getattr(record, field))
        await self.redis.hset(self._key(record.key_id), mapping=fields)
        return key, record

    async def list(self) -> list[tuple[ApiKey, int]]:
        """Every key's record and when it was made (unix seconds), by name."""
        names = await self.redis.hgetall(f"{self.prefix}names")
        records = []
        for name in sorted(names):
            fields = await self.redis.hgetall(self._key(names[name]))
            if fields:
                records.append((_from_fields(names[name], fields), int(fields.get("created", 0))))
        return records

    async def revoke(self, name: str) -> bool:
        """False when no key has that name."""
        ident = await self.redis.hget(f"{self.prefix}names", name)
        if ident is None:
            return False
        await self.redis.delete(self._key(ident))
        await self.redis.hdel(f"{self.prefix}names", name)
        return True

    async def close(self) -> None:
        await self.redis.aclose()


def redacted_url(url: str) -> str:
    """The URL without its password (redis://user:secret@host -> redis://user:***@host)."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.hostname + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def _from_fields(ident: str, fields: dict[str, str]) -> ApiKey:
    def limit(field: str) -> int | None:
        return int(fields[field]) if fields.get(field) else None

    return ApiKey(fields.get("name", ident[:12]), ident, limit("requests_per_minute"), limit("tokens_per_minute"))
