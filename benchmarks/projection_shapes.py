"""Where the projections of an offline run lose speed: every packed product of the bench workload timed as the
engine ran it, then the same shapes timed alone, with the weights in cache (hot) and after a buffer larger than
the caches went through them (cold), as in a decode step, where each layer's K/V stream evicts the weights.

    python benchmarks/projection_shapes.py [--num-requests 200] [--dtype bfloat16] [--flush-mib 256]

Prints, per projection and row count (padded as PackedLinear runs them, in buckets; the FLOPs count those rows),
the seconds and GFLOPS of each, then the run's total against the best hot GFLOPS at 128 rows or more (the measured peak). Writes JSON
(benchmarks/results/projection_shapes.json by default). CPU only (oneDNN's packed products).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.workload import bench_model_dir, greedy_inputs, workload_for, write_report  # noqa: E402
from services.worker.models import packed_linear  # noqa: E402

BUCKETS = (32, 128, 512, 2048)  # upper bounds of the row buckets; above the last, one more
PEAK_MIN_ROWS = 128


def bucket_of(rows: int) -> str:
    return next((f"<={limit}" for limit in BUCKETS if rows <= limit), f">{BUCKETS[-1]}")


def record_products(model_dir: Path, args) -> dict[tuple[str, int, int, int], list[float]]:
    """Run the bench workload; {(layer, padded rows, in, out): [calls, seconds]} over its packed products."""
    calls: dict[tuple[str, int, int, int], list[float]] = defaultdict(lambda: [0, 0.0])
    run_product = packed_linear.PackedLinear.forward
    names: dict[int, str] = {}

    def timed(layer, x):
        start = time.perf_counter()
        out = run_product(layer, x)
        seconds = time.perf_counter() - start
        rows = packed_linear.padded_rows(x.numel() // layer.in_features)
        entry = calls[(names.get(id(layer), "?"), rows, layer.in_features, layer.out_features)]
        entry[0] += 1
        entry[1] += seconds
        return out

    from pagedserve import LLM

    llm = LLM(str(model_dir), dtype=args.dtype)
    model = llm.engine.executor.worker.model  # (the in-process worker's)
    names.update((id(m), name.rsplit(".", 1)[-1]) for name, m in model.named_modules()
                 if isinstance(m, packed_linear.PackedLinear))
    prompts, params = greedy_inputs(workload_for(model_dir, args.num_requests, args.seed))
    packed_linear.PackedLinear.forward = timed
    try:
        llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
        calls.clear()
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        packed_linear.PackedLinear.forward = run_product
    return calls


def time_alone(calls: dict, dtype: torch.dtype, repeats: int, flush_mib: int) -> dict:
    """{key: (hot seconds, cold seconds)} for one call of each recorded product: the median of ``repeats``."""
    flush = torch.zeros(flush_mib << 18)  # float32: flush_mib MiB
    layers: dict[tuple[int, int], packed_linear.PackedLinear] = {}
    times = {}
    for key in calls:
        _, rows, n_in, n_out = key
        if (n_in, n_out) not in layers:
            layers[(n_in, n_out)] = packed_linear.PackedLinear((torch.randn(n_out, n_in) * n_in ** -0.5).to(dtype),
                                                               None)
        layer, x = layers[(n_in, n_out)], torch.randn(rows, n_in).to(dtype)
        layer(x)
        times[key] = (median_seconds(lambda: layer(x), repeats, None), median_seconds(lambda: layer(x), repeats, flush))
    return times


def median_seconds(fn, repeats: int, flush: torch.Tensor | None) -> float:
    seconds = []
    for _ in range(repeats):
        if flush is not None:
            flush.add_(1.0)
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def summarise(calls: dict, alone: dict) -> list[dict]:
    groups: dict[tuple[str, str], dict] = defaultdict(lambda: dict(calls=0, flop=0.0, run_s=0.0, hot_s=0.0, cold_s=0.0))
    for key, (count, seconds) in calls.items():
        layer, rows, n_in, n_out = key
        group = groups[(layer, bucket_of(rows))]
        group["calls"] += count
        group["flop"] += 2.0 * rows * n_in * n_out * count
        group["run_s"] += seconds
        group["hot_s"] += alone[key][0] * count
        group["cold_s"] += alone[key][1] * count
    return [{"layer": layer, "rows": bucket, **g} for (layer, bucket), g in sorted(groups.items())]


def peak_gflops(calls: dict, alone: dict) -> float:
    """The best hot GFLOPS of any recorded product at PEAK_MIN_ROWS rows or more (of any, where none has as many:
    a small test model's run)."""
    large = [key for key in calls if key[1] >= PEAK_MIN_ROWS] or list(calls)
    return max(2.0 * rows * n_in * n_out / alone[key][0] / 1e9 for key in large for (_, rows, n_in, n_out) in [key])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--model", help="a model directory (default: the bench model)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per product alone, hot and cold each")
    parser.add_argument("--flush-mib", type=int, default=256, help="what passes through the caches before a cold call")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "projection_shapes.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir()
    calls = record_products(model_dir, args)
    alone = time_alone(calls, getattr(torch, args.dtype), args.repeats, args.flush_mib)
    groups = summarise(calls, alone)
    print(f"{'layer':14} {'rows':>7} {'calls':>6}  {'run s':>7} {'GFLOPS':>6}  {'hot s':>7} {'GFLOPS':>6}  "
          f"{'cold s':>7} {'GFLOPS':>6}")
    for g in groups:
        print(f"{g['layer']:14} {g['rows']:>7} {g['calls']:6d}  " + "  ".join(
            f"{g[k]:7.2f} {g['flop'] / g[k] / 1e9:6.0f}" for k in ("run_s", "hot_s", "cold_s")))
    total = {k: sum(g[k] for g in groups) for k in ("flop", "run_s", "hot_s", "cold_s")}
    peak = peak_gflops(calls, alone)
    run_gflops = total["flop"] / total["run_s"] / 1e9
    print(f"all {total['flop'] / 1e12:.3f} TFLOP: run {total['run_s']:.2f} s ({run_gflops:.0f} GFLOPS), alone hot "
          f"{total['hot_s']:.2f} s, cold {total['cold_s']:.2f} s; measured peak {peak:.0f} GFLOPS "
          f"(best hot product of {PEAK_MIN_ROWS}+ rows): the run reaches {100 * run_gflops / peak:.0f} % of it")
    write_report(args.out, {"dtype": args.dtype, "num_requests": args.num_requests, "groups": groups,
                            "peak_gflops": peak, "run_gflops": run_gflops, **{f"total_{k}": v for k, v in total.items()}})


if __name__ == "__main__":
    main()
