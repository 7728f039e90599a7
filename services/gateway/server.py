"""`pagedserve gateway`: the OpenAI HTTP API (uvicorn) and the public gRPC API (grpc.aio) in one
asyncio event loop, over one or more schedulers. Stateless: any number can run side by side.

On SIGTERM/SIGINT it stops accepting, gives in-flight requests --drain-timeout seconds, then fails
the rest with 503 (an error event, then [DONE], for a stream; UNAVAILABLE over gRPC) and closes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import signal

import uvicorn

from services.gateway.api_keys import RedisKeyStore, StaticKeys
from services.gateway.app import create_app
from services.gateway.auth import Authenticator
from services.gateway.generator import Generator
from services.gateway.grpc_api import HEALTH_SERVICES, NOT_SERVING, SERVING, create_grpc_server
from services.gateway.health import serving_problem
from services.gateway.http_limits import HttpLimits, make_room_for_connections
from services.gateway.http_protocol import LimitedHttpProtocol
from services.gateway.lora_modules import parse_lora_modules
from services.gateway.media import MediaOptions
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_files import ModelFiles
from services.gateway.options import gateway_options
from services.gateway.rate_limits import RateLimiter
from services.gateway.reasoning_parsers import REASONING_PARSERS, reasoning_flag_error
from services.gateway.resumption import ResumePolicy
from services.gateway.scheduler_pool import HEALTH_POLL_S, SchedulerPool
from services.gateway.tool_parsers import ToolCallParser, flag_error
from shared.gc_heap import freeze_startup_objects, unfreeze_startup_objects
from shared.grpc_errors import ServiceUnavailable
from shared.logging import setup_logging
from shared.option_env import apply_env_defaults
from shared.option_flags import ArgumentParser, add_options
from shared.tokenizer import import_tokenizer_library
from shared.tracing import start_tracing

log = setup_logging("gateway")

# After the drain timeout, what the requests still in flight get to say that they failed, before
# the servers close their connections.
FAREWELL_S = 2.0


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):
        # Signals are ours (they must stop the gRPC server too); uvicorn would re-raise them on exit.
        return contextlib.nullcontext()


async def _learn_model(gen: Generator) -> None:
    """Fetch the model info and load the tokenizer ahead of the first request; retry while the
    scheduler is not up yet (requests meanwhile get 503)."""
    # The import takes seconds: done while the scheduler starts, not after it answers.
    preload = asyncio.create_task(asyncio.to_thread(import_tokenizer_library))
    for attempt in itertools.count():
        try:
            await gen.model()
            break
        except Exception as exc:
            if attempt % 10 == 0:
                log.info("waiting for the scheduler", scheduler=gen.client.address, error=str(exc))
            await asyncio.sleep(min(1.0, 0.1 * 1.5 ** min(attempt, 8)))  # soon after a scheduler starting with us
    await preload
    # HTTP is already up: freeze (the tokenizer, above all) while no request is alive if that comes
    # soon. A live request's objects frozen with it are still freed by their reference counts; only
    # its garbage cycles would stay, so under constant traffic it freezes anyway.
    deadline = asyncio.get_running_loop().time() + 30.0
    while gen.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.5)
    freeze_startup_objects()


def build_auth(args: argparse.Namespace) -> tuple[Authenticator, RateLimiter | None]:
    """The keys requests must carry, and the rate limits of those kept in Redis."""
    store = RedisKeyStore(args.api_key_store, args.api_key_store_prefix) if args.api_key_store else None
    auth = Authenticator(StaticKeys(args.api_key) if args.api_key else None, store)
    return auth, RateLimiter(store.redis, store.prefix) if store is not None else None


async def _check_store(auth: Authenticator) -> None:
    """Say at start if the key store cannot be reached (requests get 503 until it can)."""
    try:
        await auth.store.redis.ping()
        log.info("API keys from Redis", store=auth.store.url)
    except Exception as exc:
        log.warning("API key store unreachable: requests get 503 until it answers", store=auth.store.url,
                    error=str(exc))


async def _report_health(gen: Generator, grpc_health, auth: Authenticator) -> None:
    """The gRPC health service says what HTTP /health says: SERVING while a scheduler serves and the key
    store answers (a gRPC-only probe must not keep sending traffic to a gateway that cannot serve)."""
    while True:
        try:
            status = SERVING if await serving_problem(gen, auth) is None else NOT_SERVING
        except Exception:  # (healthy() catches what it expects; nothing may end this loop)
            log.exception("health check failed")
            status = NOT_SERVING
        for service in HEALTH_SERVICES:
            await grpc_health.set(service, status)
        await asyncio.sleep(HEALTH_POLL_S)


async def serve(args: argparse.Namespace) -> None:
    metrics = GatewayMetrics()
    tracing = start_tracing("gateway", args.otlp_traces_endpoint)
    client = SchedulerPool.connect(args.scheduler, connect_timeout_s=args.connect_timeout,
                                   idle_timeout_s=args.backend_timeout, route_by_prefix=args.routing == "cached-prefix")
    client.start()
    auth, limiter = build_auth(args)
    if auth.store is not None:
        await _check_store(auth)
    resume_policy = ResumePolicy(args.max_resumes, args.resume_timeout) if args.max_resumes else None
    tool_parser = ToolCallParser(args.tool_call_parser) if args.enable_auto_tool_choice else None
    files = ModelFiles(tokenizer=args.tokenizer, tokenizer_revision=args.tokenizer_revision,
                       download_dir=args.download_dir, generation_config=args.generation_config,
                       override_generation_config=args.override_generation_config)
    gen = Generator(client, metrics, args.served_model_name, files, args.max_concurrent_requests, limiter,
                    resume_policy, tool_parser, args.lora_modules, args.trust_request_chat_template,
                    REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, tracing=tracing,
                    media=MediaOptions.from_args(args))
    grpc_server, grpc_health = create_grpc_server(gen, f"{args.host}:{args.grpc_port}", auth)
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    limits = HttpLimits.from_args(args)
    make_room_for_connections(limits)
    app = create_app(gen, origins, auth, args.allow_runtime_lora_updating, limits, args.enable_server_load_tracking,
                     args.enable_tokenizer_info_endpoint, tracing)
    http = _Uvicorn(uvicorn.Config(app, http=functools.partial(LimitedHttpProtocol, limits=limits),
                                   host=args.host, port=args.port, log_config=None,
                                   log_level="warning", access_log=False, lifespan="off",
                                   timeout_graceful_shutdown=args.drain_timeout + FAREWELL_S))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    for service in HEALTH_SERVICES:  # until the first poll has seen a scheduler serve
        await grpc_health.set(service, NOT_SERVING)
    await grpc_server.start()
    learn = asyncio.create_task(_learn_model(gen))
    health_task = asyncio.create_task(_report_health(gen, grpc_health, auth))
    http_task = asyncio.create_task(http.serve())
    log.info("gateway serving", http=f"{args.host}:{args.port}", grpc=f"{args.host}:{args.grpc_port}",
             scheduler=args.scheduler)
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait([stopping, http_task], return_when=asyncio.FIRST_COMPLETED)

    log.info("gateway stopping", in_flight=gen.in_flight)
    learn.cancel()
    health_task.cancel()
    for service in HEALTH_SERVICES:
        await grpc_health.set(service, NOT_SERVING)
    http.should_exit = True  # uvicorn closes its listener, then waits for open responses
    grpc_stopped = asyncio.ensure_future(grpc_server.stop(grace=args.drain_timeout + FAREWELL_S))
    await _drain(gen, args.drain_timeout)
    if gen.in_flight:  # an answer that says so, rather than a connection cut mid-response
        log.warning("drain timeout: failing the requests still in flight", in_flight=gen.in_flight)
        if gen.resumer is not None:
            gen.resumer.stopping = True  # they fail for good: not resumed
        client.abandon_requests(ServiceUnavailable("the gateway is shutting down; retry the request"))
    await asyncio.gather(http_task, grpc_stopped, return_exceptions=True)
    await gen.settle_charges()  # the last requests' tokens, before the store closes
    await client.close()
    await auth.close()
    if tracing is not None:
        await asyncio.to_thread(tracing.shutdown)  # the last requests' spans, to the collector
    unfreeze_startup_objects()
    log.info("gateway stopped")


async def _drain(gen: Generator, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while gen.in_flight and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)


def build_parser() -> argparse.ArgumentParser:
    """The gateway's flags (services/gateway/options.py; `pagedserve serve` takes them too)."""
    parser = ArgumentParser(prog="pagedserve gateway",
                            description="the pagedserve gateway: OpenAI HTTP API and public gRPC API")
    add_options(parser, gateway_options())
    return parser


