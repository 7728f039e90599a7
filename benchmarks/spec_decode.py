"""Speculative decoding: what verifying drafts costs and gains on this machine, by acceptance rate.

    python benchmarks/spec_decode.py [--batches 1,16] [--output-len 96] [--rounds 3] [--k 4]

The target is a 24-layer model of the bench model's width (vocabulary 4096) whose layers after the
first are damped (their output projections scaled by --damping), and the draft model is its first
layer: a pair that agrees as a real draft and target do, the draft a small fraction of the target's
weights (random weights give no natural pair). Random weights never
repeat themselves, so n-gram drafts are all rejected: the "ngram" row is the cost of speculating for
nothing. The "reference" rows propose a plain run's own outputs (tests/reference_proposer.py), each
draft wrong with a chosen probability (and every one after it): the gain at a given acceptance, with
no draft to run. Every mode decodes the same greedy requests to the same tokens (checked); modes
alternate within each round so that a drift of the machine hits all alike, and speed-ups are medians
of per-round ratios.

It also times the n-gram proposer alone: microseconds per sequence and step, by context length.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402

# The target: the bench model's width with a small vocabulary and three times the depth, so that its
# layers, not the vocabulary head, hold most of its weights, as in real models; the draft: its first layer.
PAIR_SHAPE: dict = dict(model_type="llama", vocab_size=4096, hidden_size=512, intermediate_size=1408,
                        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=4,
                        max_position_embeddings=4096, dtype="float32")
DRAFT_LAYERS = 1


def draft_pair(damping: float) -> tuple[Path, Path]:
    """(target, draft), made once (in a child process: loading transformers here slowed the runs) and cached."""
    root = bench_model_dir().parent / f"spec-pair-{PAIR_SHAPE['num_hidden_layers']}x{DRAFT_LAYERS}-{damping:g}"
    if not (root / "draft" / "config.json").exists():
        subprocess.run([sys.executable, __file__, "--make-pair", str(root), "--damping", str(damping)], check=True)
    return root / "target", root / "draft"


def make_pair(root: Path, damping: float) -> None:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from services.worker.model_factory import create_model_dir

    tmp = root.parent / f".{root.name}-tmp-{os.getpid()}"
    target = create_model_dir(tmp / "target", **PAIR_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    with torch.no_grad():  # the layers past the draft's add little to the residual stream
        for layer in model.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(damping)
            layer.mlp.down_proj.weight.mul_(damping)
    model.save_pretrained(target)
    model.model.layers = model.model.layers[:DRAFT_LAYERS]
    model.config.num_hidden_layers = DRAFT_LAYERS
    model.save_pretrained(tmp / "draft")
    for file in target.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(file, tmp / "draft" / file.name)
    tmp.rename(root)


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
                                               "spec_decode_num_accepted_tokens", "forward_time_s", "sample_time_s",
                                               "propose_time_s")}
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
    parser.add_argument("--model", default=None, help="a target model directory, no draft model mode "
                                                      "(default: the damped bench model and its draft)")
    parser.add_argument("--damping", type=float, default=0.02, help="scale of the target's extra layers' outputs")
    parser.add_argument("--make-pair", default=None, help=argparse.SUPPRESS)  # the child draft_pair runs
    parser.add_argument("--proposal-contexts", default="1024,8192,32768", help="contexts the n-gram proposer is timed at")
    parser.add_argument("--out", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()
    if args.make_pair:
        make_pair(Path(args.make_pair), args.damping)
        return

    from pagedserve import LLM, SamplingParams
    from tests.reference_proposer import ReferenceProposer

    model, draft = (args.model, None) if args.model else map(str, draft_pair(args.damping))
    options = dict(block_size=16, kv_cache_memory_bytes=1 << 30)
    plain_llm = LLM(model, **options)
    spec_llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **options)
    draft_llm = LLM(model, speculative_config={"method": "draft_model", "model": draft,
                                               "num_speculative_tokens": args.k}, **options) if draft else None
    ngram = spec_llm.engine.executor.worker.proposer
    vocab = spec_llm.engine.executor.worker.vocab_size
    report = {"model": model, "draft": draft, "damping": args.damping, "k": args.k, "output_len": args.output_len,
              "rounds": args.rounds, "batches": []}
    for batch in [int(b) for b in args.batches.split(",")]:
        requests = bench_workload(batch, seed=batch, vocab_size=min(vocab, 32000),
                                  prompt_range=(args.prompt_len, args.prompt_len),
                                  output_range=(args.output_len, args.output_len))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        reference = run(plain_llm, prompts, params, None)  # warm-up, and what the drafts propose
        full = [r.prompt_token_ids + ids for r, ids in zip(requests, reference["token_ids"])]
        modes = {"plain": (plain_llm, lambda: None), "ngram": (spec_llm, lambda: ngram)}
        if draft_llm is not None:
            modes[f"draft model ({DRAFT_LAYERS} of {PAIR_SHAPE['num_hidden_layers']} layers)"] = (draft_llm, lambda: None)
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
                "forward_s": last["forward_time_s"], "sample_s": last["sample_time_s"],
                "propose_s": last["propose_time_s"]})
        report["batches"].append({"batch": batch, "rows": rows})
        print(f"\nbatch {batch}, {args.prompt_len}-token prompts, {args.output_len} tokens each, k={args.k}")
        print(f"{'mode':<25}{'tok/s':>8}{'speed-up (range)':>20}{'steps':>7}{'accepted':>10}{'fwd s':>8}"
              f"{'sample s':>10}{'propose s':>11}")
        for r in rows:
            accepted = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            low, high = r["speedup_range"]
            print(f"{r['mode']:<25}{r['tokens_per_s']:>8.1f}{r['speedup_vs_plain']:>8.2f}x ({low:.2f}-{high:.2f})"
                  f"{r['steps']:>7}{accepted:>10}{r['forward_s']:>8.2f}{r['sample_s']:>10.2f}{r['propose_s']:>11.2f}")
    report["ngram_proposal_us"] = proposal_cost_us(args.k, [int(c) for c in args.proposal_contexts.split(",")])
    print("\nn-gram proposal, per sequence and step")
    for r in report["ngram_proposal_us"]:
        print(f"  context {r['context']:>6}, {r['tokens']:<22} {r['us']:8.1f} us")
    print(f"\nwrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
