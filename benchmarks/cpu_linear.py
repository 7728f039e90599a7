"""CPU projection microbenchmark: ``F.linear``, oneDNN on a weight packed once, and ``PackedLinear``.

The bench model's projections (qkv, o, gate_up, down, logits head) at decode-sized and
prefill-sized row counts, float32 (or --dtype bfloat16), interleaved repeats; reports GFLOPS (best of the repeats, the
steadier number on a shared machine) and the packed/plain ratio. PackedLinear is oneDNN on the packed weight, except
where packed_linear.uses_panel_kernel picks services/worker/attention/csrc/panel_linear.cpp (AVX512-BF16 without
AMX; float32 without AVX-512). With ``--flush-mib N`` every call
follows N MiB written through the caches, so the weights come from memory, as in a decode step (the median is
reported then: the best would be a call the flush missed).

    python benchmarks/cpu_linear.py [--threads 2] [--repeats 20] [--dtype bfloat16] [--flush-mib 96]
        [--out results/cpu_linear.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.workload import write_report  # noqa: E402
from services.worker.cpu_tuning import keep_large_allocations_in_heap  # noqa: E402
from services.worker.models.packed_linear import PackedLinear  # noqa: E402

# (name, out_features, in_features) of the bench model: hidden 512, 8 + 2 * 4 heads of 64, MLP 1408.
SHAPES = [("qkv", 1024, 512), ("o", 512, 512), ("gate_up", 2816, 512), ("down", 512, 1408),
          ("logits", 32000, 512)]
ROWS = [16, 64, 128, 256, 1024, 4096]


def best_seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cold_seconds(fn, repeats: int, flush: torch.Tensor) -> float:
    """The median of ``repeats`` calls, each after ``flush`` is written through the caches."""
    times = []
    for _ in range(repeats):
        flush.add_(1)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seconds(fn, repeats: int, flush: torch.Tensor | None) -> float:
    return best_seconds(fn, repeats) if flush is None else cold_seconds(fn, repeats, flush)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--flush-mib", type=int, default=0, help="write this much through the caches before each call")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "cpu_linear.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_large_allocations_in_heap()  # as the worker does: outputs not page-faulted afresh on every call
    dtype = getattr(torch, args.dtype)
    flush = torch.zeros(args.flush_mib << 20, dtype=torch.uint8) if args.flush_mib else None
    rows_out = []
    print(f"{'layer':8} {'rows':>5} {'F.linear':>9} {'oneDNN':>9} {'packed':>9} {'ratio':>6}   (GFLOPS; ratio: "
          f"packed / F.linear)")
    with torch.inference_mode():
        for name, out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features) * in_features ** -0.5).to(dtype)
            packed = PackedLinear(weight, None)
            onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 256)
            for rows in ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                flops = 2 * rows * in_features * out_features
                plain_s = seconds(lambda: F.linear(x, weight), args.repeats, flush)
                onednn_s = seconds(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
                                   args.repeats, flush)
                packed_s = seconds(lambda: packed(x), args.repeats, flush)
                row = {"layer": name, "rows": rows, "f_linear_gflops": flops / plain_s / 1e9,
                       "onednn_gflops": flops / onednn_s / 1e9, "packed_gflops": flops / packed_s / 1e9,
                       "ratio": plain_s / packed_s}
                rows_out.append(row)
                print(f"{name:8} {rows:5d} {row['f_linear_gflops']:9.0f} {row['onednn_gflops']:9.0f} "
                      f"{row['packed_gflops']:9.0f} {row['ratio']:6.2f}")
    report = {"threads": args.threads, "dtype": args.dtype, "flush_mib": args.flush_mib,
              "panel_kernel": packed.panel_kernel, "rows": rows_out}
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
