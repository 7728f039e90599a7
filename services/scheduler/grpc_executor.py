"""The executor for a worker in another process: one long-lived bidirectional Steps stream.

Each step sends one plan (deltas only) and reads one result; keeping the stream open
avoids a call set-up per step. A plan may be sent while the one before it runs: the worker
takes them in order, so it finds the next one waiting when it finishes a step.
"""

from __future__ import annotations

import queue
from collections import deque

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_channels import STEP_MESSAGE_BYTES, channel_options
from shared.grpc_errors import ServiceUnavailable
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import StepPlan, StepResult, WorkerInfo
from shared.wire_version import IncompatiblePeer, check_peer_version

_CLOSE = object()


class GrpcExecutor:
    def __init__(self, address: str, connect_timeout_s: float = 60.0):
        self.address = address
        self._channel = grpc.insecure_channel(address, options=channel_options(STEP_MESSAGE_BYTES))
        self._stub = wire_grpc.WorkerStub(self._channel)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
            self._info = WorkerInfo.from_proto(self._stub.GetInfo(wire.Empty(), timeout=connect_timeout_s))
        except grpc.FutureTimeoutError as exc:
            self._channel.close()
            raise ServiceUnavailable(f"worker at {address} is not reachable (no connection within "
                                     f"{connect_timeout_s:g} s)") from exc
        except grpc.RpcError as exc:
            self._channel.close()
            raise ServiceUnavailable(f"worker at {address} is not reachable: {exc.details() or exc}") from exc
        try:
            check_peer_version("worker", address, self._info.protocol_version)
        except IncompatiblePeer:
            self._channel.close()
            raise
        self._plans: queue.SimpleQueue = queue.SimpleQueue()
        self._results = self._stub.Steps(iter(self._plans.get, _CLOSE))
        self._in_flight: deque[int] = deque()  # step ids of the plans sent and not yet answered, oldest first

    def worker_info(self) -> WorkerInfo:
        return self._info

    def worker_healthy(self, timeout_s: float = 1.0) -> bool:
        """The worker's own health service says SERVING (checked while idle, so a dead worker is
        noticed before a request fails on it)."""
        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stream_ended(self) -> bool:
        """The Steps stream is over (the worker went away, or restarted): no step can run on it."""
        return self._results.done()

    def submit(self, plan: StepPlan) -> None:
        self._plans.put(plan.to_proto())
        self._in_flight.append(plan.step_id)

    def wait(self) -> StepResult:
        if not self._in_flight:
            raise RuntimeError("wait() without a submitted plan")
        step_id = self._in_flight.popleft()
        try:
            result = next(self._results)
        except (grpc.RpcError, StopIteration) as exc:
            detail = exc.details() if isinstance(exc, grpc.RpcError) else "stream closed"
            raise ServiceUnavailable(f"worker at {self.address} failed: {detail}") from exc
        if result.step_id != step_id:
            raise ServiceUnavailable(f"worker at {self.address} answered step {result.step_id} for {step_id}")
        return StepResult.from_proto(result)

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.wait()

    def shutdown(self) -> None:
        self._plans.put(_CLOSE)
        self._channel.close()
