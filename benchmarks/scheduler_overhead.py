"""The scheduler's own cost per step, with a worker that answers at once (no model, no tensors).

    python benchmarks/scheduler_overhead.py [--batch 32 256] [--steps 300] [--profile]

Why: on a GPU a decode step of a small model, or of a large one replayed from a CUDA graph, takes
about a millisecond; the scheduler plans every step in Python (and the scheduler service plans the
next one while the worker runs this one), so its time per step, which grows with the number of
running sequences, bounds the step rate. On this CPU host the model's forward pass hides it;
here nothing does.

What: ``--batch`` requests decode side by side (short prompts, long outputs, ignore_eos), through
EngineCore with an in-process worker stand-in that samples one token per sampling sequence. The
report is microseconds per step and per sequence, of planning (``start_step``: schedule, the usage
gauges, the plan) and of applying the result (``finish_step``: tokens, stop checks, prefix-cache
hashes), and of the plan's and result's protobuf round trip (what the gRPC transport adds at the
scheduler and the worker). Also run with n=4 parallel sampling, whose forked siblings share blocks.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workload import write_report  # noqa: E402
from services.scheduler.engine_core import EngineCore  # noqa: E402
from services.scheduler.scheduler import SchedulerLimits  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.step_protocol import Sample, SequenceOutput, StepPlan, StepResult, WorkerInfo  # noqa: E402

VOCAB = 32000


class InstantWorker:
    """Keeps each sequence's token count from the plans and samples when a sequence reaches its end."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.info = WorkerInfo(model="instant", num_kv_blocks=num_blocks, block_size=block_size,
                               max_model_len=max_model_len, vocab_size=VOCAB, eos_token_ids=(2,), device="cpu",
                               dtype="float32", num_cpu_blocks=0)
        self._tokens: dict[int, int] = {}  # seq id -> tokens the worker knows
        self._siblings: dict[int, int] = {}  # seq id -> siblings still to fork from its first sample
        self._results: list[StepResult] = []
        self.plans: list[StepPlan] = []

    def worker_info(self) -> WorkerInfo:
        return self.info

    def submit(self, plan: StepPlan) -> None:
        self._results.append(self.execute(plan))

    def wait(self) -> StepResult:
        return self._results.pop(0)

    def shutdown(self) -> None:
        pass

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for fork in plan.forks:
            self._tokens[fork.child_seq_id] = self._tokens[fork.parent_seq_id]
        for seq_id in plan.finished_seq_ids:
            self._tokens.pop(seq_id, None)
            self._siblings.pop(seq_id, None)
        outputs = []
        for new in plan.new:
            total = len(new.prompt_token_ids) + len(new.output_token_ids)
            self._tokens[new.seq_id] = total
            self._siblings[new.seq_id] = new.num_siblings
            if new.num_computed_tokens + new.num_scheduled_tokens == total:
                outputs.append(self._sample(new.seq_id))
        for delta in plan.running:
            total = self._tokens[delta.seq_id] + len(delta.new_token_ids) + delta.append_last_sample
            self._tokens[delta.seq_id] = total
            if delta.num_computed_tokens + delta.num_scheduled_tokens == total:
                outputs.append(self._sample(delta.seq_id))
        return StepResult(step_id=plan.step_id, outputs=outputs)

    def _sample(self, seq_id: int) -> SequenceOutput:
        token = 3 + (seq_id * 7919 + self._tokens[seq_id]) % (VOCAB - 3)  # never the EOS id
        out = SequenceOutput(seq_id=seq_id, token_id=token)
        num_siblings = self._siblings.pop(seq_id, 0)
        out.siblings = [Sample(3 + (token + i) % (VOCAB - 3), None) for i in range(1, num_siblings + 1)]
        return out


