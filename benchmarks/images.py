"""Chat with one image, served (`pagedserve serve` on a LLaVA-1.5 model over the bench Llama: a CLIP tower of
224-pixel images, 196 placeholder tokens an image): TTFT and requests/s with the encoder cache, and without it
(--encoder-cache-size 0), when images repeat.

    python benchmarks/images.py --num-requests 48 --distinct-images 4 --concurrency 4

Each request is a chat message: a line of its own (so the prefix cache cannot hold the image's blocks: the
image must be encoded, or found in the encoder cache), then one of --distinct-images images (PNG, as a data
URL), then a question; --output-len greedy tokens out. The two settings alternate, --rounds times each, a fresh
stack each. Writes JSON (benchmarks/results/images.json by default)."""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving import engine_stats, percentiles, served_model, start_stack, stop_stack  # noqa: E402
from benchmarks.workload import bench_model_dir, write_report  # noqa: E402

SETTINGS = {"encoder cache": (), "no encoder cache": ("--encoder-cache-size", "0")}


def image_urls(count: int, seed: int) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    urls = []
    for _ in range(count):
        png = io.BytesIO()
        Image.fromarray((rng.random((256, 256, 3)) * 255).astype("uint8")).save(png, format="PNG")
        urls.append("data:image/png;base64," + base64.b64encode(png.getvalue()).decode())
    return urls


def one_chat(base_url: str, model: str, index: int, url: str, output_len: int) -> dict:
    """A streamed chat; when its first content came and when it ended."""
    body = {"model": model, "stream": True, "temperature": 0, "max_tokens": output_len, "ignore_eos": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": f"Request {index}, from user {index * 7919 % 1000}:"},
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "Describe the picture in detail."}]}]}
    request = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    start, first = time.perf_counter(), None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data: {") and b'"content": "' in line:
                first = time.perf_counter()
    return {"ttft": (first or time.perf_counter()) - start, "end": time.perf_counter() - start}


def run_setting(model_dir: Path, setting: str, urls: list[str], args) -> dict:
    stack = start_stack(model_dir, args.port, *SETTINGS[setting], "--max-num-batched-tokens",
                        str(args.max_num_batched_tokens), "--num-gpu-blocks-override", str(args.blocks))
    base_url = f"http://127.0.0.1:{args.port}/v1"
    try:
        model = served_model(base_url)
        one_chat(base_url, model, -1, urls[0], 1)  # warm: the gateway's processor, the first encoding
        before = engine_stats(base_url)
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: one_chat(base_url, model, i, urls[i % len(urls)], args.output_len),
                                    range(args.num_requests)))
        elapsed = time.perf_counter() - started
        after = engine_stats(base_url)
    finally:
        stop_stack(stack)
    return {"elapsed_s": elapsed, "requests_per_s": args.num_requests / elapsed,
            "ttft_s": percentiles([r["ttft"] for r in results]),
            "prompt_tokens_computed": after.get("prompt_tokens_computed", 0) - before.get("prompt_tokens_computed", 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a LLaVA model directory (default: the bench LLaVA)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--distinct-images", type=int, default=4, help="images the requests cycle through")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=1024, help="KV blocks (16 tokens each)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated")
    parser.add_argument("--port", type=int, default=8350)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "images.json"))
    args = parser.parse_args()
    model_dir = Path(args.model) if args.model else bench_model_dir("llava")
    urls = image_urls(args.distinct_images, args.seed)
    runs: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
    for round_index in range(args.rounds):
        order = list(SETTINGS) if round_index % 2 == 0 else list(SETTINGS)[::-1]
        for setting in order:
            result = run_setting(model_dir, setting, urls, args)
            runs[setting].append(result)
            print(f"{setting:<17} TTFT p50 {result['ttft_s']['p50'] * 1000:7.1f} ms  p99 "
                  f"{result['ttft_s']['p99'] * 1000:7.1f} ms  {result['requests_per_s']:.2f} req/s", flush=True)
    median = {setting: {"ttft_p50_s": statistics.median(r["ttft_s"]["p50"] for r in runs[setting]),
                        "requests_per_s": statistics.median(r["requests_per_s"] for r in runs[setting])}
              for setting in SETTINGS}
    ratio = median["no encoder cache"]["ttft_p50_s"] / median["encoder cache"]["ttft_p50_s"]
    print(f"TTFT p50 without / with the encoder cache: {ratio:.2f}x; requests/s "
          f"{median['no encoder cache']['requests_per_s']:.2f} -> {median['encoder cache']['requests_per_s']:.2f}")
    out = write_report(args.out, {"args": vars(args), "runs": runs, "median": median, "ttft_p50_ratio": ratio})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
