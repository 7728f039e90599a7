"""The bench workload through vLLM's offline engine; run with a Python that has vLLM installed
(a separate virtual environment). Prints one JSON line: elapsed_s and output_tokens."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import bench_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = bench_workload(args.num_requests, args.seed)
    # On CPU this fraction reserves host memory; half leaves room for the process that launched us.
    llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, seed=args.seed,
              gpu_memory_utilization=0.5)
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"elapsed_s": elapsed, "output_tokens": tokens}))


if __name__ == "__main__":
    main()
