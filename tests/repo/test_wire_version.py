"""Peers from another release are refused with a clear error, not misread."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent import futures

import grpc
import pytest

from services.gateway.generator import Generator
from services.gateway.metrics import GatewayMetrics
from services.scheduler.grpc_executor import GrpcExecutor
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import WorkerInfo
from shared.wire_version import INTERNAL_PROTOCOL_VERSION, IncompatiblePeer

INFO = WorkerInfo(model="m", num_kv_blocks=8, block_size=16, max_model_len=64, vocab_size=100,
                  eos_token_ids=(0,), device="cpu", dtype="float32")


def test_worker_info_carries_the_release_wire_version():
    assert WorkerInfo.from_proto(INFO.to_proto()).protocol_version == INTERNAL_PROTOCOL_VERSION


def test_worker_info_round_trips_its_host_tier():
    tiered = dataclasses.replace(INFO, num_cpu_blocks=96, num_cpu_offload_blocks=64)
    assert WorkerInfo.from_proto(tiered.to_proto()) == tiered


def test_worker_info_round_trips_its_kv_window():
    assert WorkerInfo.from_proto(INFO.to_proto()).kv_window is None  # unset: some layer sees everything
    windowed = dataclasses.replace(INFO, kv_window=4096)
    assert WorkerInfo.from_proto(windowed.to_proto()) == windowed


class OldWorker(wire_grpc.WorkerServicer):
    def __init__(self, version: int):
        self.version = version

    def GetInfo(self, request, context):
        reply = INFO.to_proto()
        reply.protocol_version = self.version
        return reply


@pytest.mark.parametrize("version", [0, INTERNAL_PROTOCOL_VERSION + 1])
def test_the_scheduler_refuses_a_worker_of_another_release(version):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    wire_grpc.add_WorkerServicer_to_server(OldWorker(version), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(IncompatiblePeer, match=f"version {version or 1}.*same pagedserve release"):
            GrpcExecutor(f"127.0.0.1:{port}", connect_timeout_s=10)
    finally:
        server.stop(grace=None)


class OldScheduler:
    address = "127.0.0.1:1"

    async def info(self):
        return wire.EngineInfo(model="m", max_model_len=64, vocab_size=100, max_logprobs=20)  # no version: 1


def test_the_gateway_refuses_a_scheduler_of_another_release():
    gen = Generator(OldScheduler(), GatewayMetrics())
    with pytest.raises(IncompatiblePeer, match="scheduler at 127.0.0.1:1 speaks internal protocol version 1"):
        asyncio.run(gen.model())
