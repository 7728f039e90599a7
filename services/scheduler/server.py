"""The scheduler as a gRPC service: each gateway keeps one Session stream for all its requests
(tokenized requests and aborts in, one batch of outputs per step out); the engine loop drives the
worker(s) over the Steps stream."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.scheduler.disaggregated_core import DisaggregatedCore
from services.scheduler.engine_core import EngineCore
from services.scheduler.engine_loop import EngineLoop
from services.scheduler.grpc_executor import GrpcExecutor
from services.scheduler.options import scheduler_options
from services.scheduler.scheduler import SchedulerLimits
from services.scheduler.session import Session, SessionBatch
from services.scheduler.stats import stats_to_proto
from services.scheduler.tensor_parallel_executor import TensorParallelExecutor, group_info
from shared.config import EngineConfig, token_budget
from shared.gc_heap import freeze_startup_objects, unfreeze_startup_objects
from shared.grpc_channels import SERVER_OPTIONS
from shared.grpc_errors import ServiceUnavailable, grpc_errors
from shared.logging import setup_logging
from shared.option_env import apply_env_defaults
from shared.option_flags import ArgumentParser, add_options
from shared.options import refusal
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.request import EngineRequest
from shared.tracing import Tracing, start_tracing
from shared.wire_version import INTERNAL_PROTOCOL_VERSION

log = setup_logging("scheduler")

# While requests run, a worker whose step has not come back for this long is probed for health.
STALLED_STEP_S = 5.0


class SchedulerServicer(wire_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop, max_logprobs: int):
        self.loop = loop
        self.max_logprobs = max_logprobs

    def Session(self, request_iterator, context):
        session = Session(context.peer())
        loop = self.loop  # a session belongs to the engine loop it opened on, even once that is replaced
        try:
            loop.open_session(session)
        except ServiceUnavailable as exc:
            _read_for_a_moment(request_iterator)
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(str(exc))
            return
        context.add_callback(lambda: loop.close_session(session))  # however the stream ends
        session.put(SessionBatch())  # the first message, empty: the session is taken (SessionEvents)
        reader = threading.Thread(target=self._read_requests, args=(request_iterator, session, loop),
                                  name="session-reader", daemon=True)
        reader.start()
        log.info("gateway session opened", peer=session.peer)
        with grpc_errors(context):
            for batch in session:
                yield batch.to_proto()
        log.info("gateway session closed", peer=session.peer)

    @staticmethod
    def _read_requests(request_iterator, session: Session, loop: EngineLoop) -> None:
        """Submissions and aborts from the gateway, handed to the engine loop without waiting."""
        try:
            for message in request_iterator:
                kind = message.WhichOneof("kind")
                if kind == "submit":
                    SchedulerServicer._submit(session, message.submit, loop)
                elif kind == "abort":
                    loop.abort_soon(session, message.abort)
                elif kind == "stop_sequence":
                    stop = message.stop_sequence
                    loop.stop_sequence_soon(session, stop.key, stop.seq_index, stop.stop_string)
        except grpc.RpcError:
            pass  # the stream broke; the callback closes the session
        except ServiceUnavailable:
            pass  # the engine is down or stopping; it ends or fails every open session itself
        except Exception:  # a malformed message or a bug: end this gateway's session, keep serving others
            log.exception("session reader failed", peer=session.peer)
        finally:
            loop.close_session(session)

    @staticmethod
    def _submit(session: Session, submit: wire.SessionSubmit, loop: EngineLoop) -> None:
        try:
            request = EngineRequest.from_proto(submit.request)
        except (ValueError, TypeError) as exc:
            session.refuse(submit.key, exc)
            return
        loop.submit(session, submit.key, request)

    def Abort(self, request, context):
        with grpc_errors(context):
            return api.AbortResponse(found=self.loop.abort(request.request_id))

    def GetInfo(self, request, context):
        info = self.loop.engine.info
        return wire.EngineInfo(model=info.model, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
                               eos_token_ids=info.eos_token_ids, num_kv_blocks=info.num_kv_blocks,
                               block_size=info.block_size, max_logprobs=self.max_logprobs,
                               protocol_version=INTERNAL_PROTOCOL_VERSION,
                               max_num_seqs=self.loop.engine.scheduler.limits.max_num_seqs,
                               max_loras=info.max_loras,
                               priority_scheduling=self.loop.engine.scheduler.limits.scheduling_policy == "priority",
                               pooler=info.pooler.to_proto() if info.pooler is not None else None,
                               image_token_id=info.image_token_id)

    def GetStats(self, request, context):
        with grpc_errors(context):
            return stats_to_proto(self.loop.stats())


def _read_for_a_moment(request_iterator, seconds: float = 0.2) -> None:
    """Take in what the client has sent before ending its call: a call ended with messages unread
    reaches the client as INTERNAL "Internal error from Core", not with the status given."""
    def read():
        try:
            for _ in request_iterator:
                pass
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, name="session-refusal", daemon=True)
    reader.start()
    reader.join(seconds)


def build_engine(worker_addresses: list[str], limits_from, watermark: float, max_logprobs: int,
                 enable_prefix_caching: bool, connect_timeout_s: float = 60.0,
                 tracing: Tracing | None = None) -> EngineCore:
    """Several addresses are the ranks of one tensor-parallel group, in rank order."""
    if len(worker_addresses) > 1:
        executor = TensorParallelExecutor(worker_addresses, connect_timeout_s)
    else:
        executor = GrpcExecutor(worker_addresses[0], connect_timeout_s)
        try:  # a rank of a group, alone, would wait in its first step for peers that never come
            group_info([executor.worker_info()], worker_addresses)
        except ValueError:
            executor.shutdown()
            raise
    limits = limits_from(executor.worker_info().max_model_len)
    return EngineCore(executor, limits, watermark, max_logprobs, enable_prefix_caching, tracing)


def build_disaggregated(prefill_addresses: list[str], decode_addresses: list[str], limits_from, watermark: float,
                        max_logprobs: int, enable_prefix_caching: bool, connect_timeout_s: float = 60.0,
                        tracing: Tracing | None = None, async_scheduling: bool = True) -> DisaggregatedCore:
    """One engine over prefill workers and decode workers (each reaches the prefill workers at these
    addresses too)."""
    executors: list[GrpcExecutor] = []
    try:
        for address in prefill_addresses + decode_addresses:
            executors.append(GrpcExecutor(address, connect_timeout_s))
        prefill = list(zip(executors[:len(prefill_addresses)], prefill_addresses))
        decode = list(zip(executors[len(prefill_addresses):], decode_addresses))
        limits = limits_from(decode[0][0].worker_info().max_model_len)
        return DisaggregatedCore(prefill, decode, limits, watermark, max_logprobs, enable_prefix_caching, tracing,
                                 async_scheduling)
    except BaseException:
        for executor in executors:
            executor.shutdown()
        raise


def serve(args: argparse.Namespace) -> None:
    def limits_from(max_model_len: int) -> SchedulerLimits:
        budget = token_budget(args.max_num_batched_tokens, args.enable_chunked_prefill, max_model_len)
        return SchedulerLimits(args.max_num_seqs, budget, args.enable_chunked_prefill, args.preemption_mode,
                               args.scheduling_policy)

    tracing = start_tracing("scheduler", args.otlp_traces_endpoint)

    def new_engine(connect_timeout_s: float = 60.0) -> EngineCore:
        if args.prefill_worker:
            return build_disaggregated(args.prefill_worker, args.decode_worker, limits_from, args.watermark,
                                       args.max_logprobs, args.enable_prefix_caching, connect_timeout_s, tracing,
                                       args.async_scheduling)
        return build_engine(args.worker, limits_from, args.watermark, args.max_logprobs, args.enable_prefix_caching,
                            connect_timeout_s, tracing)

    engine = new_engine(args.connect_timeout)
    freeze_startup_objects()
    loop = EngineLoop(engine, async_scheduling=args.async_scheduling)
    servicer = SchedulerServicer(loop, args.max_logprobs)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.max_streams), options=SERVER_OPTIONS)
    wire_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([wire.DESCRIPTOR.services_by_name["Scheduler"].full_name,
                                         reflection.SERVICE_NAME, health.SERVICE_NAME], server)
    server.add_insecure_port(args.listen)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("scheduler serving", address=args.listen, workers=args.worker, prefill_workers=args.prefill_worker,
             decode_workers=args.decode_worker, kv_blocks=engine.info.num_kv_blocks)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if loop.failed:  # its requests have failed; serve again as soon as a worker answers
            restarted = restart_engine(new_engine, args.async_scheduling)
            if restarted is not None:
                loop.stop()
                servicer.loop = loop = restarted
                engine = loop.engine
        # A dead worker (noticed by a failed step, or by probing it while idle) makes us NOT_SERVING;
        # requests then get UNAVAILABLE at once instead of hanging. While steps come back the worker
        # is plainly alive: a probe then would only wake its threads beside its compute. A worker
        # that is hung rather than dead answers no step, so a stalled step is probed too.
        busy = loop.num_in_flight() > 0 and loop.seconds_since_last_step() < STALLED_STEP_S
        silent = [] if busy or not loop.healthy else [e.address for e in engine.executors if not e.worker_healthy()]
        healthy = loop.healthy and not silent
        loop.refusing = None if healthy else f"the worker at {(silent or [engine.executor.address])[0]} is not answering"
        gone = [e.address for e in engine.executors if e.stream_ended()]
        if not loop.failed and loop.num_in_flight() == 0 and gone:
            loop.fail_if_idle(f"the worker at {gone[0]} went away")  # rebuilt once one answers
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING if healthy
                            else health_pb2.HealthCheckResponse.NOT_SERVING)
    drain(loop, health_servicer, args.drain_timeout)
    server.stop(grace=2).wait()
    loop.stop()
    if tracing is not None:
        tracing.shutdown()  # the last requests' spans, to the collector
    unfreeze_startup_objects()
    log.info("scheduler stopped")


def restart_engine(new_engine, async_scheduling: bool) -> EngineLoop | None:
    """A new engine on the worker (restarted, or the same one once it let go of the old stream),
    with fresh block tables: the old engine's requests have all been failed. None: not reachable yet."""
    try:
        engine = new_engine(connect_timeout_s=1.0)
    except ServiceUnavailable:
        return None
    except Exception:  # e.g. a worker of another release: keep refusing, and keep saying why
        log.exception("cannot restart the engine")
        return None
    log.info("engine restarted", kv_blocks=engine.info.num_kv_blocks)
    return EngineLoop(engine, async_scheduling=async_scheduling)


