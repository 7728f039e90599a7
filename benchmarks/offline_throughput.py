"""Offline throughput: pagedserve's LLM.generate against transformers generate on the same
weights and requests — (a) one request at a time, (b) left-padded static batches of 32 — and,
when a Python with vLLM is given (--vllm-python), vLLM's engine in a separate process.

    python benchmarks/offline_throughput.py --num-requests 200 [--vllm-python /path/to/venv/bin/python]
        [--rounds 2] [--dtype bfloat16]

With --rounds N (and --skip-hf) pagedserve and vLLM alternate N times, each engine in a fresh process every round;
the ratio quoted is the median of the rounds'.

Prints a table and writes JSON (benchmarks/results/offline_throughput.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.workload import (  # noqa: E402
    BENCH_ARCHITECTURES, BenchRequest, bench_model_dir, greedy_inputs, workload_for, write_report)


def run_pagedserve(model_dir: Path, requests: list[BenchRequest], args) -> dict:
    from pagedserve import LLM

    llm = LLM(str(model_dir), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, model_impl=getattr(args, "model_impl", "auto"),
              kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
              kv_cache_memory_bytes=getattr(args, "kv_cache_memory_bytes", None), dtype=getattr(args, "dtype", "auto"))
    prompts, params = greedy_inputs(requests)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == sum(r.output_len for r in requests)
    stats = {k: v - before.get(k, 0) if k.endswith(("_s", "steps", "preemptions")) and not isinstance(v, dict)
             else v for k, v in llm.stats().items()}  # (histograms, such as request_num_preemptions, are dicts)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "kv_blocks": llm.engine.info.num_kv_blocks,
            "kv_waste_pct_peak": stats["kv_waste_pct_peak"],
            "num_preemptions": stats["num_preemptions"], "num_steps": stats["num_steps"],
            "forward_s": stats["forward_time_s"], "sample_s": stats["sample_time_s"],
            "scheduler_s": stats["scheduler_time_s"],
            "other_overhead_s": elapsed - stats["step_time_s"]}


def hf_model(model_dir: Path, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    model.generation_config.pad_token_id = 0
    return model


def run_hf_one_at_a_time(model, requests: list[BenchRequest]) -> dict:
    start = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for r in requests:
            out = model.generate(torch.tensor([r.prompt_token_ids]), do_sample=False, max_new_tokens=r.output_len)
            tokens += out.shape[1] - len(r.prompt_token_ids)
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": tokens}


def run_hf_static_batches(model, requests: list[BenchRequest], batch_size: int) -> dict:
    """Left-padded static batches: each runs until its longest output is done; useful tokens are counted."""
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
                mask[row, width - len(r.prompt_token_ids):] = 1
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max(r.output_len for r in batch))
    return {"elapsed_s": time.perf_counter() - start, "output_tokens": sum(r.output_len for r in requests)}


def run_pagedserve_process(model_dir: Path, args) -> dict:
    """run_pagedserve in a process of its own, as vLLM's runs are: an engine made in this process after vLLM's run
    measured 6-10 % slower than the first (forward, sampling and scheduling alike), a penalty vLLM, started afresh
    each round, never paid."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "pagedserve.json"
        cmd = [sys.executable, __file__, "--skip-hf", "--model", str(model_dir), "--num-requests", str(args.num_requests),
               "--seed", str(args.seed), "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
               "--dtype", args.dtype, "--model-impl", args.model_impl, "--out", str(out)]
        if args.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["results"]["pagedserve"]


