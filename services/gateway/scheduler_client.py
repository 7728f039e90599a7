"""The gateway's grpc.aio client for the Scheduler service.

All of a gateway's requests share one Session stream to the scheduler (scheduler_session.py). Every wait
is bounded: a scheduler that is down or unreachable turns into ServiceUnavailable within
`connect_timeout_s`, unary calls carry a deadline, and a session silent for `idle_timeout_s` while
requests are in flight fails them.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.scheduler_session import Session, SubmitStream
from shared.grpc_channels import STEP_MESSAGE_BYTES, channel_options
from shared.grpc_errors import ServiceUnavailable, error_from_status
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.request import EngineRequest

CHANNEL_OPTIONS = channel_options(STEP_MESSAGE_BYTES)


class SchedulerClient:
    def __init__(self, address: str, connect_timeout_s: float = 2.0, call_timeout_s: float = 10.0,
                 idle_timeout_s: float = 120.0):
        self.address = address
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = wire_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._session: Session | None = None
        self._refusing: Exception | None = None  # set once shutting down: why new requests are refused

    async def _connected(self) -> None:
        """Wait (briefly) for a ready connection, so a dead scheduler fails fast rather than hangs.

        A refused connection fails at once (TRANSIENT_FAILURE; gRPC keeps retrying in the
        background, so a restarted scheduler is picked up); an unanswered one after the timeout.
        """
        deadline = asyncio.get_running_loop().time() + self.connect_timeout_s
        state = self._channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                raise ServiceUnavailable(f"the scheduler at {self.address} is not reachable (connection failed)")
            try:
                async with asyncio.timeout_at(deadline):
                    await self._channel.wait_for_state_change(state)
            except TimeoutError:
                raise ServiceUnavailable(f"the scheduler at {self.address} is not reachable "
                                         f"(no connection within {self.connect_timeout_s:g} s)") from None
            state = self._channel.get_state(try_to_connect=True)

    async def _unary(self, method, request):
        await self._connected()
        try:
            return await method(request, timeout=self.call_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _domain_error(exc, self.address) from None

    async def submit(self, request: EngineRequest) -> SubmitStream:
        """Its outputs as they come (an embedding request's one output carries the embedding)."""
        return (await self.open_session()).submit(request.to_proto())

    async def open_session(self) -> Session:
        """The Session stream, opened if there is none (first use, or the scheduler restarted). A pool of
        schedulers opens it before the first request, to hear what the scheduler's prefix caches hold."""
        if self._refusing is not None:
            raise self._refusing
        await self._connected()
        if self._refusing is not None:  # shutting down began while it waited: no new session
            raise self._refusing
        if self._session is None or self._session.closed:
            self._session = Session(self._stub, self.address, self.idle_timeout_s)
        return self._session

    @property
    def _live_session(self) -> Session | None:
        session = self._session
        return None if session is None or session.closed else session

    def cached_blocks(self, keys: list[int]) -> int:
        """How many of a prompt's first blocks (their routing keys) the scheduler's prefix caches hold."""
        session = self._live_session
        return 0 if session is None else session.prefix_index.cached_blocks(keys)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks its prefix caches hold, as far as this gateway knows (0 without a session)."""
        session = self._live_session
        return 0 if session is None else len(session.prefix_index)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted here that have not ended: the load a gateway balances over schedulers."""
        session = self._live_session
        return 0 if session is None else session.num_streams

    async def abort(self, request_id: str) -> bool:
        return (await self._unary(self._stub.Abort, api.AbortRequest(request_id=request_id))).found

    async def info(self) -> wire.EngineInfo:
        return await self._unary(self._stub.GetInfo, wire.Empty())

    async def stats(self) -> wire.EngineStats:
        return await self._unary(self._stub.GetStats, wire.Empty())

    async def healthy(self) -> bool:
        """The scheduler's grpc.health.v1 status (it turns NOT_SERVING when its worker fails)."""
        try:
            reply = await self._unary(self._health.Check, health_pb2.HealthCheckRequest())
        except Exception:  # unreachable, or something else answers there (UNIMPLEMENTED): not serving
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def abandon_requests(self, error: Exception) -> None:
        """Fail every request in flight with error, and any submitted from now on (a shutdown that
        cannot wait for them any longer; one still tokenizing would otherwise open a new session)."""
        self._refusing = error
        if self._session is not None:
            self._session.abandon(error)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        await self._channel.close()


def _domain_error(exc: grpc.aio.AioRpcError, address: str) -> Exception:
    error = error_from_status(exc)
    if isinstance(error, ServiceUnavailable):  # say which backend, so the 503 message is actionable
        return ServiceUnavailable(f"the scheduler at {address} is unavailable: {exc.details()}")
    return error