def drain(loop: EngineLoop, health_servicer, timeout_s: float) -> None:
    """Stop taking requests, let the running ones finish (up to timeout_s)."""
    health_servicer.enter_graceful_shutdown()
    loop.refusing = "the scheduler is shutting down"  # also on sessions already open: new ones get 503 at once
    deadline = time.monotonic() + timeout_s
    while loop.num_in_flight() and time.monotonic() < deadline and loop.healthy:
        time.sleep(0.1)
    log.info("drained", still_running=loop.num_in_flight())


def build_parser() -> argparse.ArgumentParser:
    """The scheduler's flags (services/scheduler/options.py; `pagedserve serve` takes them too)."""
    parser = ArgumentParser(prog="pagedserve scheduler", description="the pagedserve scheduler (gRPC)")
    add_options(parser, scheduler_options())
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    apply_env_defaults(parser)
    args = parser.parse_args(argv)
    if (error := refusal(EngineConfig, args)) is not None:  # its limits, checked as the worker checks them
        parser.error(error)
    if bool(args.prefill_worker) != bool(args.decode_worker) or args.prefill_worker and args.worker:
        parser.error("prefill/decode disaggregation takes --prefill-worker and --decode-worker (each at least once) "
                     "and no --worker")
    args.worker = args.worker or ([] if args.prefill_worker else ["127.0.0.1:50061"])
    try:
        serve(args)
    except (ServiceUnavailable, ValueError) as exc:  # no worker to start on, or one of another release
        log.error("scheduler cannot start", error=str(exc))
        print(f"pagedserve scheduler: {exc}", file=sys.stderr)
        return 1
    return 0
