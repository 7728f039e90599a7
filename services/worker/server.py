"""The worker as a gRPC service: one Worker behind the Steps stream."""

from __future__ import annotations

import argparse
import dataclasses
import queue
import signal
import threading
from concurrent import futures
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.config import EngineConfig
from shared.grpc_errors import ServiceUnavailable, grpc_errors
from shared.logging import setup_logging
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import StepPlan

log = setup_logging("worker")


class ComputeThread:
    """Runs the worker's steps on one chosen thread: the process's main thread, which serve() lends.

    gRPC calls handlers on pool threads, but torch's OpenMP regions started from a thread other
    than the main one cost more to open: measured here, small elementwise ops ran 1.7-2x slower and a
    whole offline run 10 % slower from a second thread. So the handler hands each plan over and
    waits for its result (a queue hop per step, tens of microseconds).
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False

    def call(self, fn, *args):
        """Run fn(*args) on the compute thread and return its result (or raise its exception)."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        if self._closed:  # the loop may have drained the queue already: do not wait forever
            self._fail_pending()
        return future.result()

    def serve_until(self, stop: threading.Event, poll_s: float = 0.2) -> None:
        """The compute thread's loop: run jobs as they come until stop is set; later ones fail."""
        while not stop.is_set():
            try:
                future, fn, args = self._jobs.get(timeout=poll_s)
            except queue.Empty:
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # back to the handler, which maps it to a status
                future.set_exception(exc)
        self._closed = True
        self._fail_pending()

    def _fail_pending(self) -> None:
        while True:
            try:
                future, _, _ = self._jobs.get_nowait()
            except queue.Empty:
                return
            future.set_exception(ServiceUnavailable("the worker is shutting down"))


class WorkerServicer(wire_grpc.WorkerServicer):
    def __init__(self, worker, compute: ComputeThread):
        self.worker = worker
        self.compute = compute
        self._busy = threading.Lock()  # one scheduler drives a worker at a time
        self._requests: dict[int, str] = {}  # seq id -> request id, for log lines

    def _log_sequences(self, plan: StepPlan) -> None:
        """One line per sequence started or dropped, with its request id (not per token)."""
        for seq_id in plan.finished_seq_ids:
            log.info("sequence dropped", request_id=self._requests.pop(seq_id, None), seq_id=seq_id)
        for new in plan.new:
            self._requests[new.seq_id] = new.request_id
            log.info("sequence started", request_id=new.request_id, seq_id=new.seq_id,
                     prompt_tokens=len(new.prompt_token_ids), cached_tokens=new.num_computed_tokens)
        for fork in plan.forks:
            request_id = self._requests.get(fork.parent_seq_id)
            self._requests[fork.child_seq_id] = request_id
            log.info("sequence forked", request_id=request_id, seq_id=fork.child_seq_id, parent=fork.parent_seq_id)

    def GetInfo(self, request, context):
        with grpc_errors(context):
            return self.worker.info.to_proto()

    def Steps(self, request_iterator, context):
        if not self._busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler is driving this worker")
        try:
            log.info("scheduler connected", peer=context.peer())
            for message in request_iterator:
                with grpc_errors(context):
                    plan = StepPlan.from_proto(message)
                    self._log_sequences(plan)
                    yield self.compute.call(self.worker.execute, plan).to_proto()
        finally:
            self.worker.seqs.clear()  # a new scheduler starts from nothing
            self._requests.clear()
            self._busy.release()
            log.info("scheduler disconnected")


def serve(config: EngineConfig, address: str, ready: threading.Event | None = None) -> None:
    from services.worker.worker import Worker

    worker = Worker(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    compute = ComputeThread()
    wire_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, compute), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([wire.DESCRIPTOR.services_by_name["Worker"].full_name,
                                         reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    server.add_insecure_port(address)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("worker serving", address=address, info=dataclasses.asdict(worker.info))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    compute.serve_until(stop)  # this (main) thread runs the steps until a signal
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=5).wait()
    log.info("worker stopped")


GRPC_OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def main(argv: list[str] | None = None) -> int:
    from pagedserve.cli import add_engine_args, apply_env_defaults, engine_options

    parser = argparse.ArgumentParser(prog="pagedserve worker", description="a pagedserve worker (gRPC)")
    add_engine_args(parser)
    parser.add_argument("--listen", default="127.0.0.1:50061", help="address to serve the worker API on")
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    serve(EngineConfig(**engine_options(args)), args.listen)
    return 0
