"""The gateway's grpc.aio client for the Scheduler service.

Every wait is bounded: a scheduler that is down or unreachable turns into
ServiceUnavailable within `connect_timeout_s`, unary calls carry a deadline, and
a Submit stream that goes silent for `idle_timeout_s` is cancelled.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_errors import ServiceUnavailable, error_from_status
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.sampling_params import SamplingParams

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    # Reconnect soon after a scheduler restart instead of backing off for up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class SubmitStream:
    """One request's EngineOutputs; cancel() (or leaving early) aborts it at the scheduler."""

    def __init__(self, call, address: str, idle_timeout_s: float):
        self._call = call
        self._address = address
        self._idle_timeout_s = idle_timeout_s

    def __aiter__(self):
        return self

    async def __anext__(self) -> wire.EngineOutput:
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that arrives
            # as a read completes, and a cancelled request would then run to its end.
            async with asyncio.timeout(self._idle_timeout_s):
                message = await self._call.read()
        except TimeoutError:
            self.cancel()
            raise ServiceUnavailable(f"the scheduler at {self._address} sent nothing for "
                                     f"{self._idle_timeout_s:g} s; the request was abandoned") from None
        except grpc.aio.AioRpcError as exc:
            raise _domain_error(exc, self._address) from None
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return message

    def cancel(self) -> None:
        # The scheduler aborts a request whose Submit stream is cancelled, freeing its blocks.
        self._call.cancel()


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

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> SubmitStream:
        await self._connected()
        request = wire.EngineRequest(request_id=request_id, prompt_token_ids=prompt_token_ids,
                                     params=params.to_proto())
        return SubmitStream(self._stub.Submit(request), self.address, self.idle_timeout_s)

    async def abort(self, request_id: str) -> bool:
        return (await self._unary(self._stub.Abort, api.AbortRequest(request_id=request_id))).found

    async def info(self) -> wire.EngineInfo:
        return await self._unary(self._stub.GetInfo, wire.Empty())

    async def stats(self) -> dict[str, float]:
        return dict((await self._unary(self._stub.GetStats, wire.Empty())).values)

    async def healthy(self) -> bool:
        """The scheduler's grpc.health.v1 status (it turns NOT_SERVING when its worker fails)."""
        try:
            reply = await self._unary(self._health.Check, health_pb2.HealthCheckRequest())
        except ServiceUnavailable:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self._channel.close()


def _domain_error(exc: grpc.aio.AioRpcError, address: str) -> Exception:
    error = error_from_status(exc)
    if isinstance(error, ServiceUnavailable):  # say which backend, so the 503 message is actionable
        return ServiceUnavailable(f"the scheduler at {address} is unavailable: {exc.details()}")
    return error
