"""The gateway's own state, open to every caller (auth.py's OPEN_PATHS): GET /health (and SageMaker's /ping),
/version, /metrics (Prometheus') and, with --enable-server-load-tracking, vLLM's /load."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from services.gateway.auth import Authenticator
from services.gateway.generator import Generator
from services.gateway.health import serving_problem
from services.gateway.http_errors import error_response
from services.gateway.openapi import documented
from services.gateway.server_load import ServerLoad
from shared.grpc_errors import ServiceUnavailable
from shared.version import __version__


def router(gen: Generator, auth: Authenticator | None, load: ServerLoad | None) -> APIRouter:
    """load: the requests in flight /load reports (None: no /load)."""
    routes = APIRouter()

    @routes.get("/version", responses=open_doc())
    async def version():
        return {"version": __version__}

    @routes.get("/health", responses=open_doc(503))
    @routes.get("/ping", responses=open_doc(503), operation_id="ping_get")  # SageMaker's (as vLLM's: /health)
    @routes.post("/ping", responses=open_doc(503), operation_id="ping_post")
    async def health():
        problem = await serving_problem(gen, auth)
        return {"status": "ok"} if problem is None else error_response(ServiceUnavailable(problem))

    if load is not None:
        @routes.get("/load", responses=open_doc())
        async def server_load():
            return {"server_load": load.in_flight}

    @routes.get("/metrics", response_class=PlainTextResponse, responses=open_doc())
    async def metrics():
        stats = await gen.client.stats()
        return Response(gen.metrics.render(stats, gen.client.routable(), gen.known_model_name(),
                                           gen.client.prefix_blocks_known()),
                        media_type=CONTENT_TYPE_LATEST)

    return routes


def open_doc(*statuses: int) -> dict:
    """What /openapi.json says an open route answers: no 401, whatever the gateway's keys."""
    return documented(*statuses, keyed=False)

