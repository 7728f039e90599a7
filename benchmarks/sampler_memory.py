"""Transient memory of one sampler call, in bytes per [row, vocab] entry of its logits.

The KV budget on a GPU sets aside memory for one step's sampling (``activation_bytes_estimate`` in
services/worker/kv_cache.py): ``max_num_seqs`` rows of the vocabulary times a number of bytes per entry.
This measures that number on the CPU, for plain greedy rows and for the sampler's costliest path
(penalties, top-k, top-p, min-p, logprobs, seeded noise: ``largest_step.costliest_sampling``). Each
case runs in a fresh process and reads the growth of its peak resident memory (VmHWM) across one
``Sampler.sample`` call; the logits given to it are not counted. The sampler runs the same tensor
operations on a GPU, so the count carries over (allocator rounding aside).

    python benchmarks/sampler_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CASES = [("greedy", 256, 32000), ("costliest", 64, 32000), ("costliest", 256, 32000), ("costliest", 64, 128256)]


def peak_resident_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def measure(kind: str, rows: int, vocab: int) -> float:
    import torch

    from services.worker.largest_step import costliest_sampling
    from services.worker.sampler import Sampler, SamplingState
    from shared.sampling_params import SamplingParams

    torch.set_num_threads(2)
    cpu = torch.device("cpu")
    sampler = Sampler(vocab, [0])
    if kind == "costliest":
        states = [costliest_sampling(vocab, 20, cpu) for _ in range(rows)]
    else:
        states = [SamplingState(SamplingParams(temperature=0), [0], [], vocab) for _ in range(rows)]
    logits = torch.randn(rows, vocab)
    before = peak_resident_bytes()
    sampler.sample(logits, states)
    return (peak_resident_bytes() - before) / (rows * vocab)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--case", nargs=3, metavar=("KIND", "ROWS", "VOCAB"), help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=None, help="KIND:ROWS:VOCAB,... instead of the default cases")
    args = parser.parse_args()
    if args.case:  # the child: one measurement in a fresh process
        kind, rows, vocab = args.case
        print(measure(kind, int(rows), int(vocab)))
        return 0
    cases = CASES if args.cases is None else [(k, int(r), int(v)) for k, r, v in
                                               (c.split(":") for c in args.cases.split(","))]
    results = []
    for kind, rows, vocab in cases:
        child = subprocess.run([sys.executable, __file__, "--case", kind, str(rows), str(vocab)], check=True,
                               capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        per_entry = float(child.stdout.strip().splitlines()[-1])
        results.append({"kind": kind, "rows": rows, "vocab": vocab, "bytes_per_entry": per_entry})
        print(f"{kind:>10} {rows:>5} rows x {vocab:>6} vocab: {per_entry:5.1f} bytes per entry "
              f"({per_entry * rows * vocab / 2**20:.0f} MiB)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
