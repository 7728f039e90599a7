"""The worker as a gRPC service: one Worker behind the Steps stream."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import signal
import sys
import threading
from concurrent import futures
from concurrent.futures import Future

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.worker.options import worker_options
from shared.config import EngineConfig
from shared.gc_heap import freeze_startup_objects, unfreeze_startup_objects
from shared.grpc_channels import SERVER_OPTIONS
from shared.grpc_errors import ServiceUnavailable, grpc_errors
from shared.logging import setup_logging
from shared.option_env import apply_env_defaults
from shared.option_flags import ArgumentParser, add_options
from shared.options import from_args, refusal
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import StepPlan
from shared.tracing import Tracing, start_tracing

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

    def submit(self, fn, *args) -> Future:
        """Queue fn(*args) for the compute thread (jobs run in the order queued); its future."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        if self._closed:  # the loop may have drained the queue already: do not wait forever
            self._fail_pending()
        return future

    def call(self, fn, *args):
        """Run fn(*args) on the compute thread and return its result (or raise its exception)."""
        return self.submit(fn, *args).result()

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
    def __init__(self, worker, compute: ComputeThread, tracing: Tracing | None = None):
        self.worker = worker
        self.compute = compute
        self.tracing = tracing  # --otlp-traces-endpoint's: a span per step of a traced request (step_spans.py)
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

    def ReadBlocks(self, request, context):
        """A decode worker reads this (prefill) worker's blocks: on this handler's thread, beside the compute
        (kv_transfer.py says why that is safe)."""
        from services.worker.kv_transfer import read_blocks

        with grpc_errors(context):
            yield from read_blocks(self.worker.device_pools, list(request.block_ids))

    def Steps(self, request_iterator, context):
        """Plans in, results out, in order. A reader thread queues each plan for the compute thread
        as it arrives, so a plan sent while the previous step runs (async scheduling) starts the
        moment that step ends, without a hop back through this handler."""
        if not self._busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler is driving this worker")
        stream = _StepStream(self.worker, self.compute, self._step_spans())
        try:
            log.info("scheduler connected", peer=context.peer())
            threading.Thread(target=stream.read, args=(request_iterator, self._log_sequences), name="plan-reader",
                             daemon=True).start()
            while (item := stream.results.get()) is not _END:
                if isinstance(item, BaseException):
                    with grpc_errors(context):
                        raise item
                yield item
        finally:
            if self.worker.tp.size > 1:
                leave_the_group()
            stream.closed.set()  # steps still queued are skipped; then the worker forgets everything
            try:
                self.compute.call(self._forget_all)
            except ServiceUnavailable:  # the compute thread has stopped: nothing runs any more
                self._forget_all()
            self._busy.release()
            log.info("scheduler disconnected")

    def _forget_all(self) -> None:
        self.worker.forget_all()  # a new scheduler starts from nothing
        self._requests.clear()

    def _step_spans(self):
        """A stream's spans of its steps (its sequences' trace contexts start empty, as the worker's state)."""
        if self.tracing is None:
            return None
        from services.worker.step_spans import StepSpans

        return StepSpans(self.tracing.tracer, self.worker.tp.rank)


_END = object()
# A tensor-parallel rank whose scheduler went away (or whose step failed) exits with this code.
EXIT_GROUP_BROKEN = 75


def leave_the_group() -> None:
    """A rank cannot tell where its peers are: one may be waiting in a collective for a step this rank
    will now skip, or may have died. So it exits at once, whatever it is running; its supervisor starts
    it again (the launcher the whole group, compose each rank), and the ranks meet anew."""
    log.warning("tensor-parallel rank leaving: its scheduler went away or a step failed; its group must meet anew")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_GROUP_BROKEN)


class _StepStream:
    """One scheduler's Steps stream: its plans, run on the compute thread, and their results."""

    def __init__(self, worker, compute: ComputeThread, spans=None):
        self.worker = worker
        self.compute = compute
        self.spans = spans  # a StepSpans when tracing; None: the steps run as they are
        self.results: queue.SimpleQueue = queue.SimpleQueue()  # result protos, an exception, then _END
        self.closed = threading.Event()  # the stream ended: queued steps are void
        self._failed = False

    def read(self, request_iterator, on_plan) -> None:
        """The reader thread: convert each plan and queue it; _END follows the last one queued."""
        try:
            for message in request_iterator:
                if self.closed.is_set():
                    break
                plan = StepPlan.from_proto(message)
                on_plan(plan)
                if plan.pulls:  # read while the step before it runs
                    self.worker.kv_puller.prefetch(plan)
                self._queue(self._run, plan, self.spans.links_for(plan) if self.spans is not None else None)
        except Exception as exc:  # a malformed plan, or the stream broke (then nobody reads this)
            self._queue(self.results.put, exc)  # after the results of the steps queued before it
        self._queue(self.results.put, _END)

    def _queue(self, fn, *args) -> None:
        future = self.compute.submit(fn, *args)
        future.add_done_callback(lambda f: f.exception() is not None and self.results.put(f.exception()))

    def _run(self, plan: StepPlan, links: list | None) -> None:
        """links: the step's to its traced requests (StepSpans); none: no span."""
        if self._failed or self.closed.is_set():
            return  # after a failed step the worker's state no longer matches the scheduler's
        try:
            result = self.spans.run(plan, links, self.worker.execute) if links else self.worker.execute(plan)
            self.results.put(result.to_proto())
        except Exception as exc:
            self._failed = True
            self.results.put(exc)


def serve(config: EngineConfig, address: str, tensor_parallel_rank: int = 0,
          distributed_init_method: str | None = None, tracing: Tracing | None = None) -> None:
    from services.worker.tensor_parallel import leave_group
    from services.worker.worker import Worker

    worker = Worker(config, tensor_parallel_rank, distributed_init_method)
    freeze_startup_objects()  # the model's modules and parameters, among others
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    compute = ComputeThread()
    wire_grpc.add_WorkerServicer_to_server(WorkerServicer(worker, compute, tracing), server)
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
    if tracing is not None:
        tracing.shutdown()  # the last steps' spans, to the collector
    leave_group(worker.tp)
    worker.kv_puller.close()
    unfreeze_startup_objects()
    log.info("worker stopped")


def build_parser() -> argparse.ArgumentParser:
    """The worker's flags (services/worker/options.py; `pagedserve serve` takes them too)."""
    parser = ArgumentParser(prog="pagedserve worker", description="a pagedserve worker (gRPC)")
    add_options(parser, worker_options())
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    if (error := refusal(EngineConfig, args)) is not None:
        parser.error(error)
    serve(from_args(EngineConfig, args), args.listen, args.tensor_parallel_rank, args.distributed_init_method,
          start_tracing("worker", args.otlp_traces_endpoint))
    return 0
