"""The bench model through transformers' modelling code (--model-impl transformers) against the native
model, offline, in one run: the same requests, the engines alternated (native, transformers, native,
transformers), each run in its own fresh LLM.

    python benchmarks/model_impl.py --num-requests 200

Prints each run's output tokens per second and the ratio of the medians; writes JSON
(benchmarks/results/model_impl.json by default)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.offline_throughput import run_pagedserve  # noqa: E402
from benchmarks.workload import bench_model_dir, workload_for, write_report  # noqa: E402

IMPLS = ("native", "transformers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each implementation, alternated")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "model_impl.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir()
    requests = workload_for(model_dir, args.num_requests, args.seed)
    runs: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
    for _ in range(args.rounds):
        for impl in IMPLS:
            args.model_impl = impl
            run = run_pagedserve(model_dir, requests, args)
            run["tokens_per_s"] = run["output_tokens"] / run["elapsed_s"]
            runs[impl].append(run)
            print(f"{impl:<14}{run['tokens_per_s']:>9.1f} tok/s  forward {run['forward_s']:.1f} s", flush=True)
    median = {impl: statistics.median(r["tokens_per_s"] for r in runs[impl]) for impl in IMPLS}
    ratio = median["transformers"] / median["native"]
    print(f"transformers / native: {ratio:.2f}x (medians {median['transformers']:.1f} / {median['native']:.1f} tok/s)")
    out = write_report(args.out, {"num_requests": len(requests), "seed": args.seed, "runs": runs,
                                  "median_tokens_per_s": median, "transformers_vs_native": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
