"""Quantized checkpoints of the bench model against the float32 original, offline, in one run: the same
requests, the modes alternated round by round, each run in its own fresh LLM.

    python benchmarks/quantization.py --num-requests 100 [--vllm-python /path/to/vllm-venv/bin/python]

Modes: float32 (the bench model); fp8-kv (the bench model over an FP8 e4m3 KV cache in the same budget); w8a8-int8 (compressed-tensors W8A8: int8 layers, activations quantized per
token); w4a16 (compressed-tensors pack-quantized, group 128: dequantized at load); fp8-block (128 x 128 blocks
as DeepSeek-V3: upcast at load). The checkpoints are the bench model packed by the tests' writer
(tests/quantized_checkpoints.py: compressed-tensors' own compressors), made once and kept beside it.

Prints each run's output tokens per second, each mode's ratio to float32, the bytes its weights take on disk
and once loaded, the KV blocks its budget held (--kv-cache-memory-bytes); with --vllm-python, vLLM's CPU engine on the float32 and W8A8 checkpoints in the same run.
Writes JSON (benchmarks/results/quantization.json by default)."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.offline_throughput import run_pagedserve, run_vllm  # noqa: E402
from benchmarks.workload import bench_model_dir, workload_for, write_report  # noqa: E402

# mode -> (the writer's scheme, its options); float32 is the bench model itself.
SCHEMES = {"w8a8-int8": ("ct-w8a8-int8", {}), "w4a16": ("ct-wNa16", dict(bits=4, group_size=128)),
           "fp8-block": ("fp8-block", dict(block=(128, 128)))}
MODES = ("float32", "fp8-kv", *SCHEMES)


def checkpoint_dir(base: Path, mode: str) -> Path:
    """The bench model in ``mode``'s format, written on first use."""
    if mode in ("float32", "fp8-kv"):
        return base
    target = base.parent / f"{base.name}-{mode}"
    quantized = target / "quantized"
    if not (quantized / "config.json").is_file():
        from tests.quantized_checkpoints import write_quantized

        scheme, options = SCHEMES[mode]
        print(f"writing the bench model as {mode} ...", flush=True)
        write_quantized(base, target, scheme, **options)
    return quantized


def weight_bytes(model_dir: Path) -> dict:
    """Bytes of the checkpoint's weight files, and of the parameters the loaded model holds (unpacked)."""
    from services.worker.model_loader import checkpoint_files, load_model

    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), pack=False)
    loaded = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"disk_bytes": sum(f.stat().st_size for f in checkpoint_files(model_dir)), "loaded_bytes": loaded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--model", default=None, help="a float model directory (default: the bench model)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="pagedserve's activations in every mode (vLLM runs W8A8 in bfloat16 whatever this says)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="the KV budget of every mode (default: the CPU's 4 GiB, capped by what the workload needs)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm installed (separate venv)")
    parser.add_argument("--vllm-block-size", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "quantization.json"))
    args = parser.parse_args()
    base = Path(args.model) if args.model else bench_model_dir()
    dirs = {mode: checkpoint_dir(base, mode) for mode in args.modes}
    requests = workload_for(base, args.num_requests, args.seed)
    sizes = {mode: weight_bytes(path) for mode, path in dirs.items()}
    runs: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for _ in range(args.rounds):
        for mode, path in dirs.items():
            args.kv_cache_dtype = "fp8" if mode == "fp8-kv" else "auto"
            run = run_pagedserve(path, requests, args)
            run["tokens_per_s"] = run["output_tokens"] / run["elapsed_s"]
            runs[mode].append(run)
            print(f"{mode:<12}{run['tokens_per_s']:>9.1f} tok/s  forward {run['forward_s']:.1f} s  "
                  f"KV blocks {run['kv_blocks']}", flush=True)
        if args.vllm_python:
            for mode in ("float32", "w8a8-int8"):
                if mode in dirs:
                    run_vllm_mode(args, dirs[mode], mode, runs)
    report(args, runs, sizes, len(requests))


def run_vllm_mode(args, model_dir: Path, mode: str, runs: dict) -> None:
    """vLLM's CPU engine on one checkpoint: the float model in our dtype, W8A8 in bfloat16 (its CPU W8A8
    kernels' activations)."""
    args.vllm_dtype = "float32" if mode == "float32" and args.dtype != "bfloat16" else "bfloat16"
    run = run_vllm(args.vllm_python, model_dir, args)
    name = f"vllm {mode}"
    if run is None:
        print(f"{name:<12} failed (its error is above)", flush=True)
        return
    run["tokens_per_s"] = run["output_tokens"] / run["elapsed_s"]
    runs.setdefault(name, []).append(run)
    print(f"{name:<12}{run['tokens_per_s']:>9.1f} tok/s", flush=True)


def report(args, runs: dict, sizes: dict, num_requests: int) -> None:
    median = {mode: statistics.median(r["tokens_per_s"] for r in mode_runs) for mode, mode_runs in runs.items()}
    base = median.get("float32")
    print(f"\n{'mode':<16}{'tok/s':>9}{'x float32':>11}{'disk MB':>10}{'loaded MB':>11}")
    for mode, value in median.items():
        ratio = f"{value / base:.2f}" if base else "-"
        size = sizes.get(mode, {})
        disk = f"{size['disk_bytes'] / 1e6:.1f}" if size else "-"
        loaded = f"{size['loaded_bytes'] / 1e6:.1f}" if size else "-"
        print(f"{mode:<16}{value:>9.1f}{ratio:>11}{disk:>10}{loaded:>11}")
    if "w8a8-int8" in median and "vllm w8a8-int8" in median:
        print(f"pagedserve / vLLM on W8A8 int8: {median['w8a8-int8'] / median['vllm w8a8-int8']:.2f}x")
    out = write_report(args.out, {"num_requests": num_requests, "seed": args.seed, "rounds": args.rounds,
                                  "dtype": args.dtype,
                                  "torch_threads": torch.get_num_threads(), "runs": runs, "sizes": sizes,
                                  "median_tokens_per_s": median})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