def run_vllm(python: str, model_dir: Path, args) -> dict | None:
    script = Path(__file__).with_name("vllm_offline.py")
    cmd = [python, str(script), "--model", str(model_dir), "--num-requests", str(args.num_requests),
           "--seed", str(args.seed), "--block-size", str(args.vllm_block_size),
           "--dtype", getattr(args, "vllm_dtype", "float32")]
    # In-process engine core, like ours (its multiprocess mode fails to start on this 2-core sandbox).
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true", help="measure pagedserve only")
    parser.add_argument("--skip-hf-one-at-a-time", action="store_true", help="the slowest baseline (minutes)")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--vllm-python", default=None, help="a Python with vllm installed (separate venv)")
    parser.add_argument("--vllm-block-size", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="both engines' weights and activations (the bench model is saved in float32)")
    parser.add_argument("--model-impl", choices=("auto", "native", "transformers"), default="auto",
                        help="pagedserve's implementation of the model (benchmarks/model_impl.py compares them)")
    parser.add_argument("--architecture", choices=sorted(BENCH_ARCHITECTURES), default="llama",
                        help="the bench model's shape in this architecture (gemma2: windows and soft caps)")
    parser.add_argument("--model", default=None, help="a model directory instead of the bench model")
    parser.add_argument("--rounds", type=int, default=1, help="pagedserve then vLLM, this many times (--skip-hf)")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "offline_throughput.json"))
    args = parser.parse_args()
    args.vllm_dtype = args.dtype

    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else bench_model_dir(args.architecture)
    requests = workload_for(model_dir, args.num_requests, args.seed)
    if args.rounds > 1:
        alternate(model_dir, requests, args)
        return
    results = {"pagedserve": run_pagedserve(model_dir, requests, args)}
    if not args.skip_hf:
        model = hf_model(model_dir, args.dtype)
        results["hf_static_batch"] = run_hf_static_batches(model, requests, args.hf_batch_size)
        if not args.skip_hf_one_at_a_time:
            results["hf_one_at_a_time"] = run_hf_one_at_a_time(model, requests)
    if args.vllm_python:
        vllm = run_vllm(args.vllm_python, model_dir, args)
        if vllm is not None:
            results["vllm"] = vllm
    report(results, args, len(requests))


def alternate(model_dir: Path, requests: list[BenchRequest], args) -> None:
    """pagedserve and vLLM in turn, args.rounds times; each round's tokens/s and the median ratio."""
    if not args.vllm_python:
        raise SystemExit("--rounds alternates with vLLM: give --vllm-python")
    rounds = []
    for index in range(args.rounds):
        ours, theirs = run_pagedserve_process(model_dir, args), run_vllm(args.vllm_python, model_dir, args)
        if theirs is None:
            raise SystemExit("vLLM's run failed (its error is above)")
        tps = [r["output_tokens"] / r["elapsed_s"] for r in (ours, theirs)]
        rounds.append({"pagedserve": ours, "vllm": theirs, "ratio": tps[0] / tps[1]})
        print(f"round {index + 1}: pagedserve {tps[0]:.1f} tok/s, vLLM {tps[1]:.1f} tok/s, {tps[0] / tps[1]:.2f}x",
              flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    print(f"pagedserve / vLLM ({args.dtype}), median of {args.rounds} rounds: {ratio:.2f}x")
    write_report(args.out, {"num_requests": len(requests), "dtype": args.dtype, "rounds": rounds, "ratio": ratio})


def report(results: dict, args, num_requests: int) -> None:
    for r in results.values():
        r["tokens_per_s"] = r["output_tokens"] / r["elapsed_s"]
        r["requests_per_s"] = num_requests / r["elapsed_s"]
    ours = results["pagedserve"]["tokens_per_s"]
    print(f"\n{'engine':<18}{'out tok/s':>11}{'req/s':>9}{'pagedserve ×':>14}")
    for name, r in results.items():
        print(f"{name:<18}{r['tokens_per_s']:>11.1f}{r['requests_per_s']:>9.3f}{ours / r['tokens_per_s']:>14.2f}")
    print(f"peak KV waste: {results['pagedserve']['kv_waste_pct_peak']:.2f}%   "
          f"preemptions: {results['pagedserve']['num_preemptions']}")
    out = write_report(args.out, {"architecture": args.architecture, "num_requests": num_requests, "seed": args.seed,
                                  "torch_threads": torch.get_num_threads(), "results": results})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
