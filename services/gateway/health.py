"""Whether the gateway can serve, as /health, /ping and the gRPC health service say it: it cannot while no
scheduler serves, nor while the API key store (Redis) is unreachable, since every request that needs a
key would get 503 then. Load balancers and readiness probes read the 503 as "send traffic elsewhere";
the message says which of the two is missing."""

from __future__ import annotations

from services.gateway.auth import Authenticator
from services.gateway.generator import Generator


async def serving_problem(gen: Generator, auth: Authenticator | None) -> str | None:
    """None when the gateway can serve, else why not."""
    if not await gen.client.healthy():
        return f"the scheduler at {gen.client.address} is not reachable or not serving"
    if auth is not None and not await auth.store_reachable():
        return (f"degraded: the API key store ({auth.store.url}) is unreachable, so requests that need a key get "
                "503 until it answers")
    return None
