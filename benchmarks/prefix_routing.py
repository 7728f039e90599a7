"""Routing by cached prefix against routing by the prompt's first 32 tokens, with two schedulers behind one
gateway (`pagedserve serve --data-parallel-size 2`), on a multi-tenant workload: several system prompts of
different lengths, each shared by its tenant's users, tenants of unequal traffic.

    python benchmarks/prefix_routing.py --num-requests 240 --concurrency 8

For each --routing policy, in turn and again (the order alternates), a fresh stack serves the same streamed
requests at a fixed concurrency. Reports the prefix-cache hit rate (tokens found over tokens looked up,
summed over both schedulers), TTFT p50 and p99, and how the requests split between the schedulers. Writes
JSON (benchmarks/results/prefix_routing.json by default)."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import (  # noqa: E402
    engine_stats, run_load, served_model, start_stack, stop_stack, summarize)
from benchmarks.workload import BenchRequest, bench_model_dir, write_report  # noqa: E402

POLICIES = ("prompt-hash", "cached-prefix")


def tenant_requests(args) -> list[BenchRequest]:
    """Each request: its tenant's system prompt, then the user's own tokens. Tenants' shares fall as 1/rank."""
    rng = random.Random(args.seed)
    lengths = [int(n) for n in args.system_lengths.split(",")]
    systems = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
    weights = [1 / (rank + 1) for rank in range(len(systems))]
    requests = []
    for _ in range(args.num_requests):
        system = rng.choices(systems, weights)[0]
        user = [rng.randrange(100, 30000) for _ in range(rng.randint(args.user_tokens // 4, args.user_tokens))]
        requests.append(BenchRequest(system + user, args.output_len))
    return requests


def run_policy(model_dir: Path, policy: str, requests: list[BenchRequest], args) -> dict:
    port = args.port
    stack = start_stack(model_dir, port, "--data-parallel-size", "2", "--routing", policy,
                        "--num-gpu-blocks-override", str(args.blocks_per_scheduler))
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        model = served_model(base_url)
        before = engine_stats(base_url)
        results, elapsed = asyncio.run(run_load(base_url, model, requests, None, args.concurrency, args.seed))
        after = engine_stats(base_url)
    finally:
        stop_stack(stack)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in
             ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "num_preemptions")}
    report = summarize(results, elapsed)
    report.update(delta)
    report["hit_rate"] = delta["prefix_cache_hits"] / delta["prefix_cache_queries"] if delta["prefix_cache_queries"] \
        else 0.0
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--num-requests", type=int, default=240)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--system-lengths", default="24,80,200,400,640,960",
                        help="tokens of each tenant's system prompt (comma-separated; the first is the busiest)")
    parser.add_argument("--user-tokens", type=int, default=64, help="most tokens of a user's own part")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--blocks-per-scheduler", type=int, default=192,
                        help="each scheduler's KV cache in 16-token blocks: less than every tenant's prompt together")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each policy, alternated")
    parser.add_argument("--port", type=int, default=8310)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "prefix_routing.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir()
    requests = tenant_requests(args)
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for round_index in range(args.rounds):
        order = POLICIES if round_index % 2 == 0 else POLICIES[::-1]
        for policy in order:
            result = run_policy(model_dir, policy, requests, args)
            runs[policy].append(result)
            print(f"{policy:<14} hit rate {result['hit_rate']:6.1%}  TTFT p50 {result['ttft_s']['p50'] * 1000:7.1f} ms  "
                  f"p99 {result['ttft_s']['p99'] * 1000:7.1f} ms  prompt tokens computed "
                  f"{result['prompt_tokens_computed']:>8.0f}  {result['tokens_per_s']:.1f} tok/s", flush=True)
    median = {policy: {"hit_rate": statistics.median(r["hit_rate"] for r in runs[policy]),
                       "ttft_p50_s": statistics.median(r["ttft_s"]["p50"] for r in runs[policy])} for policy in POLICIES}
    ratio = median["prompt-hash"]["ttft_p50_s"] / median["cached-prefix"]["ttft_p50_s"]
    print(f"hit rate {median['prompt-hash']['hit_rate']:.1%} -> {median['cached-prefix']['hit_rate']:.1%}; "
          f"TTFT p50 prompt-hash / cached-prefix: {ratio:.2f}x")
    out = write_report(args.out, {"args": vars(args), "runs": runs, "median": median, "ttft_p50_ratio": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
