"""What API keys cost a request: the gateway open, with a key of its own (--api-key), and with a
rate-limited key from the Redis store (--api-key-store: a key lookup and a rate-window check per
request, a token charge after it), each a real gateway process over one stand-in scheduler (no
model: see gateway_overhead.py), answering short non-streamed completions one at a time.

Reported per mode: median and p99 latency of a request, and the gateway's CPU per request. The
rounds alternate the modes, so the machine's noise falls on all of them alike.

    python benchmarks/auth_overhead.py --num-requests 300 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2 as httpx  # noqa: E402

from benchmarks.gateway_overhead import wait_healthy  # noqa: E402
from benchmarks.serving import cpu_seconds  # noqa: E402
from benchmarks.workload import bench_model_dir, write_report  # noqa: E402
from services.gateway.api_keys import RedisKeyStore  # noqa: E402
from tests.services_harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def start_gateway(scheduler_port: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "gateway", "--port", str(port), "--grpc-port",
                             str(free_port()), "--scheduler", f"127.0.0.1:{scheduler_port}", *extra], cwd=REPO,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def one_round(client: httpx.Client, base_url: str, key: str | None, model: str, num_requests: int,
              pid: int) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "prompt": "Hello there", "max_tokens": 1}
    latencies = []
    cpu_before = cpu_seconds(pid)
    for _ in range(num_requests):
        started = time.perf_counter()
        reply = client.post(f"{base_url}/v1/completions", json=body, headers=headers)
        latencies.append(time.perf_counter() - started)
        reply.raise_for_status()
    latencies.sort()
    return {"median_ms": 1e3 * statistics.median(latencies), "p99_ms": 1e3 * latencies[int(0.99 * len(latencies))],
            "gateway_cpu_us_per_request": 1e6 * (cpu_seconds(pid) - cpu_before) / num_requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "auth_overhead.json"))
    args = parser.parse_args()
    for name in ("httpx", "httpx2"):  # a line per request otherwise
        logging.getLogger(name).setLevel(logging.WARNING)
    model_dir = str(bench_model_dir())
    prefix = f"pagedserve-bench:{uuid.uuid4().hex[:8]}:"
    store = RedisKeyStore(args.redis, prefix)
    # Limits high enough never to refuse: the check is what is measured.
    stored_key, _ = asyncio.run(store.create("bench", requests_per_minute=10**9, tokens_per_minute=10**12))
    static_key = "bench-" + uuid.uuid4().hex
    scheduler_port = free_port()
    stand_in = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gateway_overhead.py"), "--stand-in-port",
                                 str(scheduler_port), "--step-ms", "1"], cwd=REPO, start_new_session=True)
    modes = {"open": ([], None), "--api-key": (["--api-key", static_key], static_key),
             "--api-key-store (Redis, limits)": (["--api-key-store", args.redis, "--api-key-store-prefix", prefix],
                                                 stored_key)}
    gateways = {name: start_gateway(scheduler_port, extra) for name, (extra, _) in modes.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in modes}
    try:
        model = Path(model_dir).name
        with httpx.Client(timeout=30) as client:
            for name, (proc, url) in gateways.items():
                wait_healthy_with_key(url, proc, stand_in, modes[name][1])
                one_round(client, url, modes[name][1], model, 50, proc.pid)  # warm-up
            for _ in range(args.rounds):
                for name, (proc, url) in gateways.items():
                    rounds[name].append(one_round(client, url, modes[name][1], model, args.num_requests, proc.pid))
    finally:
        for proc in [stand_in] + [proc for proc, _ in gateways.values()]:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        asyncio.run(_forget(args.redis, prefix))
    summary = {name: {field: statistics.median(r[field] for r in results) for field in results[0]}
               for name, results in rounds.items()}
    for name, numbers in summary.items():
        print(f"{name:32s} median {numbers['median_ms']:.2f} ms  p99 {numbers['p99_ms']:.2f} ms  "
              f"gateway {numbers['gateway_cpu_us_per_request']:.0f} CPU µs/request", file=sys.stderr)
    write_report(args.out, {"num_requests": args.num_requests, "rounds": rounds, "median_of_rounds": summary})


def wait_healthy_with_key(url: str, proc, stand_in, key: str | None) -> None:
    if key is None:
        return wait_healthy(url, [proc, stand_in])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise TimeoutError("the gateway did not become ready")


async def _forget(url: str, prefix: str) -> None:
    store = RedisKeyStore(url, prefix)
    names = [k async for k in store.redis.scan_iter(match=prefix + "*")]
    if names:
        await store.redis.delete(*names)
    await store.close()


if __name__ == "__main__":
    main()
