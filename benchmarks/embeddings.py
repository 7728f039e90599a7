"""Embeddings: a pooling engine against transformers, in one run.

The bench model (benchmarks/workload.py) saved as an embedding model (its bare weights, last-token pooling,
normalized, as Qwen3-Embedding or e5-mistral). The prompts are queries of --min-len..--max-len random tokens
after a shared instruction of --instruction-len tokens (how such models are asked: "Instruct: ...\\nQuery: ...").
Prompt tokens per second, the median of --rounds runs (the modes interleaved so a drifting machine hits them
alike), for:

- ``hf_one_at_a_time``: transformers' bare model, one prompt per forward pass;
- ``hf_batched``: transformers, --hf-batch prompts per forward pass, right-padded with an attention mask,
  the last real token's state taken (sentence-transformers' way);
- ``engine``: ``LLM.embed`` over all prompts, prefix caching off;
- ``engine_prefix_cache``: the same with prefix caching on (the shared instruction's blocks are computed once).

Every engine embedding is checked against transformers' first (the largest error is reported).

    python benchmarks/embeddings.py --requests 64 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, median_seconds_interleaved, write_report  # noqa: E402
from pagedserve import LLM  # noqa: E402
from tests.embedding_models import make_embedding_dir  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a generative model directory to convert (default: the bench model)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--instruction-len", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "embeddings.json"))
    return parser.parse_args()


def hf_embed(model, prompts: list[list[int]], batch: int) -> list[torch.Tensor]:
    """Right-padded batches; each prompt's last real token's final state, normalized."""
    out = []
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        width = max(map(len, group))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in group])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
        with torch.inference_mode():
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state
        last = torch.tensor([len(p) - 1 for p in group])
        out += list(torch.nn.functional.normalize(states[torch.arange(len(group)), last].float(), dim=-1))
    return out


def main() -> None:
    args = parse_args()
    from transformers import AutoModel

    source = Path(args.model) if args.model else bench_model_dir()
    model_dir = make_embedding_dir(source, Path(tempfile.mkdtemp(prefix="embedding-bench-")) / "model")
    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    engines = {"engine": LLM(str(model_dir), enable_prefix_caching=False),
               "engine_prefix_cache": LLM(str(model_dir), enable_prefix_caching=True)}
    vocab = engines["engine"].engine.info.vocab_size
    rng = random.Random(0)
    instruction = [rng.randrange(3, vocab) for _ in range(args.instruction_len)]

    def fresh_prompts() -> list[list[int]]:  # new queries every run: only the instruction can be a cache hit
        return [instruction + [rng.randrange(3, vocab) for _ in range(rng.randrange(args.min_len, args.max_len + 1))]
                for _ in range(args.requests)]

    check = fresh_prompts()
    reference = hf_embed(hf, check, args.hf_batch)
    error = 0.0
    for engine in engines.values():  # warm-up and the check
        outputs = engine.embed([{"prompt_token_ids": p} for p in check], use_tqdm=False)
        error = max(error, max((torch.tensor(o.outputs.embedding) - r).abs().max().item()
                               for o, r in zip(outputs, reference)))
    print(f"largest error against transformers: {error:.2e}")
    modes = {"hf_one_at_a_time": lambda p: hf_embed(hf, p, 1), "hf_batched": lambda p: hf_embed(hf, p, args.hf_batch),
             **{name: (lambda p, e=e: e.embed([{"prompt_token_ids": x} for x in p], use_tqdm=False))
                for name, e in engines.items()}}
    # Every round's prompts have the same token count in expectation; the rate is per round's median.
    round_tokens = []

    def counted_prompts() -> list[list[int]]:
        prompts = fresh_prompts()
        round_tokens.append(sum(map(len, prompts)))
        return prompts

    medians = median_seconds_interleaved(modes, args.rounds, counted_prompts)
    tokens = statistics.median(round_tokens)
    rows = {mode: {"prompt_tokens_per_s": round(tokens / s, 1)} for mode, s in medians.items()}
    for mode, row in rows.items():
        row["vs_hf_batched"] = round(row["prompt_tokens_per_s"] / rows["hf_batched"]["prompt_tokens_per_s"], 3)
        print(f"{mode:20s} {row['prompt_tokens_per_s']:10.1f} prompt tok/s  {row['vs_hf_batched']:.3f}x hf_batched",
              flush=True)
    cache = engines["engine_prefix_cache"].stats()
    shape = {k: getattr(args, k) for k in ("requests", "instruction_len", "min_len", "max_len", "hf_batch", "rounds")}
    hit_rate = round(cache["prefix_cache_hits"] / max(1, cache["prefix_cache_queries"]), 3)
    report = {"shape": {**shape, "model": str(source)}, "rows": rows, "max_error_vs_transformers": error,
              "prefix_cache_hit_rate": hit_rate}
    print(f"prefix cache hit rate: {report['prefix_cache_hit_rate']}")
    print(f"wrote {write_report(args.out, report)}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
