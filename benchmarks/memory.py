"""Memory-management benchmarks on the bench model, each against its baseline in the same run:

1. prefix caching: time to first token of short questions after a 1,000-token shared system
   prompt, with the prefix cache against without (target >= 5x);
2. parallel sampling: KV blocks in use for n = 4 samples of 1,000-token prompts, sharing the
   prompt (copy-on-write) against four separate sequences (target >= 40% fewer);
3. capacity: sequences running at once within a fixed KV budget, against contiguous
   pre-allocation of the maximum length from the same budget (target >= 10x);
4. preemption: throughput on the bench workload with a quarter of the KV it needs, by swapping
   against by recomputing;
5. sliding windows: the bench shape as Mistral (every layer in a 256-key window) on the bench
   workload, freeing the blocks behind the window against keeping them: peak KV blocks with room to
   spare, then throughput and preemptions with a quarter of the KV that keeping them needs.

    python benchmarks/memory.py [--sections 12345] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from shared.request import EngineRequest  # noqa: E402


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prefix_caching_ttft(model: str, num_questions: int, rng: random.Random) -> dict:
    system = [rng.randrange(32000) for _ in range(1000)]
    questions = [system + [rng.randrange(32000) for _ in range(rng.randint(8, 24))] for _ in range(num_questions)]
    result = {}
    for caching in (False, True):
        llm = LLM(model, enable_prefix_caching=caching)
        llm.generate({"prompt_token_ids": system + [1, 2, 3]}, greedy(1), use_tqdm=False)  # the system turn
        ttfts = []
        for question in questions:  # one at a time: TTFT is the prefill of one question
            start = time.perf_counter()
            llm.generate({"prompt_token_ids": question}, greedy(1), use_tqdm=False)
            ttfts.append(time.perf_counter() - start)
        result["with_cache" if caching else "without_cache"] = {
            "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": statistics.median(ttfts),
            "prefix_cache_hits": llm.stats()["prefix_cache_hits"]}
    result["speedup"] = result["without_cache"]["ttft_mean_s"] / result["with_cache"]["ttft_mean_s"]
    return result


def parallel_sampling_blocks(model: str, num_prompts: int, rng: random.Random) -> dict:
    prompts = [{"prompt_token_ids": [rng.randrange(32000) for _ in range(1000)]} for _ in range(num_prompts)]
    sampled = SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=32, ignore_eos=True)
    shared = LLM(model, enable_prefix_caching=False)
    shared.generate(prompts, sampled, use_tqdm=False)
    separate = LLM(model, enable_prefix_caching=False)
    single = [SamplingParams(temperature=1.0, seed=i, max_tokens=32, ignore_eos=True) for i in range(4)]
    separate.generate([p for p in prompts for _ in range(4)], single * num_prompts, use_tqdm=False)
    with_sharing = shared.stats()["kv_blocks_used_peak"]
    without = separate.stats()["kv_blocks_used_peak"]
    return {"blocks_peak_shared": with_sharing, "blocks_peak_separate": without,
            "fewer_pct": 100.0 * (1 - with_sharing / without)}


def capacity(model: str, num_requests: int, budget_tokens: int, max_steps: int = 60) -> dict:
    """Offer more requests than the budget holds; count how many run at once once admission stalls."""
    block_size = 16
    llm = LLM(model, block_size=block_size, num_gpu_blocks_override=budget_tokens // block_size, max_num_seqs=1024,
              enable_prefix_caching=False, watermark=0.0)
    engine = llm.engine
    for i, r in enumerate(bench_workload(num_requests, seed=1)):
        engine.add_request(EngineRequest(str(i), r.prompt_token_ids, greedy(r.output_len)))
    peak = 0
    for _ in range(max_steps):  # every prompt is prefilled or blocked well within these steps
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    for i in range(num_requests):
        engine.abort_request(str(i))
    contiguous = budget_tokens // engine.info.max_model_len
    return {"budget_tokens": budget_tokens, "max_model_len": engine.info.max_model_len, "offered": num_requests,
            "paged_peak_running": peak, "contiguous_max_running": contiguous,
            "ratio": peak / max(contiguous, 1), "kv_waste_pct_peak": llm.stats()["kv_waste_pct_peak"]}


def preemption_throughput(model: str, num_requests: int) -> dict:
    requests = bench_workload(num_requests, seed=2)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [greedy(r.output_len) for r in requests]
    roomy = LLM(model, enable_prefix_caching=False)
    roomy.generate(prompts, params, use_tqdm=False)
    quarter = max(1, roomy.stats()["kv_blocks_used_peak"] // 4)
    result = {"blocks": quarter, "blocks_needed": roomy.stats()["kv_blocks_used_peak"]}
    for mode in ("swap", "recompute"):
        llm = LLM(model, enable_prefix_caching=False, num_gpu_blocks_override=quarter, preemption_mode=mode)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        stats = llm.stats()
        result[mode] = {"tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
                        "preemptions": stats["num_preemptions"], "swaps_out": stats["num_swaps_out"]}
    return result


def window_release(num_requests: int) -> dict:
    model = str(bench_model_dir("mistral"))
    requests = bench_workload(num_requests, seed=2)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [greedy(r.output_len) for r in requests]

    def run(release: bool, **options) -> tuple[dict, list]:
        llm = LLM(model, enable_prefix_caching=False, **options)
        if not release:  # the worker reports its window; the scheduler is told to ignore it
            llm.engine.scheduler.blocks.kv_window = None
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed, stats = time.perf_counter() - start, llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return ({"tokens_per_s": tokens / elapsed, "elapsed_s": elapsed, "preemptions": stats["num_preemptions"],
                 "kv_blocks_used_peak": stats["kv_blocks_used_peak"]}, [o.outputs[0].token_ids for o in outputs])

    result = {"roomy_kept": run(False)[0], "roomy_released": run(True)[0]}
    quarter = max(1, result["roomy_kept"]["kv_blocks_used_peak"] // 4)
    result["blocks"] = quarter
    result["tight_kept"], kept_tokens = run(False, num_gpu_blocks_override=quarter)
    result["tight_released"], released_tokens = run(True, num_gpu_blocks_override=quarter)
    result["same_tokens"] = kept_tokens == released_tokens
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="12345")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-questions", type=int, default=8)
    parser.add_argument("--capacity-budget-tokens", type=int, default=65536)
    parser.add_argument("--capacity-requests", type=int, default=400)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "memory.json"))
    args = parser.parse_args()
    model = str(bench_model_dir())
    rng = random.Random(0)
    report = {}
    if "1" in args.sections:
        report["prefix_caching_ttft"] = prefix_caching_ttft(model, args.num_questions, rng)
    if "2" in args.sections:
        report["parallel_sampling_blocks"] = parallel_sampling_blocks(model, 4, rng)
    if "3" in args.sections:
        report["capacity"] = capacity(model, args.capacity_requests, args.capacity_budget_tokens)
    if "4" in args.sections:
        report["preemption"] = preemption_throughput(model, args.num_requests)
    if "5" in args.sections:
        report["window_release"] = window_release(args.num_requests)
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
