"""Decode inter-token latency under a burst of long prompts: two workers colocated (`pagedserve serve
--data-parallel-size 2`: each computes prompts and decodes) against disaggregated (`--prefill-workers 1
--decode-workers 1`: one computes prompts, the other decodes, pulling each sequence's KV from the first).

    python benchmarks/disaggregation.py --streams 8 --burst 8 --burst-prompt-len 1536

Both setups run two workers on the same cores, each worker pinned to its own share of them (on a 2-core
machine: a core each; the gateway and the scheduler(s) float). In each run, --streams decode streams (short
prompts, --decode-len tokens each) start first; once every stream has its first token, --burst long prompts
arrive at once. Reported: the streams' inter-token latency (p50, p99, max) over the whole run, the burst's
TTFT (p50, p99), and output throughput. The setups alternate, --rounds times each. Writes JSON
(benchmarks/results/disaggregation.json by default)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import (  # noqa: E402
    engine_stats, one_request, percentiles, served_model, start_stack, stop_stack)
from benchmarks.workload import BenchRequest, bench_model_dir, write_report  # noqa: E402

SETUPS = {"colocated": ("--data-parallel-size", "2"),
          "disaggregated": ("--prefill-workers", "1", "--decode-workers", "1")}


def requests(args) -> tuple[list[BenchRequest], list[BenchRequest]]:
    rng = random.Random(args.seed)
    streams = [BenchRequest([rng.randrange(100, 30000) for _ in range(args.stream_prompt_len)], args.decode_len)
               for _ in range(args.streams)]
    burst = [BenchRequest([rng.randrange(100, 30000) for _ in range(args.burst_prompt_len)], args.burst_output_len)
             for _ in range(args.burst)]
    return streams, burst


async def run_workload(url: str, model: str, streams: list[BenchRequest], burst: list[BenchRequest]) -> dict:
    """The streams, then the burst once every stream has its first token."""
    started = time.perf_counter()
    stream_tasks = [asyncio.create_task(one_request(url, model, request)) for request in streams]
    await _wait_for_first_tokens(url, len(streams))  # (one_request tells nothing before its stream ends)
    burst_results = await asyncio.gather(*[one_request(url, model, request) for request in burst])
    stream_results = await asyncio.gather(*stream_tasks)
    elapsed = time.perf_counter() - started
    itl = [b - a for r in stream_results for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    ttft = [r["arrivals"][0] - r["start"] for r in burst_results if r["arrivals"]]
    tokens = sum(r["output_len"] for r in stream_results + burst_results)
    return {"elapsed_s": elapsed, "tokens_per_s": tokens / elapsed, "stream_itl_s": {**percentiles(itl),
                                                                                   "max": max(itl)},
            "burst_ttft_s": percentiles(ttft)}


async def _wait_for_first_tokens(url: str, count: int, timeout_s: float = 120.0) -> None:
    """Until the engines report ``count`` running sequences that have produced a token (the streams decode)."""
    base = url.rsplit("/v1", 1)[0] + "/v1"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(engine_stats, base)
        if stats.get("num_requests_running", 0) >= count and stats.get("num_requests_waiting", 0) == 0:
            await asyncio.sleep(0.5)  # a few decode steps: the streams are in their stride
            return
        await asyncio.sleep(0.05)
    raise TimeoutError("the decode streams did not start")


def run_setup(model_dir: Path, setup: str, streams, burst, args) -> dict:
    stack = start_stack(model_dir, args.port, *SETUPS[setup], "--num-gpu-blocks-override", str(args.blocks),
                        "--max-num-batched-tokens", str(args.max_num_batched_tokens))
    base_url = f"http://127.0.0.1:{args.port}/v1"
    try:
        model = served_model(base_url)
        report = asyncio.run(run_workload(f"{base_url}/completions", model, streams, burst))
        report["engine"] = {k: v for k, v in engine_stats(base_url).items()
                            if k in ("num_kv_pulls", "kv_pull_blocks", "num_preemptions", "prefix_cache_hits")}
    finally:
        stop_stack(stack)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--streams", type=int, default=8, help="decode streams running before the burst")
    parser.add_argument("--stream-prompt-len", type=int, default=32)
    parser.add_argument("--decode-len", type=int, default=192, help="tokens each decode stream generates")
    parser.add_argument("--burst", type=int, default=8, help="long prompts arriving at once")
    parser.add_argument("--burst-prompt-len", type=int, default=1536)
    parser.add_argument("--burst-output-len", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks per worker (16 tokens each)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setup, alternated")
    parser.add_argument("--port", type=int, default=8330)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "disaggregation.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir()
    streams, burst = requests(args)
    runs: dict[str, list[dict]] = {setup: [] for setup in SETUPS}
    for round_index in range(args.rounds):
        order = list(SETUPS) if round_index % 2 == 0 else list(SETUPS)[::-1]
        for setup in order:
            result = run_setup(model_dir, setup, streams, burst, args)
            runs[setup].append(result)
            itl, ttft = result["stream_itl_s"], result["burst_ttft_s"]
            print(f"{setup:<14} stream ITL p50 {itl['p50'] * 1000:7.1f} ms  p99 {itl['p99'] * 1000:7.1f} ms  "
                  f"max {itl['max'] * 1000:7.1f} ms  burst TTFT p50 {ttft['p50'] * 1000:7.1f} ms  "
                  f"p99 {ttft['p99'] * 1000:7.1f} ms  {result['tokens_per_s']:.1f} tok/s  {result['engine']}",
                  flush=True)
    median = {setup: {"itl_p99_s": statistics.median(r["stream_itl_s"]["p99"] for r in runs[setup]),
                      "itl_p50_s": statistics.median(r["stream_itl_s"]["p50"] for r in runs[setup]),
                      "burst_ttft_p50_s": statistics.median(r["burst_ttft_s"]["p50"] for r in runs[setup])}
              for setup in SETUPS}
    ratio = median["colocated"]["itl_p99_s"] / median["disaggregated"]["itl_p99_s"]
    print(f"stream ITL p99 colocated / disaggregated: {ratio:.2f}x")
    out = write_report(args.out, {"args": vars(args), "runs": runs, "median": median, "itl_p99_ratio": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