def measure(batch: int, n: int, steps: int, block_size: int, plan_ahead: bool, profile: cProfile.Profile | None
            ) -> dict:
    max_model_len = 4096
    worker = InstantWorker(num_blocks=batch * n * (max_model_len // block_size), block_size=block_size,
                           max_model_len=max_model_len)
    engine = EngineCore(worker, SchedulerLimits(max_num_seqs=batch * n, max_num_batched_tokens=8192,
                                                enable_chunked_prefill=True))
    rng = random.Random(0)
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 256))], params)
    for _ in range(1000):  # prompts in, siblings forked
        if len(engine.scheduler.running) == batch * n and not engine.scheduler.waiting:
            break
        engine.step()
    else:
        raise RuntimeError(f"{len(engine.scheduler.running)} of {batch * n} sequences running after 1000 steps")
    plan_s, apply_s, tokens = [], [], 0
    if plan_ahead:
        engine.start_step()  # one step always in flight, as in the scheduler service
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        t0 = time.perf_counter()
        if plan_ahead:
            ahead = engine.can_plan_ahead()
            if ahead:
                engine.start_step()  # the next step, planned while the one in flight runs
            t1 = time.perf_counter()
            updates = engine.finish_step()
            if not ahead:
                engine.start_step()
        else:
            engine.start_step()
            t1 = time.perf_counter()
            updates = engine.finish_step()
        t2 = time.perf_counter()
        tokens += sum(len(update.new_token_ids) for update in updates)
        plan_s.append(t1 - t0)
        apply_s.append(t2 - t1)
    if profile is not None:
        profile.disable()
    plan = worker.plans[-1]
    seqs = len(plan.running) + len(plan.new)
    # Every step is a decode of every sequence: anything else means the stand-in broke the protocol.
    if seqs != batch * n or tokens != steps * seqs:
        raise RuntimeError(f"expected {batch * n} sequences with {steps} tokens each, got {seqs} and {tokens} tokens")
    plan_us, apply_us = 1e6 * statistics.median(plan_s), 1e6 * statistics.median(apply_s)
    return {"batch": batch, "n": n, "sequences": seqs, "plan_us": plan_us, "apply_us": apply_us,
            "per_seq_us": (plan_us + apply_us) / seqs, **wire_round_trip(plan)}


def wire_round_trip(plan: StepPlan) -> dict:
    """The last plan and a result for it to protobuf and back, as the gRPC executor and the worker do."""
    outputs = [SequenceOutput(seq_id=d.seq_id, token_id=5) for d in plan.running]
    result = StepResult(step_id=plan.step_id, outputs=outputs)
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        StepPlan.from_proto(StepPlan.from_proto(plan.to_proto()).to_proto())
    t1 = time.perf_counter()
    for _ in range(reps):
        StepResult.from_proto(result.to_proto())
    t2 = time.perf_counter()
    # one encode + one decode each way: half of the double round trip for the plan
    return {"plan_wire_us": 1e6 * (t1 - t0) / reps / 2, "result_wire_us": 1e6 * (t2 - t1) / reps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print the 30 costliest functions")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "scheduler_overhead.json"))
    args = parser.parse_args()
    profile = cProfile.Profile() if args.profile else None
    rows = []
    for batch in args.batch:
        for n in (1, 4):
            if batch % n:
                continue
            for ahead in (False, True):
                row = measure(batch // n, n, args.steps, args.block_size, ahead, profile)
                row["plan_ahead"] = ahead
                rows.append(row)
    print(f"{'seqs':>5} {'n':>2} {'ahead':>5} {'plan µs':>9} {'apply µs':>9} {'µs/seq':>7} "
          f"{'plan wire':>10} {'result wire':>11}")
    for r in rows:
        print(f"{r['sequences']:>5} {r['n']:>2} {str(r['plan_ahead']):>5} {r['plan_us']:>9.0f} {r['apply_us']:>9.0f} "
              f"{r['per_seq_us']:>7.1f} {r['plan_wire_us']:>10.0f} {r['result_wire_us']:>11.0f}")
    print(f"wrote {write_report(args.out, {'steps': args.steps, 'block_size': args.block_size, 'rows': rows})}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
