"""The prefix cache's host tier (--kv-offloading-size) on a multi-turn chat whose live prefixes exceed the
device KV cache several times: without the tier a returning turn recomputes the history the device evicted;
with it, the history is copied back from host memory.

    python benchmarks/host_tier.py --conversations 16 --turns 3

Conversations take turns in rounds; in each round their next turns arrive ``--concurrency`` at a time.
Each turn's prompt is the conversation so far (system prompt, earlier turns and replies) and new user
tokens; replies are greedy. Runs alternate, tier off and on, each in a fresh LLM on the bench model, the
same conversations in every run. Reports, per run, the prompt tokens computed, TTFT (from submission to
the first token) p50 and p90 of the returning turns (the first turn of each conversation has nothing to
return to), and the tier's hits; then the ratio of the medians. Writes JSON
(benchmarks/results/host_tier.json by default)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, write_report  # noqa: E402

MODES = {"no tier": 0.0, "host tier": None}  # mode -> --kv-offloading-size (None: --tier-gib)


def conversation_plan(args) -> dict:
    """Every conversation's opening and each turn's new user tokens and reply length, drawn once."""
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randrange(100, 30000) for _ in range(n)]  # noqa: E731
    return {"openings": [draw(rng.randint(args.opening // 2, args.opening)) for _ in range(args.conversations)],
            "turns": [[(draw(rng.randint(args.user_tokens // 2, args.user_tokens)), args.reply_tokens)
                       for _ in range(args.turns)] for _ in range(args.conversations)]}


def run(model_dir: Path, plan: dict, tier_gib: float, args) -> dict:
    from pagedserve import LLM, SamplingParams
    from shared.request import EngineRequest

    llm = LLM(str(model_dir), block_size=args.block_size, num_gpu_blocks_override=args.device_blocks,
              kv_offloading_size=tier_gib, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    llm.generate({"prompt_token_ids": list(range(100, 164))}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    before = llm.stats()
    history = [list(opening) for opening in plan["openings"]]
    ttft_returning, started = [], time.perf_counter()
    for turn in range(args.turns):
        order = list(range(args.conversations))
        for first in range(0, len(order), args.concurrency):
            sent, replies = {}, {}
            for c in order[first:first + args.concurrency]:
                user, reply_len = plan["turns"][c][turn]
                history[c] += user
                request_id = f"c{c}-t{turn}"
                engine.add_request(EngineRequest(request_id, list(history[c]),
                                                 SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)))
                sent[request_id], replies[request_id] = (c, time.perf_counter()), []
            while engine.has_unfinished():
                for update in engine.step():
                    if not replies[update.request_id] and update.new_token_ids and turn > 0:
                        ttft_returning.append(time.perf_counter() - sent[update.request_id][1])
                    replies[update.request_id] += update.new_token_ids
            for request_id, (c, _) in sent.items():
                history[c] += replies[request_id]
    elapsed = time.perf_counter() - started
    stats = llm.stats()
    delta = {name: stats[name] - before[name] for name in
             ("prompt_tokens_computed", "prompt_tokens_cached", "prompt_tokens_loaded", "host_cache_hits",
              "prefix_cache_hits", "kv_offload_blocks_stored", "kv_offload_blocks_loaded", "num_preemptions")}
    live_tokens = sum(len(h) for h in history)
    return {"elapsed_s": elapsed, "ttft_returning_p50_s": statistics.median(ttft_returning),
            "ttft_returning_p90_s": statistics.quantiles(ttft_returning, n=10)[-1], "returning_turns": len(ttft_returning),
            "device_blocks": llm.engine.info.num_kv_blocks, "tier_blocks": llm.engine.info.num_cpu_offload_blocks,
            "live_tokens_at_end": live_tokens,
            "live_over_device": live_tokens / (llm.engine.info.num_kv_blocks * args.block_size), **delta}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="turns arriving at once")
    parser.add_argument("--opening", type=int, default=640, help="most tokens of a conversation's opening")
    parser.add_argument("--user-tokens", type=int, default=96, help="most new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=256, help="the device KV cache, in blocks")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tier-gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "host_tier.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir()
    plan = conversation_plan(args)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, gib in MODES.items():
            result = run(model_dir, plan, args.tier_gib if gib is None else gib, args)
            runs[mode].append(result)
            print(f"{mode:<10} TTFT returning p50 {result['ttft_returning_p50_s'] * 1000:7.1f} ms  "
                  f"p90 {result['ttft_returning_p90_s'] * 1000:7.1f} ms  prompt tokens computed "
                  f"{result['prompt_tokens_computed']:>7}  loaded {result['prompt_tokens_loaded']:>7}  "
                  f"live/device {result['live_over_device']:.1f}x  {result['elapsed_s']:.1f} s", flush=True)
    p50 = {mode: statistics.median(r["ttft_returning_p50_s"] for r in runs[mode]) for mode in MODES}
    computed = {mode: statistics.median(r["prompt_tokens_computed"] for r in runs[mode]) for mode in MODES}
    ratio = p50["no tier"] / p50["host tier"]
    print(f"TTFT p50 of returning turns, no tier / host tier: {ratio:.2f}x; prompt tokens computed "
          f"{computed['no tier']:.0f} -> {computed['host tier']:.0f}")
    out = write_report(args.out, {"args": vars(args), "runs": runs, "ttft_returning_p50_s": p50,
                                  "prompt_tokens_computed": computed, "ttft_p50_ratio": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
