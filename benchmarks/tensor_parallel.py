"""Tensor parallelism's cost on this machine: one worker against a group of ranks on the same cores.

    python benchmarks/tensor_parallel.py [--size 2] [--num-requests 16] [--output-len 64] [--rounds 3]

Both decode the same greedy requests on the bench model (checked to the token); the group's ranks
split the machine's cores between them, so on a CPU the comparison shows what the all-reduces and
the gRPC hop cost, not a speed-up (that needs a device per rank). Modes alternate within each round;
the ratio is the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=2, help="tensor_parallel_size of the group")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()

    from pagedserve import LLM, SamplingParams

    model = args.model or str(bench_model_dir())
    options = dict(block_size=16, kv_cache_memory_bytes=1 << 30)
    engines = {"one worker": LLM(model, **options), f"{args.size} ranks": LLM(model, tensor_parallel_size=args.size,
                                                                             **options)}
    vocab = engines["one worker"].engine.info.vocab_size
    requests = bench_workload(args.num_requests, seed=1, vocab_size=min(vocab, 32000),
                              prompt_range=(args.prompt_len, args.prompt_len),
                              output_range=(args.output_len, args.output_len))
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    tokens = {name: [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
              for name, llm in engines.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(args.rounds):
            for name, llm in engines.items():
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                times[name].append(time.perf_counter() - start)
                tokens[name] = [o.outputs[0].token_ids for o in outputs]
        names = list(engines)
        agree = sum(a == b for a, b in zip(tokens[names[0]], tokens[names[1]]))
    finally:
        for llm in engines.values():
            llm.close()
    total = args.num_requests * args.output_len
    rows = [{"mode": name, "tokens_per_s": total / statistics.median(times[name]),
             "relative": statistics.median(base / mine for base, mine in zip(times[names[0]], times[name]))}
            for name in names]
    print(f"{args.num_requests} requests x {args.output_len} tokens, {args.prompt_len}-token prompts, "
          f"{args.rounds} rounds; greedy outputs equal for {agree} of {args.num_requests} (near-ties may differ)")
    for row in rows:
        print(f"  {row['mode']:<12} {row['tokens_per_s']:8.1f} tok/s  {row['relative']:.2f}x")
    print(f"wrote {write_report(args.out, {'model': model, 'size': args.size, 'rows': rows, 'agree': agree})}")


if __name__ == "__main__":
    main()
