"""A mixture-of-experts layer's experts: ours against transformers' on the same weights and routing.

One sparse layer of random weights (default: Qwen3-30B-A3B's routing, 128 experts of which 8 per
token, at a quarter of its width so it fits a small machine). For each token count, the same
inputs and routing go through:

- ``transformers``: its experts module, eager (a matmul pair per expert hit, found with a sync per expert);
- ``grouped``: ours (services/worker/models/moe.py): grouped by one sort, one sync;
- ``grouped+packed``: the same with each expert's weights in oneDNN's layout (float32 on a CPU: what the
  worker runs there);
- ``fused``: the Triton kernel (fused_moe.py; CUDA only: what the worker runs on GPUs).

Each variant's output is checked against transformers' first (relative error); then the median of
--repeats timed calls is reported, and the speed-up over transformers.

    python benchmarks/moe_layer.py --tokens 1 16 256 --repeats 20
    python benchmarks/moe_layer.py --device cuda --dtype bfloat16 --hidden 2048 --inter 768  # full width
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import write_report  # noqa: E402
from services.worker.models.moe import SparseMoeBlock, select_experts  # noqa: E402
from services.worker.tensor_parallel import TensorParallel  # noqa: E402
from services.worker.moe_config import MoEConfig  # noqa: E402

MAX_RELATIVE_ERROR = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(MAX_RELATIVE_ERROR))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=192, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "moe_layer.json"))
    return parser.parse_args()


def build_block(args, device: torch.device, dtype: torch.dtype) -> SparseMoeBlock:
    moe = MoEConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.inter, renormalize=True,
                    float32_weights=False, sparse_layers=(0,))
    block = SparseMoeBlock(args.hidden, moe, TensorParallel(), None)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype).eval()


def transformers_experts(block: SparseMoeBlock):
    """transformers' Qwen3-MoE experts module holding the same weights (its layout is ours)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=block.w13.shape[2], moe_intermediate_size=block.w2.shape[2],
                            num_experts=block.moe.num_experts, num_experts_per_tok=block.moe.top_k)
    config._experts_implementation = "eager"  # its loop over experts (not torch's grouped_mm)
    experts = Qwen3MoeExperts(config).to(device=block.w13.device, dtype=block.w13.dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(block.w13)
        experts.down_proj.copy_(block.w2)
    return experts.eval()


def variants(block: SparseMoeBlock, device: torch.device, dtype: torch.dtype) -> dict:
    hf = transformers_experts(block)
    found = {"transformers": lambda x, w, i: hf(x, i, w), "grouped": block.run_experts}
    if device.type == "cpu" and dtype == torch.float32:
        packed = build_block_copy(block)
        packed.pack_experts()
        found["grouped+packed"] = packed.run_experts
    if device.type == "cuda":
        from services.worker.models.fused_moe import fused_experts

        found["fused"] = lambda x, w, i: fused_experts(x, block.w13, block.w2, w, i)
    return found


def build_block_copy(block: SparseMoeBlock) -> SparseMoeBlock:
    copy = SparseMoeBlock(block.w13.shape[2], block.moe, TensorParallel(), None).to(block.w13.dtype)
    copy.load_state_dict(block.state_dict())
    return copy.eval()


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm up (Triton compiles on first call)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    block = build_block(args, device, dtype)
    runs = variants(block, device, dtype)
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
            weights, ids = select_experts(block.gate(x), block.moe, dtype)
            reference = runs["transformers"](x, weights, ids).float()
            row: dict = {"tokens": tokens, "experts_hit": int(ids.unique().numel())}
            for name, fn in runs.items():
                error = ((fn(x, weights, ids).float() - reference).norm() / reference.norm()).item()
                if error > MAX_RELATIVE_ERROR[args.dtype]:
                    raise SystemExit(f"{name} at {tokens} tokens: relative error {error:.2e} against transformers")
                row[f"{name}_ms"] = round(1e3 * median_seconds(lambda: fn(x, weights, ids), device, args.repeats), 3)
                row[f"{name}_error"] = error
            for name in runs:
                row[f"{name}_speedup"] = round(row["transformers_ms"] / row[f"{name}_ms"], 2)
            rows.append(row)
            print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                            if not k.endswith("_error")), flush=True)
    shape = {k: getattr(args, k) for k in ("device", "dtype", "hidden", "inter", "experts", "top_k", "repeats")}
    if device.type == "cuda":
        shape["gpu"] = torch.cuda.get_device_name(device)
    print(f"wrote {write_report(args.out, {'shape': shape, 'rows': rows})}")


if __name__ == "__main__":
    main()
