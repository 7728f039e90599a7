"""Could weight-only checkpoints (W4A16, W8A16) stay packed on a CPU? PyTorch's own CPU kernels for them,
``_weight_int4pack_mm_for_cpu`` (4-bit, groups of 128, a scale and zero per group) and ``_weight_int8pack_mm``
(8-bit, a scale per row), against what pagedserve runs today: the weights dequantized at load into oneDNN's
packed float32 layout (``PackedLinear``). The bench model's projections, decode-sized and prefill-sized row
counts, float32 and bfloat16 activations; best of the repeats, microseconds.

    python benchmarks/cpu_weight_only.py [--rows 1 16 256] [--repeats 20] [--out results/cpu_weight_only.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.cpu_linear import best_seconds  # noqa: E402
from benchmarks.workload import write_report  # noqa: E402
from services.worker.models.packed_linear import PackedLinear  # noqa: E402

SHAPES = [("qkv", 1024, 512), ("gate_up", 2816, 512), ("down", 512, 1408)]  # (name, N, K) of the bench model
GROUP = 128
INNER_K_TILES = 8  # the int4 packing's K tiling (what torchao passes on CPUs)


def best_us(fn, repeats: int) -> float:
    return best_seconds(fn, repeats) * 1e6


def layer_kernels(n: int, k: int, generator: torch.Generator):
    """(plain float32 weight, the int4 kernel's packed codes and scales-and-zeros, int8 codes and row scales)."""
    codes4 = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.int32)
    packed4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes4, INNER_K_TILES)
    scales = torch.rand(k // GROUP, n, generator=generator) * 0.01
    scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).contiguous()
    codes8 = torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    return torch.randn(n, k, generator=generator) * 0.02, packed4, scales_and_zeros, codes8, torch.rand(n) * 0.01


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "cpu_weight_only.json"))
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"{'layer':<9}{'rows':>6}{'dtype':>10}{'float32 packed':>16}{'int4 groups':>13}{'int8 rows':>11}  µs")
    for name, n, k in SHAPES:
        weight, packed4, scales_and_zeros, codes8, scales8 = layer_kernels(n, k, generator)
        dense = PackedLinear(weight, None)
        for m in args.rows:
            x32 = torch.randn(m, k, generator=generator)
            baseline = best_us(lambda: dense(x32), args.repeats)
            for dtype in (torch.float32, torch.bfloat16):
                x = x32.to(dtype)
                sz, s8 = scales_and_zeros.to(dtype), scales8.to(dtype)
                int4 = best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed4, GROUP, sz), args.repeats)
                int8 = best_us(lambda: torch.ops.aten._weight_int8pack_mm(x, codes8, s8), args.repeats)
                rows_out.append({"layer": name, "n": n, "k": k, "rows": m, "dtype": str(dtype).removeprefix("torch."),
                                 "float32_packed_us": baseline, "int4_us": int4, "int8_us": int8})
                print(f"{name:<9}{m:>6}{rows_out[-1]['dtype']:>10}{baseline:>16.1f}{int4:>13.1f}{int8:>11.1f}")
    print(f"wrote {write_report(args.out, {'group': GROUP, 'threads': torch.get_num_threads(), 'cases': rows_out})}")


if __name__ == "__main__":
    main()
