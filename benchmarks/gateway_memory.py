"""What a huge prompt costs the gateway: its resident memory (RSS) before, at the peak while it answers,
and a few seconds after, and how long the answer takes, for prompts far longer than the context.

A real gateway process over the stand-in scheduler of gateway_overhead.py (no model: the gateway
tokenizes with the bench model's tokenizer and refuses what cannot fit its 4096-token context). Each
case sends its requests (one, then several at once) and reads the gateway's VmHWM (the kernel's peak
RSS, reset before each case through /proc/<pid>/clear_refs) and its VmRSS after the answers.

    python benchmarks/gateway_memory.py --prompt-mb 8 --concurrent 3
    python benchmarks/gateway_memory.py --gateway-args --http-max-body-size 4194304   # the 413 path
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2 as httpx  # noqa: E402
import logging  # noqa: E402

from benchmarks.gateway_overhead import wait_healthy  # noqa: E402
from benchmarks.workload import bench_model_dir, write_report  # noqa: E402
from tests.services_harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SETTLE_S = 3.0  # after the answers, before reading what the gateway kept


def prose(num_bytes: int, seed: int = 0) -> str:
    """ASCII text of made-up words (few repeats, so the tokenizer's word cache does not make it cheap)."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words, size = [], 0
    while size < num_bytes:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:num_bytes]


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (the peak since the last reset), KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # "5": reset the peak RSS to the current RSS


def one_case(base_url: str, pid: int, model: str, prompt: str, num_requests: int) -> dict:
    reset_peak(pid)
    before = memory_kib(pid)["VmRSS"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()

    def send() -> tuple[int, float, str]:
        started = time.perf_counter()
        reply = httpx.post(f"{base_url}/v1/completions", content=body, timeout=600,
                           headers={"Content-Type": "application/json"})
        return reply.status_code, time.perf_counter() - started, reply.text[:200]

    with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
        answers = list(pool.map(lambda _: send(), range(num_requests)))
    peak = memory_kib(pid)["VmHWM"]
    time.sleep(SETTLE_S)
    after = memory_kib(pid)["VmRSS"]
    return {"requests": num_requests, "body_mib": len(body) / 2 ** 20, "statuses": [a[0] for a in answers],
            "seconds": [round(a[1], 3) for a in answers], "first_answer": answers[0][2],
            "rss_before_mib": before / 1024, "rss_peak_mib": peak / 1024, "rss_after_mib": after / 1024}


def main() -> None:
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # (a line per request otherwise)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-mb", type=float, default=8.0, help="each prompt's size, MiB of text")
    parser.add_argument("--concurrent", type=int, default=3, help="requests sent at once in the second case")
    parser.add_argument("--gateway-args", nargs=argparse.REMAINDER, default=[],
                        help="flags for the gateway (the rest of the command line)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "gateway_memory.json"))
    args = parser.parse_args()
    model_dir = bench_model_dir()
    scheduler_port, http_port = free_port(), free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    stand_in = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gateway_overhead.py"),
                                 "--stand-in-port", str(scheduler_port)], cwd=REPO, env=env, start_new_session=True)
    gateway = subprocess.Popen([sys.executable, "-m", "pagedserve", "gateway", "--port", str(http_port),
                                "--grpc-port", str(free_port()), "--scheduler", f"127.0.0.1:{scheduler_port}",
                                *args.gateway_args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    base_url = f"http://127.0.0.1:{http_port}"
    prompt = prose(int(args.prompt_mb * 2 ** 20))
    try:
        wait_healthy(base_url, [stand_in, gateway])
        model = model_dir.name
        httpx.post(f"{base_url}/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 1},
                   timeout=60).raise_for_status()
        time.sleep(SETTLE_S)
        cases = [one_case(base_url, gateway.pid, model, prompt, n) for n in (1, args.concurrent)]
    finally:
        for proc in (gateway, stand_in):
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in (gateway, stand_in):
            proc.wait(timeout=30)
    report = {"prompt_mib": args.prompt_mb, "gateway_args": args.gateway_args, "cases": cases}
    for case in cases:
        print(f"{case['requests']} x {case['body_mib']:.1f} MiB: status {case['statuses']}, "
              f"{max(case['seconds']):.2f} s; gateway RSS {case['rss_before_mib']:.0f} MiB before, "
              f"{case['rss_peak_mib']:.0f} MiB peak, {case['rss_after_mib']:.0f} MiB after", file=sys.stderr)
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
