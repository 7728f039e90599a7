"""Reranking with a cross-encoder: a pooling engine against transformers, in one run.

The bench model (benchmarks/workload.py) saved as a one-label sequence classifier (its weights and a fresh
``score`` head, as a Qwen3 reranker converted to ``*ForSequenceClassification``). Each round reranks
--documents documents of --min-len..--max-len random tokens against one query of --query-len tokens: one
forward pass per (query, document) pair, the query's tokens first. Pairs per second, the median of
--rounds runs (the modes interleaved so a drifting machine hits them alike), for:

- ``hf_one_at_a_time``: transformers' ``AutoModelForSequenceClassification``, one pair per forward pass;
- ``hf_batched``: transformers, --hf-batch pairs per forward pass, right-padded with an attention mask;
- ``engine``: ``LLM.classify`` over all pairs, prefix caching off;
- ``engine_prefix_cache``: the same with prefix caching on (the query's full blocks are computed once).

Every engine score is checked against transformers' first (the largest error is reported).

    python benchmarks/reranking.py --documents 64 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import bench_model_dir, median_seconds_interleaved, write_report  # noqa: E402
from pagedserve import LLM  # noqa: E402
from tests.embedding_models import make_classifier_dir  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a generative model directory to convert (default: the bench model)")
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--query-len", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the engines' step budget")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "reranking.json"))
    return parser.parse_args()


def hf_scores(model, pairs: list[list[int]], batch: int) -> list[float]:
    """Right-padded batches (transformers finds each row's last token by the pad id); sigmoid of the logit."""
    pad, out = model.config.pad_token_id, []
    for first in range(0, len(pairs), batch):
        group = pairs[first:first + batch]
        width = max(map(len, group))
        ids = torch.tensor([p + [pad] * (width - len(p)) for p in group])
        mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in group])
        with torch.inference_mode():
            out += torch.sigmoid(model(input_ids=ids, attention_mask=mask).logits[:, 0].float()).tolist()
    return out


def engine_scores(engine: LLM, pairs: list[list[int]]) -> list[float]:
    return [o.outputs.probs[0] for o in engine.classify([{"prompt_token_ids": p} for p in pairs], use_tqdm=False)]


def main() -> None:
    args = parse_args()
    from transformers import AutoModelForSequenceClassification

    source = Path(args.model) if args.model else bench_model_dir()
    model_dir = make_classifier_dir(source, Path(tempfile.mkdtemp(prefix="rerank-bench-")) / "model",
                                    labels=("relevant",))
    hf = AutoModelForSequenceClassification.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    engines = {"engine": LLM(str(model_dir), enable_prefix_caching=False, **budget),
               "engine_prefix_cache": LLM(str(model_dir), enable_prefix_caching=True, **budget)}
    vocab = engines["engine"].engine.info.vocab_size
    rng = random.Random(0)
    special = {hf.config.pad_token_id, *engines["engine"].engine.info.eos_token_ids}

    def tokens(count: int) -> list[int]:
        return [t for t in (rng.randrange(3, vocab) for _ in range(count * 2)) if t not in special][:count]

    def fresh_pairs() -> list[list[int]]:  # a new query each round: a hit is the query within its own round
        query = tokens(args.query_len)
        return [query + tokens(rng.randrange(args.min_len, args.max_len + 1)) for _ in range(args.documents)]

    check = fresh_pairs()
    reference = torch.tensor(hf_scores(hf, check, args.hf_batch))
    error = max((torch.tensor(engine_scores(e, check)) - reference).abs().max().item() for e in engines.values())
    print(f"largest error against transformers: {error:.2e}")
    modes = {"hf_one_at_a_time": lambda p: hf_scores(hf, p, 1), "hf_batched": lambda p: hf_scores(hf, p, args.hf_batch),
             **{name: (lambda p, e=e: engine_scores(e, p)) for name, e in engines.items()}}
    medians = median_seconds_interleaved(modes, args.rounds, fresh_pairs)
    rows = {mode: {"pairs_per_s": round(args.documents / s, 2)} for mode, s in medians.items()}
    for mode, row in rows.items():
        row["vs_hf_batched"] = round(row["pairs_per_s"] / rows["hf_batched"]["pairs_per_s"], 3)
        print(f"{mode:20s} {row['pairs_per_s']:9.2f} pairs/s  {row['vs_hf_batched']:.3f}x hf_batched", flush=True)
    cache = engines["engine_prefix_cache"].stats()
    shape = {k: getattr(args, k) for k in ("documents", "query_len", "min_len", "max_len", "hf_batch", "rounds")}
    report = {"shape": {**shape, "model": str(source)}, "rows": rows, "max_error_vs_transformers": error,
              "prefix_cache_hit_rate": round(cache["prefix_cache_hits"] / max(1, cache["prefix_cache_queries"]), 3)}
    print(f"prefix cache hit rate: {report['prefix_cache_hit_rate']}")
    print(f"wrote {write_report(args.out, report)}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
