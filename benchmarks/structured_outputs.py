"""What structured outputs cost: the same batch of greedy requests on the bench model, free, held
to a regular expression, and held to a JSON schema, in alternating rounds on one engine.

Reported per mode (medians of the rounds): output tokens per second, and the sampler's time per
generated token (the grammar's mask is built there: xgrammar fills one bitmask row per
constrained sequence, then the rows are masked on the scores). Also the first constrained
request's extra latency on a fresh engine (the tokenizer loaded and the grammar compiler built).

    python benchmarks/structured_outputs.py --batch 32 --max-tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
MODES = {"free": None,
         "regex": {"regex": "[a-z0-9 ,.]+"},  # never complete: every step is constrained
         "json": {"json": SCHEMA, "disable_any_whitespace": True}}


def one_run(llm, prompts, mode: str, max_tokens: int) -> dict:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=mode != "json",
                            structured_outputs=MODES[mode])
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    sample_s = llm.stats()["sample_time_s"] - before["sample_time_s"]
    return {"tokens": tokens, "tokens_per_s": tokens / elapsed, "sample_us_per_token": 1e6 * sample_s / tokens}


def first_request_s(model_dir: Path, prompt: dict, constrained: bool) -> float:
    from pagedserve import LLM, SamplingParams

    llm = LLM(str(model_dir))
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)  # the engine's own first step
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=2, structured_outputs=MODES["json"] if constrained else None),
                 use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bench model)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "structured_outputs.json"))
    args = parser.parse_args()

    from pagedserve import LLM

    model_dir = Path(args.model) if args.model else bench_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in
               bench_workload(args.batch, seed=2, vocab_size=vocab, prompt_range=(args.prompt_len, args.prompt_len))]
    report: dict = {"batch": args.batch, "max_tokens": args.max_tokens, "rounds": args.rounds}
    report["first_request_s"] = {"free": first_request_s(model_dir, prompts[0], False),
                                 "json (tokenizer, compiler, grammar)": first_request_s(model_dir, prompts[0], True)}
    llm = LLM(str(model_dir), max_num_seqs=max(args.batch, 8))
    for mode in MODES:  # warm-up: the grammars compiled, the first touches made
        one_run(llm, prompts[:4], mode, 4)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(one_run(llm, prompts, mode, args.max_tokens))
    report["modes"] = {mode: {key: round(statistics.median(r[key] for r in rs), 1) for key in rs[0]}
                       for mode, rs in runs.items()}
    free = report["modes"]["free"]["tokens_per_s"]
    for mode in ("regex", "json"):
        report["modes"][mode]["throughput_vs_free"] = round(report["modes"][mode]["tokens_per_s"] / free, 3)
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
