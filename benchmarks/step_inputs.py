"""Host time to build one decode step's inputs: block tables rebuilt from the lists, against the worker's
host tables (services/worker/host_block_tables.py), for the eager inputs and for the CUDA-graph buffers.

Runs on the CPU (the buffers are CPU tensors: what is timed is the host's share). Every sequence of a
case sits at the case's context, the worst case for the lists.

    python benchmarks/step_inputs.py [--repeats 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from services.worker.cuda_graphs import DecodeBuffers
from services.worker.host_block_tables import HostBlockTables
from services.worker.input_batch import ScheduledSequence, build_model_inputs

BLOCK_SIZE = 16
CASES = [(1, 512), (32, 4096), (32, 32768), (256, 2048)]  # (sequences, context)


def decode_batch(num_seqs: int, context: int, generator: torch.Generator) -> list[ScheduledSequence]:
    blocks = -(-context // BLOCK_SIZE)
    tables = torch.randint(0, 1 << 20, (num_seqs, blocks), generator=generator).tolist()
    return [ScheduledSequence([0] * context, table, context - 1, 1) for table in tables]


def best_of(fn, repeats: int) -> float:
    """Seconds per call: the best of 5 means of ``repeats`` calls (the host is shared)."""
    fn()
    means = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        means.append((time.perf_counter() - start) / repeats)
    return min(means)


def run_case(num_seqs: int, context: int, repeats: int) -> dict:
    cpu = torch.device("cpu")
    batch = decode_batch(num_seqs, context, torch.Generator().manual_seed(0))
    tables = HostBlockTables(width=-(-context // BLOCK_SIZE))
    rows = [tables.add(s.block_table) for s in batch]
    width = len(batch[0].block_table)
    buffers = DecodeBuffers.allocate(num_seqs, width, cpu)
    times = {
        "eager_lists_us": best_of(lambda: build_model_inputs(batch, BLOCK_SIZE, cpu), repeats),
        "eager_host_tables_us": best_of(
            lambda: build_model_inputs(batch, BLOCK_SIZE, cpu, tables.gather(rows)), repeats),
        "graph_fill_lists_us": best_of(lambda: buffers.fill(batch, BLOCK_SIZE, num_seqs), repeats),
        "graph_fill_host_tables_us": best_of(
            lambda: buffers.fill(batch, BLOCK_SIZE, num_seqs, tables.gather(rows)), repeats),
    }
    return {"num_seqs": num_seqs, "context": context, **{k: v * 1e6 for k, v in times.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None, help="write the rows here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [run_case(n, ctx, args.repeats) for n, ctx in CASES]
    print(f"{'seqs':>5} {'context':>8} {'eager: lists':>13} {'host tables':>12} {'x':>6} "
          f"{'graph fill: lists':>18} {'host tables':>12} {'x':>6}   (us)")
    for r in rows:
        print(f"{r['num_seqs']:>5} {r['context']:>8} {r['eager_lists_us']:>13.0f} {r['eager_host_tables_us']:>12.0f} "
              f"{r['eager_lists_us'] / r['eager_host_tables_us']:>6.1f} {r['graph_fill_lists_us']:>18.0f} "
              f"{r['graph_fill_host_tables_us']:>12.0f} {r['graph_fill_lists_us'] / r['graph_fill_host_tables_us']:>6.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
