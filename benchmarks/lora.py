"""LoRA adapters: what serving through them costs, against the base model, in one run.

The bench model (benchmarks/workload.py) and random rank-R adapters on every projection. The same
greedy requests run:

- ``base``: an engine without LoRA;
- ``enabled_unused``: an engine with room for --max-loras adapters, requests without one (the adapters'
  matmuls are skipped: this should cost nothing);
- ``one_adapter``: every request with the same adapter;
- ``mixed``: the requests spread round-robin over --max-loras adapters, all of them in every step;
- ``merged``: the first adapter merged into the weights, no LoRA (what one adapter costs at best).

For each, output tokens per second (the median of --rounds runs, the modes interleaved so a drifting
machine hits them alike) and the ratio to ``base``. ``one_adapter``'s tokens are compared with
``merged``'s (the same function, up to float rounding): the share of requests whose tokens are equal.

    python benchmarks/lora.py --requests 32 --max-tokens 64 --rank 16 --max-loras 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, write_report  # noqa: E402
from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from tests.lora_adapters import make_adapter, merged_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bench model)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "lora.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    model = Path(args.model) if args.model else bench_model_dir()
    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [make_adapter(model, work / f"adapter{i}", rank=args.rank, alpha=2.0 * args.rank, seed=i, std=0.02)
                for i in range(args.max_loras)]
    merged = merged_model(model, adapters[0], work / "merged")
    loras = [LoRARequest(f"adapter{i}", str(path)) for i, path in enumerate(adapters)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {"base": LLM(str(model)), "merged": LLM(str(merged)),
               "lora": LLM(str(model), enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank)}
    rng, vocab = random.Random(0), engines["base"].engine.info.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    modes = {"base": ("base", None), "enabled_unused": ("lora", None), "one_adapter": ("lora", loras[0]),
             "mixed": ("lora", [loras[i % len(loras)] for i in range(args.requests)]), "merged": ("merged", None)}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list[list[int]]] = {}
    for engine, lora in modes.values():  # warm-up: first calls build kernels and read adapters
        engines[engine].generate(prompts[:2], params, use_tqdm=False,
                                 lora_request=lora[:2] if isinstance(lora, list) else lora)
    for _ in range(args.rounds):
        for mode, (engine, lora) in modes.items():
            start = time.perf_counter()
            outputs = engines[engine].generate(prompts, params, use_tqdm=False, lora_request=lora)
            seconds[mode].append(time.perf_counter() - start)
            tokens[mode] = [list(out.outputs[0].token_ids) for out in outputs]
    output_tokens = args.requests * args.max_tokens
    rows = {mode: {"tokens_per_s": round(output_tokens / statistics.median(s), 1)} for mode, s in seconds.items()}
    for mode, row in rows.items():
        row["vs_base"] = round(row["tokens_per_s"] / rows["base"]["tokens_per_s"], 3)
        print(f"{mode:15s} {row['tokens_per_s']:9.1f} tok/s  {row['vs_base']:.3f}x base", flush=True)
    equal = sum(a == b for a, b in zip(tokens["one_adapter"], tokens["merged"])) / args.requests
    changed = sum(a != b for a, b in zip(tokens["one_adapter"], tokens["base"])) / args.requests
    print(f"one_adapter equals merged on {equal:.0%} of requests; differs from base on {changed:.0%}")
    shape = {k: getattr(args, k) for k in ("requests", "prompt_len", "max_tokens", "rank", "max_loras", "rounds")}
    report = {"shape": {**shape, "model": str(model)}, "rows": rows, "one_adapter_equals_merged": equal,
              "one_adapter_differs_from_base": changed}
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
