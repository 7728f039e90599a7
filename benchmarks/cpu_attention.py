"""CPU attention microbenchmark: the pure-PyTorch backend against the C++-kernel backend.

Bench-model shapes (8 query heads, 4 KV heads, head_dim 64, float32 or --dtype, block_size 16), 8 layers of
KV pools with every sequence's blocks scattered through them (so a step's K/V do not fit in cache,
as in the engine). Each case runs whole steps (all layers, one metadata object) and reports the
milliseconds per layer call (write_kv included) for the "torch" backend (gather + SDPA) and the
"cpu" backend (decodes in csrc/cpu_attention.cpp), interleaved: the median and the best of the
repeats (on a shared machine the best is the steadier number).

    python benchmarks/cpu_attention.py [--threads N] [--repeats 7] [--cases decode16,decode64,...] [--window W]
                                       [--dtype bfloat16] [--loops]

``--loops`` times the decode kernel's two loops against each other instead: "two-pass" (K, then V) in the
first column, "blocked" (K and V a block at a time) in the second, both the cpu backend, interleaved step by
step. It is how ``cpu_kernels.decode_reads_blocks`` was decided for each kind of CPU (docs/performance.md).

``--window W`` makes every layer a sliding-window layer of W keys (Mistral's kind); ``long16`` (16 decodes
at 4096 keys) is where a window saves the most.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.worker.attention import cpu_kernels  # noqa: E402
from services.worker.attention.cpu_attention import CpuAttentionBackend  # noqa: E402
from services.worker.attention.metadata import AttentionMetadata  # noqa: E402
from services.worker.attention.spec import AttentionSpec  # noqa: E402
from services.worker.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from services.worker.cpu_tuning import advise_huge_pages  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE = 8, 4, 64, 8, 16


def make_metadata(seqs: list[tuple[list[int], int, int]]) -> AttentionMetadata:
    """(block table, cached tokens, new tokens) per sequence."""
    slots, starts, seq_lens, query_lens = [], [0], [], []
    for table, cached, new in seqs:
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
        starts.append(starts[-1] + new)
        seq_lens.append(cached + new)
        query_lens.append(new)
    width = max(len(t) for t, _, _ in seqs)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t, _, _ in seqs], dtype=torch.int32),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def make_case(batch: list[tuple[int, int]], generator: torch.Generator, dtype: torch.dtype = torch.float32):
    """Pools for LAYERS layers (twice the blocks needed, scattered) and one step's inputs per layer."""
    needed = sum(-(-(c + n) // BLOCK_SIZE) for c, n in batch)
    num_blocks = 2 * needed
    free = torch.randperm(num_blocks, generator=generator).tolist()
    seqs = [([free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))], c, n) for c, n in batch]
    # Laid out, and backed by huge pages, as the worker's pools are (kv_cache.allocate_kv_pools).
    pools = torch.empty(LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)
    advise_huge_pages(pools)
    pools.copy_(torch.randn(pools.shape, generator=generator))
    kv_caches = [(pools[layer, 0], pools[layer, 1]) for layer in range(LAYERS)]
    meta = make_metadata(seqs)
    inputs = [(torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=generator).to(dtype),
               torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype),
               torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)) for _ in range(LAYERS)]
    return kv_caches, seqs, inputs


def cases(generator: torch.Generator) -> dict[str, list[tuple[int, int]]]:
    def decode(n):  # contexts uniform in 16..770 after this step's token
        return [(int(c) - 1, 1) for c in torch.randint(16, 771, (n,), generator=generator)]

    prefill_mix = ([(0, 512), (0, 300), (0, 40), (0, 17)]  # first chunks, no cache
                   + [(256, 256), (512, 128), (48, 200)]  # chunks after cached blocks
                   + decode(32))  # decodes riding along
    return {"decode16": decode(16), "decode64": decode(64), "decode200": decode(200),
            "prefill_mix": prefill_mix, "first_chunks": [(0, 128)] * 16, "prompt512": [(0, 512)],
            "long16": [(4095, 1)] * 16}


def step(backend, inputs, meta, blocked: bool | None = None) -> list[torch.Tensor]:
    """One step's layer calls; ``blocked`` True / False forces the decode kernel's loops (None: the CPU's choice)."""
    saved = cpu_kernels.decode_reads_blocks
    if blocked is not None:  # (the op's wrapper looks the function up on every call)
        cpu_kernels.decode_reads_blocks = lambda dtype: blocked
    try:
        return [backend.forward(layer, *inputs[layer], meta) for layer in range(LAYERS)]
    finally:
        cpu_kernels.decode_reads_blocks = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per backend and case")
    parser.add_argument("--cases", default=None, help="comma-separated subset of the case names")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=None, help="every layer attends within this many keys")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="queries and KV pools")
    parser.add_argument("--loops", action="store_true",
                        help="the decode kernel's two-pass loops against its blocked ones (not torch against cpu)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    all_cases = cases(generator)
    chosen = args.cases.split(",") if args.cases else list(all_cases)
    spec = AttentionSpec(HEAD_DIM ** -0.5, (args.window,) * LAYERS)
    dtype = getattr(torch, args.dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # (bfloat16: the two backends round differently)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} "
          f"block_size={BLOCK_SIZE} {args.dtype}, {LAYERS} layers, window {args.window}; ms per layer call over "
          f"{args.repeats} steps")
    first, second = ("2-pass", "blocks") if args.loops else ("torch", "cpu")
    print(f"{'case':<13}{'seqs':>5}{'tokens':>7}{'ctx tokens':>11}  {'median: ' + first:>14}{second:>8}{'speedup':>9}"
          f"  {'best: ' + first:>12}{second:>8}{'speedup':>9}")
    with torch.inference_mode():
        for name in chosen:
            batch = all_cases[name]
            kv_caches, seqs, inputs = make_case(batch, generator, dtype)
            cpu = CpuAttentionBackend(kv_caches, spec)
            runs = ((("old", cpu, False), ("new", cpu, True)) if args.loops
                    else (("old", TorchAttentionBackend(kv_caches, spec), None), ("new", cpu, None)))
            # Same inputs for both: writing the same k/v into the same slots again changes nothing.
            expected, got = (step(backend, inputs, make_metadata(seqs), blocked) for _, backend, blocked in runs)
            for a, b in zip(expected, got):
                torch.testing.assert_close(b, a, atol=tolerance, rtol=tolerance)
            times = {"old": [], "new": []}
            for _ in range(args.repeats):
                for label, backend, blocked in runs:
                    meta = make_metadata(seqs)  # a fresh metadata object per step, as in the engine
                    start = time.perf_counter()
                    step(backend, inputs, meta, blocked)
                    times[label].append((time.perf_counter() - start) / LAYERS * 1e3)
            old_ms, new_ms = statistics.median(times["old"]), statistics.median(times["new"])
            old_best, new_best = min(times["old"]), min(times["new"])
            print(f"{name:<13}{len(batch):>5}{sum(n for _, n in batch):>7}{sum(c + n for c, n in batch):>11}"
                  f"  {old_ms:>14.2f}{new_ms:>8.2f}{old_ms / new_ms:>8.2f}x"
                  f"  {old_best:>12.2f}{new_best:>8.2f}{old_best / new_best:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
