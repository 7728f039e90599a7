"""Serving benchmark: requests over the OpenAI streaming API, at a Poisson rate or a fixed concurrency.

Reports TTFT, TPOT and ITL (p50, p99), request and output-token throughput, and the scheduler's
own share of each step; writes JSON. With --compare-offline it also runs the same requests
through the offline API in this process, so the stack's throughput is quoted against it from
one run: each round runs offline, serving, serving, offline (the stack stays up), so a drift of
the machine's speed that is linear over the round cancels; with --rounds N the ratio quoted is the
median of the rounds' ratios.

    python benchmarks/serving.py --num-requests 100 --concurrency 100 --compare-offline --rounds 5
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --request-rate 2    # a running server
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
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import (  # noqa: E402
    BenchRequest, bench_model_dir, bench_workload, greedy_inputs, wait_until_answering, write_report)
from pagedserve.launcher import STOP_ORDER, STOP_WAIT_S  # noqa: E402
from services.gateway.server import run_event_loop  # noqa: E402


class _StreamReader(asyncio.Protocol):
    """One streamed completion over HTTP/1.1 (Connection: close), read as it comes in the protocol's
    callbacks: no stream reader, no task per chunk. Each server-sent event ends in a blank line; the
    arrival time of every event that carries text is kept (events that land in one read share it)."""

    def __init__(self, request: bytes, done: asyncio.Future, marker: bytes = b'"text": "'):
        self.request, self.done = request, done
        self.marker, self._empty = marker, marker + b'"'  # what begins an event's new text; an empty one
        self.arrivals: list[float] = []
        self.status: bytes | None = None
        self._pending = b""  # bytes not yet part of a whole event (or, before the body, the headers)

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._pending += data
        if self.status is None:
            head, sep, rest = self._pending.partition(b"\r\n\r\n")
            if not sep:
                return
            self.status, self._pending = head.split(b" ", 2)[1], rest
        if self.status != b"200":
            return  # the error body is read whole when the server closes
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            if self.marker in event and self._empty not in event:
                self.arrivals.append(now)

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if exc is not None:
            self.done.set_exception(exc)
        elif self.status != b"200":
            self.done.set_exception(RuntimeError(f"HTTP {self.status}: {self._pending.decode(errors='replace')[:300]}"))
        else:
            self.done.set_result(None)


def stream_request(endpoint: str, model: str, request: BenchRequest) -> tuple[dict, bytes]:
    """A streamed request's body for one of the APIs, and the bytes that begin an event's new text there.

    Chat and Responses take text: a word per prompt token (about as many tokens)."""
    common = {"model": model, "temperature": 0, "stream": True, "ignore_eos": True}
    words = " ".join(["word"] * len(request.prompt_token_ids))
    if endpoint == "completions":
        return {**common, "prompt": request.prompt_token_ids, "max_tokens": request.output_len}, b'"text": "'
    if endpoint == "chat/completions":
        return ({**common, "messages": [{"role": "user", "content": words}], "max_tokens": request.output_len},
                b'"content": "')
    if endpoint == "responses":
        return {**common, "input": words, "max_output_tokens": request.output_len}, b'"delta": "'
    raise ValueError(f"unknown endpoint {endpoint!r}")


async def one_request(url: str, model: str, request: BenchRequest, endpoint: str = "completions") -> dict:
    """One streamed request; the arrival time of every chunk that carries text.

    The load generator shares the CPU with the server, so it must cost as little as possible: a
    bare HTTP/1.1 client as an asyncio protocol, one connection per request.
    """
    fields, marker = stream_request(endpoint, model, request)
    body = json.dumps(fields).encode()
    parts = urllib.parse.urlsplit(url)
    message = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    done = loop.create_future()
    transport, reader = await loop.create_connection(lambda: _StreamReader(message, done, marker), parts.hostname,
                                                     parts.port)
    try:
        await done
    finally:
        transport.close()
    return {"start": start, "end": time.perf_counter(), "arrivals": reader.arrivals, "output_len": request.output_len}


async def run_load(base_url: str, model: str, requests: list[BenchRequest], rate: float | None,
                   concurrency: int | None, seed: int, endpoint: str = "completions") -> tuple[list[dict], float]:
    limit = asyncio.Semaphore(concurrency or len(requests))
    rng = random.Random(seed)
    url = f"{base_url}/{endpoint}"

    async def limited(request):
        async with limit:
            return await one_request(url, model, request, endpoint)

    started = time.perf_counter()
    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(limited(request)))
        if rate:
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - started


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


def summarize(results: list[dict], elapsed: float) -> dict:
    ttft = [r["arrivals"][0] - r["start"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    tpot = [(r["end"] - r["arrivals"][0]) / (r["output_len"] - 1) for r in results
            if r["arrivals"] and r["output_len"] > 1]
    tokens = sum(r["output_len"] for r in results)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "requests_per_s": len(results) / elapsed, "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
            "itl_s": percentiles(itl)}


BREAKDOWN_KEYS = ("step_time_s", "forward_time_s", "sample_time_s", "scheduler_time_s", "num_steps")


def offline_engine(model_dir: Path):
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(model_dir))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    return llm


def run_offline(llm, requests: list[BenchRequest]) -> dict:
    prompts, params = greedy_inputs(requests)
    before = llm.stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    tokens = sum(r.output_len for r in requests)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "tokens_per_s": tokens / elapsed,
            "step_breakdown_s": {key: after[key] - before[key] for key in BREAKDOWN_KEYS}}


def one_round(llm, requests: list[BenchRequest], serve) -> dict:
    """Offline, serving, serving, offline: a drift of the machine's speed that is linear over the
    round cancels out of the ratio of the means (on a shared machine it drifts by tens of percent
    within minutes). Without an offline engine, one serving run."""
    if llm is None:
        return {"serving": [serve()]}
    offline, serving = [run_offline(llm, requests)], [serve(), serve()]
    offline.append(run_offline(llm, requests))
    return {"offline": offline, "serving": serving, "serving_over_offline": mean_tps(serving) / mean_tps(offline)}


def mean_tps(runs: list[dict]) -> float:
    return statistics.mean(run["tokens_per_s"] for run in runs)


def run_serving(base_url: str, model: str, requests: list[BenchRequest], args, processes: dict[int, str]) -> dict:
    before = engine_stats(base_url)
    cpu_before = {pid: cpu_seconds(pid) for pid in processes}
    # On uvloop, like the gateway: the load generator shares the cores it measures.
    results, elapsed = run_event_loop(run_load(base_url, model, requests, args.request_rate, args.concurrency,
                                               args.seed))
    # CPU each process used during the load: on a small machine the server's own processes and
    # the load generator compete with the worker for the same cores.
    cpu = {processes[pid]: cpu_seconds(pid) - cpu_before[pid] for pid in processes}
    after = engine_stats(base_url)
    report = summarize(results, elapsed)
    report["cpu_seconds"] = cpu
    step = after.get("step_time_s", 0) - before.get("step_time_s", 0)
    sched = after.get("scheduler_time_s", 0) - before.get("scheduler_time_s", 0)
    report["scheduler_share_of_step"] = sched / step if step else None
    # Where a step's wall time goes, seen from the scheduler: the worker's forward pass and
    # sampling, the scheduler's own planning, and the rest (transport, conversion, waiting).
    report["step_breakdown_s"] = {key: after.get(key, 0) - before.get(key, 0) for key in BREAKDOWN_KEYS}
    return report


def start_stack(model_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    """`pagedserve serve` (with extra arguments), once healthy; in a process group of its own. If it exits or
    hangs while starting, the error ends with the last of what it wrote to stderr."""
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir),
                             "--port", str(port), "--grpc-port", str(port + 1), *extra],
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        wait_until_answering(f"http://127.0.0.1:{port}/health", proc, 300, "pagedserve serve")
    except (RuntimeError, TimeoutError) as exc:
        proc.kill()
        log.seek(0)
        raise type(exc)(f"{exc}; its stderr ended:\n{log.read()[-3000:].decode(errors='replace')}") from exc
    return proc


def stop_stack(stack: subprocess.Popen) -> None:
    """SIGTERM to the stack's process group, then as long as the launcher's ordered stop may take (each stage
    STOP_WAIT_S, the children of a stage at once); anything left after that is killed. (A fixed 60 s wait was
    shorter than that stop: a loaded machine, with a restarted worker still starting, ran past it.)"""
    os.killpg(stack.pid, signal.SIGTERM)
    try:
        stack.wait(timeout=len(STOP_ORDER) * STOP_WAIT_S + 10)
    except subprocess.TimeoutExpired:
        os.killpg(stack.pid, signal.SIGKILL)
        stack.wait()


def served_model(base_url: str) -> str:
    """The id of the model a stack serves, from ``{base_url}/models``. A generous timeout: the gateway's first
    answer loads the tokenizer, seconds on a busy machine."""
    with urllib.request.urlopen(f"{base_url}/models", timeout=60) as response:
        return json.loads(response.read())["data"][0]["id"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_names(launcher_pid: int) -> dict[int, str]:
    """The launcher's children (gateway, scheduler, worker) by pid, named by their subcommand."""
    names = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == launcher_pid:
                argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
                role = next((a.decode() for a in argv if a in (b"gateway", b"scheduler", b"worker")), "other")
                names[int(stat.parent.name)] = role
        except (OSError, ValueError):
            continue
    return names