def arguments_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags beyond what argparse checks (None: nothing). `pagedserve serve` asks
    too, before it starts any process: a check added here covers it."""
    if (error := flag_error(args.enable_auto_tool_choice, args.tool_call_parser)) is not None:
        return error
    if (error := reasoning_flag_error(args.reasoning_parser)) is not None:
        return error
    if args.max_resumes < 0 or not args.resume_timeout > 0:
        return "--max-resumes must be 0 or more and --resume-timeout positive"
    try:
        parse_lora_modules(args.lora_modules)
        HttpLimits.from_args(args)
        MediaOptions.from_args(args)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    if (error := arguments_error(args)) is not None:
        parser.error(error)
    args.lora_modules = parse_lora_modules(args.lora_modules)
    args.scheduler = [a.strip() for item in args.scheduler or ["127.0.0.1:50051"] for a in item.split(",") if a.strip()]
    run_event_loop(serve(args))
    return 0


def run_event_loop(main_coroutine):
    """Run on uvloop where it is installed (a dependency, but not on every platform): the gateway's
    cost per streamed token is mostly event-loop and socket work, which uvloop does in C
    (measured here: ~15 % less gateway CPU, with httptools for uvicorn's HTTP parsing)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main_coroutine)
    return uvloop.run(main_coroutine)
