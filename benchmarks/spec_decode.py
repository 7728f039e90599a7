"""Speculative decoding: what verifying drafts costs and gains on this machine, by acceptance rate.

    python benchmarks/spec_decode.py [--batches 1,16] [--output-len 96] [--rounds 3] [--k 4]

The random bench model never repeats itself, so n-gram drafts are always rejected on it: the
"ngram" row is the cost of speculating for nothing. To see the gain at a given acceptance, the
"reference" rows propose a plain run's own outputs (tests/reference_proposer.py), each draft wrong
with a chosen probability (and every draft after a wrong one too, as real drafts go). Every mode
decodes the same greedy requests to the same tokens (checked); modes alternate within each round so
that a drift of the machine hits all alike, and speed-ups are medians of per-round ratios.

It also times the n-gram proposer alone: microseconds per sequence and step, by context length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402


def run(llm, prompts, params, proposer) -> dict:
    worker = llm.engine.executor.worker
    if proposer is not None:
        worker.proposer = proposer
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    delta = {k: after[k] - before[k] for k in ("num_steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens", "forward_time_s", "sample_time_s")}
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "tokens": tokens, "token_ids": [o.outputs[0].token_ids for o in outputs], **delta}


def proposal_cost_us(k: int, lengths: list[int], repeats: int = 200) -> list[dict]:
    from services.worker.ngram_proposer import NgramProposer
    from shared.speculative_config import SpeculativeConfig

    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=k))
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        for kind, vocab in (("text-like (32k vocab)", 32000), ("repetitive (50 ids)", 50)):
            tokens = rng.integers(0, vocab, length).astype(np.int32)
            start = time.perf_counter()
            for _ in range(repeats):
                proposer.propose(tokens)
            rows.append({"context": length, "tokens": kind, "us": 1e6 * (time.perf_counter() - start) / repeats})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--wrong", default="0.0,0.25,0.5", help="reference modes: chance a draft is wrong")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--proposal-contexts", default="1024,8192,32768", help="contexts the n-gram proposer is timed at")
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams
    from tests.reference_proposer import ReferenceProposer

    model = args.model or str(bench_model_dir())
    options = dict(block_size=16, kv_cache_memory_bytes=1 << 30)
    plain_llm = LLM(model, **options)
    spec_llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **options)
    ngram = spec_llm.engine.executor.worker.proposer
    vocab = spec_llm.engine.executor.worker.vocab_size
    report = {"model": model, "k": args.k, "output_len": args.output_len, "rounds": args.rounds, "batches": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        requests = bench_workload(batch, seed=batch, vocab_size=min(vocab, 32000),
                                  prompt_range=(args.prompt_len, args.prompt_len),
                                  output_range=(args.output_len, args.output_len))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        reference = run(plain_llm, prompts, params, None)  # warm-up, and what the drafts propose
        full = [r.prompt_token_ids + ids for r, ids in zip(requests, reference["token_ids"])]
        modes = {"plain": (plain_llm, lambda: None), "ngram": (spec_llm, lambda: ngram)}
        for wrong in [float(w) for w in args.wrong.split(",")]:
            modes[f"reference, {wrong:.0%} wrong"] = (
                spec_llm, lambda wrong=wrong: ReferenceProposer(full, args.k, vocab, wrong, seed=1))
        rounds: dict[str, list[dict]] = {name: [] for name in modes}
        for _ in range(args.rounds):
            for name, (llm, make) in modes.items():
                result = run(llm, prompts, params, make())
                assert result["token_ids"] == reference["token_ids"], f"{name}: the outputs differ from plain decoding"
                rounds[name].append(result)
        rows = []
        for name, results in rounds.items():
            ratios = [plain["elapsed_s"] / r["elapsed_s"] for plain, r in zip(rounds["plain"], results)]
            last = results[-1]
            drafts = last["spec_decode_num_draft_tokens"]
            rows.append({
                "mode": name, "tokens_per_s": statistics.median(r["tokens"] / r["elapsed_s"] for r in results),
                "speedup_vs_plain": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
                "steps": last["num_steps"],
                "acceptance": last["spec_decode_num_accepted_tokens"] / drafts if drafts else None,
                "tokens_per_seq_step": last["tokens"] / (last["num_steps"] * batch) if batch == 1 else None,
                "forward_s": last["forward_time_s"], "sample_s": last["sample_time_s"]})
        report["batches"].append({"batch": batch, "rows": rows})
        print(f"\nbatch {batch}, {args.prompt_len}-token prompts, {args.output_len} tokens each, k={args.k}")
        print(f"{'mode':<24}{'tok/s':>9}{'speed-up (range)':>20}{'steps':>7}{'accepted':>10}{'fwd s':>8}"
              f"{'sample s':>10}")
        for r in rows:
            accepted = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            low, high = r["speedup_range"]
            print(f"{r['mode']:<24}{r['tokens_per_s']:>9.1f}{r['speedup_vs_plain']:>8.2f}x ({low:.2f}-{high:.2f})"
                  f"{r['steps']:>7}{accepted:>10}{r['forward_s']:>8.2f}{r['sample_s']:>10.2f}")
    report["ngram_proposal_us"] = proposal_cost_us(args.k, [int(c) for c in args.proposal_contexts.split(",")])
    print("\nn-gram proposal, per sequence and step")
    for r in report["ngram_proposal_us"]:
        print(f"  context {r['context']:>6}, {r['tokens']:<22} {r['us']:8.1f} us")
    print(f"\nwrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