def engine_stats(base_url: str) -> dict:
    """The engine's counters, read from the gateway's Prometheus text."""
    root = base_url.rsplit("/v1", 1)[0]
    with urllib.request.urlopen(f"{root}/metrics", timeout=5) as response:
        return parse_engine_stats(response.read().decode())


def parse_engine_stats(metrics_text: str) -> dict[str, float]:
    """pagedserve_engine_<stat>{scheduler="..."} lines, summed over the gateway's schedulers."""
    stats: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("pagedserve_engine_") and " " in line:
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0].removeprefix("pagedserve_engine_")
            stats[name] = stats.get(name, 0.0) + float(value)
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=None, help="a running server's OpenAI base URL; else start one")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    parser.add_argument("--concurrency", type=int, default=None, help="fixed number of requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--compare-offline", action="store_true")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of offline, serving, serving, offline")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="run the workload once on each side, unmeasured, first")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "serving.json"))
    args = parser.parse_args()

    requests = bench_workload(args.num_requests, args.seed)
    report: dict = {"num_requests": len(requests), "request_rate": args.request_rate, "concurrency": args.concurrency}
    model_dir = bench_model_dir()
    llm = offline_engine(model_dir) if args.compare_offline else None
    stack = None
    base_url = args.base_url
    if base_url is None:
        stack = start_stack(model_dir, args.port)
        base_url = f"http://127.0.0.1:{args.port}/v1"
    rounds = []
    try:
        model = args.model or served_model(base_url)
        processes = process_names(stack.pid) if stack is not None else {}
        processes[os.getpid()] = "load generator"
        if args.warmup:  # first touches of the KV pools and allocator arenas, on both sides
            if llm is not None:
                run_offline(llm, requests)
            run_serving(base_url, model, requests, args, processes)
        for _ in range(args.rounds):
            rounds.append(one_round(llm, requests, lambda: run_serving(base_url, model, requests, args, processes)))
            if llm is not None:
                one = rounds[-1]
                print(f"round {len(rounds)}: offline {mean_tps(one['offline']):.1f} tok/s, serving "
                      f"{mean_tps(one['serving']):.1f} tok/s, ratio {one['serving_over_offline']:.3f}", file=sys.stderr)
    finally:
        if stack is not None:
            stop_stack(stack)
    report["rounds"] = rounds
    report["serving"] = rounds[-1]["serving"][-1]  # the last run in full; every run is in "rounds"
    if llm is not None:
        report["offline"] = rounds[-1]["offline"][-1]
        report["serving_over_offline"] = statistics.median(r["serving_over_offline"] for r in rounds)
        report["serving_over_offline_each_round"] = [round(r["serving_over_offline"], 3) for r in rounds]
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
