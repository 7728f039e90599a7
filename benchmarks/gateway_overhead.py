"""The gateway's own cost per streamed token, without a model in the way.

A stand-in scheduler (a real gRPC Scheduler service in its own process, no engine behind it)
answers every request with one token per "step", a step every --step-ms for all requests in
flight, the way the real scheduler's Session stream does; the real gateway process turns them
into SSE for the serving benchmark's load generator. Reported: CPU microseconds per streamed
token of the gateway, the stand-in and the load generator (CPU time is steadier than throughput
on a shared machine, and on a small one every CPU-second the front end spends is taken from
the worker).

    python benchmarks/gateway_overhead.py --num-requests 100 --rounds 3
    python benchmarks/gateway_overhead.py --endpoints completions chat/completions responses  # the APIs side by side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import cpu_seconds, run_load  # noqa: E402
from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402
from services.gateway.server import run_event_loop  # noqa: E402
from tests.services_harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


async def serve_stand_in(port: int, model_dir: str, step_s: float) -> None:
    """A Scheduler service that streams one token per request per step (no engine behind it)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from shared.proto import pagedserve_internal_pb2 as wire
    from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
    from shared.tokenizer import load_tokenizer
    from shared.wire_version import INTERNAL_PROTOCOL_VERSION

    tokenizer = load_tokenizer(model_dir)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    # Tokens the tokenizer knows (a trained model emits those), never a special one.
    tokens = [t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)]

    class StandIn(wire_grpc.SchedulerServicer):
        async def GetInfo(self, request, context):
            return wire.EngineInfo(model=model_dir, max_model_len=4096, vocab_size=vocab, eos_token_ids=[2],
                                   num_kv_blocks=1 << 16, block_size=16, max_logprobs=20,
                                   protocol_version=INTERNAL_PROTOCOL_VERSION)

        async def GetStats(self, request, context):
            return wire.EngineStats()

        async def Session(self, request_iterator, context):
            left: dict[int, int] = {}  # key -> tokens still to send
            rng = random.Random(0)

            async def read():
                async for message in request_iterator:
                    if message.HasField("submit"):
                        left[message.submit.key] = message.submit.request.params.max_tokens
                    else:
                        left.pop(message.abort, None)

            reader = asyncio.create_task(read())
            try:
                while not reader.done() or left:
                    await asyncio.sleep(step_s)
                    if not left:
                        continue
                    events = wire.SessionEvents()  # as the scheduler sends them: tokens as columns
                    for position, key in enumerate(list(left)):
                        left[key] -= 1
                        if left[key]:
                            events.tokens.keys.append(key)
                            events.tokens.seq_indexes.append(0)
                            events.tokens.num_tokens.append(1)
                            events.tokens.token_ids.append(rng.choice(tokens))
                        else:  # the last token comes with its finish reason, as a whole output
                            del left[key]
                            events.detailed.add(key=key, new_token_ids=[rng.choice(tokens)], finish_reason="length")
                            events.detailed_positions.append(position)
                            events.finished.append(key)
                    yield events
            finally:
                reader.cancel()

    server = grpc.aio.server()
    wire_grpc.add_SchedulerServicer_to_server(StandIn(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a process exited while starting")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError("the gateway did not become ready")


def one_round(base_url: str, model: str, requests, pids: dict[str, int], concurrency: int,
              endpoint: str = "completions") -> dict:
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    results, elapsed = run_event_loop(run_load(f"{base_url}/v1", model, requests, None, concurrency, 0, endpoint))
    tokens = sum(r["output_len"] for r in results)
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    return {"endpoint": endpoint, "elapsed_s": elapsed, "tokens": tokens, "chunks_with_text": sum(len(r["arrivals"]) for r in results),
            "cpu_us_per_token": {name: 1e6 * seconds / tokens for name, seconds in cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--step-ms", type=float, default=20.0, help="the stand-in's time between steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--endpoints", nargs="+", default=["completions"],
                        choices=["completions", "chat/completions", "responses"],
                        help="APIs to stream through, alternating within each round")
    parser.add_argument("--stand-in-port", type=int, default=None, help=argparse.SUPPRESS)  # the child's role
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "gateway_overhead.json"))
    args = parser.parse_args()
    model_dir = str(bench_model_dir())
    if args.stand_in_port is not None:
        run_event_loop(serve_stand_in(args.stand_in_port, model_dir, args.step_ms / 1000))
        return

    scheduler_port, http_port = free_port(), free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    stand_in = subprocess.Popen([sys.executable, __file__, "--stand-in-port", str(scheduler_port),
                                 "--step-ms", str(args.step_ms)], cwd=REPO, env=env, start_new_session=True)
    gateway = subprocess.Popen([sys.executable, "-m", "pagedserve", "gateway", "--port", str(http_port),
                                "--grpc-port", str(free_port()), "--scheduler", f"127.0.0.1:{scheduler_port}"],
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    base_url = f"http://127.0.0.1:{http_port}"
    requests = bench_workload(args.num_requests, 0)
    pids = {"gateway": gateway.pid, "stand-in scheduler": stand_in.pid, "load generator": os.getpid()}
    try:
        wait_healthy(base_url, [stand_in, gateway])
        model = Path(model_dir).name
        for endpoint in args.endpoints:  # warm-up
            one_round(base_url, model, requests, pids, args.concurrency, endpoint)
        rounds = [one_round(base_url, model, requests, pids, args.concurrency, endpoint)
                  for _ in range(args.rounds) for endpoint in args.endpoints]
    finally:
        for proc in (gateway, stand_in):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in (gateway, stand_in):
            proc.wait(timeout=30)
    medians = {endpoint: {name: statistics.median(r["cpu_us_per_token"][name] for r in rounds if r["endpoint"] == endpoint)
                          for name in pids} for endpoint in args.endpoints}
    report = {"num_requests": args.num_requests, "concurrency": args.concurrency, "step_ms": args.step_ms,
              "rounds": rounds, "median_cpu_us_per_token": medians[args.endpoints[0]],
              "median_cpu_us_per_token_by_endpoint": medians}
    for endpoint, median in medians.items():
        for name, us in median.items():
            print(f"/v1/{endpoint}: {name}: {us:.1f} CPU µs per streamed token (median of {args.rounds} rounds)",
                  file=sys.stderr)
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
