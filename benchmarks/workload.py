"""The bench workload, the bench model and the JSON report, shared by the benchmark scripts."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def bench_workload(num_requests: int = 200, seed: int = 0, vocab_size: int = 32000,
                   prompt_range: tuple[int, int] = (16, 512),
                   output_range: tuple[int, int] = (16, 256)) -> list[BenchRequest]:
    """Random token ids; prompt and output lengths uniform in the given ranges (inclusive)."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))],
                         rng.randint(*output_range)) for _ in range(num_requests)]


# The bench model's shape in other architectures: Gemma 2 with its caps and every other layer in a 256-key
# window (the workload's prompts run to 512), GQA heads of 64.
BENCH_ARCHITECTURES = {"llama": {}, "gemma2": dict(model_type="gemma2", head_dim=64, sliding_window=256,
                                                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                    query_pre_attn_scalar=64, tie_word_embeddings=True),
                       "mistral": dict(model_type="mistral", sliding_window=256),  # every layer windowed
                       # LLaVA-1.5 over the bench Llama: a CLIP tower of 224-pixel images in 16-pixel patches (196
                       # placeholder tokens an image), 8 layers of width 512 (25 M parameters).
                       "llava": dict(model_type="llava", vision_config=dict(
                           hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                           image_size=224, patch_size=16, projection_dim=512))}


def bench_model_dir(architecture: str = "llama") -> Path:
    """The bench model (Llama shape, 56 M parameters; or that shape in another architecture), created once
    and cached (safe against a concurrent process making it too)."""
    from services.worker.model_factory import BENCH_MODEL, cached_model_dir

    if architecture == "llama":
        return cached_model_dir("bench-model-v1", BENCH_MODEL)
    return cached_model_dir(f"bench-model-{architecture}-v1", {**BENCH_MODEL, **BENCH_ARCHITECTURES[architecture]})


def greedy_inputs(requests: list[BenchRequest]) -> tuple[list[dict], list]:
    """pagedserve's ``LLM.generate`` inputs for the bench requests: (prompts as token ids, sampling parameters:
    greedy, each to its output length, ignoring EOS)."""
    from pagedserve import SamplingParams

    return ([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
            [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in requests])


def wait_until_answering(url: str, proc, timeout_s: float, what: str) -> None:
    """Poll ``url`` until it answers 200: RuntimeError if the process ``proc`` (a Popen) exits first, TimeoutError
    after ``timeout_s`` (the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited while starting (code {proc.returncode})")
    raise TimeoutError(f"{what} did not start within {timeout_s:.0f} s")


def write_report(out: str | Path, report: dict) -> Path:
    """Write a benchmark's JSON report (its folder made if needed); returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return path


def median_seconds_interleaved(modes: dict, rounds: int, fresh_inputs) -> dict[str, float]:
    """Each mode's median wall time over ``rounds``; every round draws new inputs and runs the modes one
    after another on them, so a machine that drifts (this one is shared) hits them alike."""
    import statistics
    import time

    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        inputs = fresh_inputs()
        for mode, run in modes.items():
            start = time.perf_counter()
            run(inputs)
            seconds[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(times) for mode, times in seconds.items()}


def workload_for(model_dir: Path, num_requests: int, seed: int):
    """The bench workload, within the model's vocabulary and context (a test's small model has less)."""
    config = json.loads((model_dir / "config.json").read_text())
    context = config["max_position_embeddings"]
    if context >= 512 + 256:
        return bench_workload(num_requests, seed, vocab_size=config["vocab_size"])
    return bench_workload(num_requests, seed, vocab_size=config["vocab_size"], prompt_range=(16, context // 2),
                          output_range=(16, context // 4))
