"""What a crash costs the requests in flight: with the gateway resuming them, and without.

Starts `pagedserve serve` on the bench model, streams C concurrent greedy completions of T tokens,
and once each has produced K tokens kills a process (the worker, or the scheduler) with SIGKILL;
the launcher starts it again. Per mode (resumption on, and --max-resumes 0) it reports how many
requests completed, whether their text equals an uninterrupted run's, the pause the completed
streams saw (their longest gap between chunks, against the same in the uninterrupted run) and the
wall time of the whole batch against the uninterrupted one, all from one run.

    python benchmarks/resumption.py --concurrency 16 --max-tokens 128 --kill-after 32 --victim worker
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx2 as httpx  # noqa: E402

from benchmarks.serving import process_names, served_model, start_stack, stop_stack  # noqa: E402
from benchmarks.workload import bench_model_dir, bench_workload, write_report  # noqa: E402


class Stream(threading.Thread):
    """One streamed completion: its text, chunk arrival times and how it ended."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.text, self.arrivals, self.finish, self.error = "", [], None, None
        self.tokens = 0  # generated so far, as the chunks' usage says (a chunk may carry several tokens)

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, timeout=300) as reply:
                if reply.status_code != 200:
                    self.error = f"HTTP {reply.status_code}"
                    return
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]["message"]
                        continue
                    self.tokens = (chunk.get("usage") or {}).get("completion_tokens", self.tokens)
                    if not chunk["choices"]:  # the closing usage chunk
                        continue
                    choice = chunk["choices"][0]
                    self.text += choice["text"]
                    self.finish = choice["finish_reason"] or self.finish
                    self.arrivals.append(time.perf_counter())
        except httpx.HTTPError as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def resumed_at(self, crashed_at: float) -> float | None:
        """When the first token of the resumed request came: the arrival ending the longest pause after
        the kill (tokens the dead worker had already sent can arrive a moment after it)."""
        times = [crashed_at] + [t for t in self.arrivals if t > crashed_at]
        gaps = [(b - a, b) for a, b in zip(times, times[1:])]
        return max(gaps)[1] if gaps else None

    @property
    def longest_gap_s(self) -> float:
        return max((b - a for a, b in zip(self.arrivals, self.arrivals[1:])), default=0.0)


def run_batch(port: int, model: str, prompts: list[list[int]], max_tokens: int, crash=None,
              kill_after: int = 0) -> tuple[list[Stream], float, float | None]:
    """The streams, the batch's wall time and, with crash, when it ran (perf_counter; None: it did not run,
    because a stream was not in flight any more when the others had their kill_after tokens)."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    streams = [Stream(url, {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
               for p in prompts]
    started = time.perf_counter()
    for stream in streams:
        stream.start()
    crashed_at = None
    if crash is not None:
        # Tokens, not chunks: on a busy host a chunk carries several, and counting chunks let streams run
        # to their end before the kill (CI saw two of three never interrupted).
        while any(s.tokens < kill_after and s.is_alive() for s in streams):
            time.sleep(0.001)
        # Every stream must still be in flight, well before its end: on a busy host one stream can start so
        # late that the others finish before it has its first tokens (CI saw one of three resumed).
        if all(s.is_alive() and s.tokens < (kill_after + max_tokens) // 2 for s in streams):
            crashed_at = time.perf_counter()
            crash()
    for stream in streams:
        stream.join()
    return streams, time.perf_counter() - started, crashed_at


def child_pid(launcher: subprocess.Popen, role: str) -> int:
    return next(pid for pid, name in process_names(launcher.pid).items() if name == role)


def resumed_requests(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        lines = reply.read().decode().splitlines()
    return next(float(line.split()[1]) for line in lines if line.startswith("pagedserve_resumed_requests_total "))


KILL_TRIES = 5


def one_mode(model_dir: Path, port: int, prompts, args, resume: bool) -> dict:
    extra = [] if resume else ["--max-resumes", "0"]
    serve = start_stack(model_dir, port, *extra, *args.serve_arg)
    try:
        model = served_model(f"http://127.0.0.1:{port}/v1")
        run_batch(port, model, prompts[:2], 8)  # warm-up: first touches of the pools
        clean, clean_s, _ = run_batch(port, model, prompts, args.max_tokens)
        assert all(s.error is None for s in clean), [s.error for s in clean]
        victim = child_pid(serve, args.victim)  # found before the batch: the kill itself is then at once
        for _ in range(KILL_TRIES):
            hit, hit_s, crashed_at = run_batch(port, model, prompts, args.max_tokens,
                                               lambda: os.kill(victim, signal.SIGKILL), args.kill_after)
            if crashed_at is not None:
                break
            if errors := sorted({s.error for s in hit if s.error is not None}):
                raise RuntimeError(f"a stream failed before the kill: {errors}")
        else:
            raise RuntimeError(f"in {KILL_TRIES} batches the kill never found every stream in flight: raise "
                               "--max-tokens, or lower --concurrency to what the server runs at once")
        resumed = resumed_requests(port)
    finally:
        stop_stack(serve)
    completed = [s for s in hit if s.error is None and s.finish == "length"]
    same = sum(s.text == c.text for s, c in zip(hit, clean) if s in completed)
    pauses = [s.longest_gap_s for s in completed]
    resumed_at = [s.resumed_at(crashed_at) for s in completed]
    return {
        "resume": resume,
        "requests": len(hit),
        "completed": len(completed),
        "completed_with_uninterrupted_text": same,
        "resumed_requests": resumed,
        "errors": sorted({s.error for s in hit if s.error is not None}),
        "uninterrupted_longest_gap_s": round(statistics.median(s.longest_gap_s for s in clean), 3),
        "median_longest_gap_s": round(statistics.median(pauses), 3) if pauses else None,
        "kill_to_first_token_after_s": round(statistics.median(t - crashed_at for t in resumed_at if t), 3)
        if any(resumed_at) else None,
        "batch_s": round(hit_s, 2),
        "uninterrupted_batch_s": round(clean_s, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bench model)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kill-after", type=int, default=32, help="tokens each stream has generated before the kill")
    parser.add_argument("--victim", choices=["worker", "scheduler"], default="worker")
    parser.add_argument("--modes", default="resume,no-resume", help="comma-separated: resume, no-resume")
    parser.add_argument("--serve-arg", action="append", default=[], help="one more argument for pagedserve serve")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "resumption.json"))
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if not 0 < args.kill_after < args.max_tokens:
        parser.error("--kill-after must be between 0 and --max-tokens")

    model_dir = Path(args.model) if args.model else bench_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [r.prompt_token_ids for r in bench_workload(args.concurrency, seed=1, vocab_size=vocab,
                                                          prompt_range=(args.prompt_len, args.prompt_len))]
    report = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "kill_after": args.kill_after,
              "victim": args.victim, "modes": []}
    for mode in args.modes.split(","):
        report["modes"].append(one_mode(model_dir, args.port, prompts, args, resume=mode == "resume"))
        print(json.dumps(report["modes"][-1]), file=sys.stderr)
    print(json.dumps(report, indent=2))
    write_report(args.out, report)


if __name__ == "__main__":
    main()
