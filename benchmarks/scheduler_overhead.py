"""The scheduler's own cost per step, with a worker that answers at once (no model, no tensors).

    python benchmarks/scheduler_overhead.py [--batch 32 256] [--steps 300] [--profile]
    python benchmarks/scheduler_overhead.py --against ../other-checkout [--batch 256] [--bursts 40]

Why: on a GPU a decode step of a small model, or of a large one replayed from a CUDA graph, takes
about a millisecond; the scheduler plans every step in Python (and the scheduler service plans the
next one while the worker runs this one), so its time per step, which grows with the number of
running sequences, bounds the step rate. On this CPU host the model's forward pass hides it;
here nothing does.

What: ``--batch`` requests decode side by side (short prompts, long outputs, ignore_eos), through
EngineCore with an in-process worker stand-in that samples one token per sampling sequence. The
report is microseconds per step and per sequence, of planning (``start_step``: schedule, the usage
gauges, the plan; the stand-in's own time, spent inside it, left out) and of applying the result (``finish_step``: tokens, stop checks, prefix-cache
hashes), and of the plan's and result's protobuf round trip (what the gRPC transport adds at the
scheduler and the worker). Also run with n=4 parallel sampling, whose forked siblings share blocks.

``--against`` compares two checkouts: one long-lived process each, taking turns at bursts of 20
steps, and reports the median and quartiles of the per-burst ratios of step times (each side's
median burst is printed too, but slow spells weigh on it; the ratio is the number). On a shared host one process's medians swing
by half between runs minutes apart; bursts a fraction of a second apart see the same host.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# The code under test: this checkout, or (for one side of --against) the one the variable names.
TREE = Path(os.environ.get("SCHEDULER_OVERHEAD_TREE") or Path(__file__).resolve().parent.parent)
sys.path.insert(0, str(TREE))

from benchmarks.workload import write_report  # noqa: E402
from services.scheduler.engine_core import EngineCore  # noqa: E402
from services.scheduler.executor import InProcessExecutor  # noqa: E402
from services.scheduler.scheduler import SchedulerLimits  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402
from shared.step_protocol import Sample, SequenceOutput, StepPlan, StepResult, WorkerInfo  # noqa: E402

VOCAB = 32000
MAX_MODEL_LEN = 4096
BURST = 20  # steps per turn in --against


class InstantWorker:
    """Keeps each sequence's token count from the plans and samples when a sequence reaches its end."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int):
        self.info = WorkerInfo(model="instant", num_kv_blocks=num_blocks, block_size=block_size,
                               max_model_len=max_model_len, vocab_size=VOCAB, eos_token_ids=(2,), device="cpu",
                               dtype="float32", num_cpu_blocks=0)
        self._tokens: dict[int, int] = {}  # seq id -> tokens the worker knows
        self._siblings: dict[int, int] = {}  # seq id -> siblings still to fork from its first sample
        self.busy_s = 0.0  # seconds spent in execute: the worker's share, not the scheduler's
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        result = self._execute(plan)
        self.busy_s += time.perf_counter() - started  # the stand-in's own time, left out of the scheduler's
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
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


def decoding_engine(requests: int, n: int, max_tokens: int, block_size: int) -> tuple[EngineCore, InstantWorker]:
    """``requests`` × ``n`` sequences past their prompts (siblings forked), each decoding from now on."""
    worker = InstantWorker(num_blocks=requests * n * (MAX_MODEL_LEN // block_size), block_size=block_size,
                           max_model_len=MAX_MODEL_LEN)
    engine = EngineCore(InProcessExecutor(worker), SchedulerLimits(max_num_seqs=requests * n, max_num_batched_tokens=8192,
                                                enable_chunked_prefill=True))
    rng = random.Random(0)
    params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(requests):
        add_request(engine, str(i), [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 256))], params)
    for _ in range(1000):
        if len(engine.scheduler.running) == requests * n and not engine.scheduler.waiting:
            return engine, worker
        engine.step()
    raise RuntimeError(f"{len(engine.scheduler.running)} of {requests * n} sequences running after 1000 steps")


def add_request(engine: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    """The engine takes an EngineRequest; a tree from before there was one (--against) took its fields."""
    if not (TREE / "shared" / "request.py").exists():
        engine.add_request(request_id, prompt, params)
        return
    from shared.request import EngineRequest

    engine.add_request(EngineRequest(request_id, prompt, params))


class Stepper:
    """Turns the engine one step at a time, the plain way or as the scheduler service does (one step
    always in flight, the next planned before the last result is applied)."""

    def __init__(self, engine: EngineCore, worker: InstantWorker, plan_ahead: bool):
        self.engine, self.worker, self.plan_ahead = engine, worker, plan_ahead
        if plan_ahead:
            engine.start_step()

    def step(self) -> tuple[float, float, int]:
        """Seconds planning, seconds applying the result (both without the worker stand-in's time),
        tokens that came back."""
        engine = self.engine
        busy = self.worker.busy_s
        t0 = time.perf_counter()
        ahead = self.plan_ahead and engine.can_plan_ahead()
        if ahead or not self.plan_ahead:
            engine.start_step()  # the in-process executor runs the worker inside: its time comes off
        t1 = time.perf_counter()
        updates = engine.finish_step()
        t2 = time.perf_counter()
        if self.plan_ahead and not ahead:
            engine.start_step()  # planning ahead was not allowed: plan once the result is in
        planning = (t1 - t0) + (time.perf_counter() - t2) - (self.worker.busy_s - busy)
        return planning, t2 - t1, sum(len(update.new_token_ids) for update in updates)


def measure(requests: int, n: int, steps: int, block_size: int, plan_ahead: bool,
            profile: cProfile.Profile | None) -> dict:
    engine, worker = decoding_engine(requests, n, steps + 64, block_size)
    stepper = Stepper(engine, worker, plan_ahead)
    if profile is not None:
        profile.enable()
    plan_s, apply_s, tokens = zip(*(stepper.step() for _ in range(steps)))
    if profile is not None:
        profile.disable()
    plan = worker.plans[-1]
    seqs = len(plan.running) + len(plan.new)
    # Every step is a decode of every sequence: anything else means the stand-in broke the protocol.
    if seqs != requests * n or sum(tokens) != steps * seqs:
        raise RuntimeError(f"expected {requests * n} sequences with {steps} tokens each, got {seqs} and "
                           f"{sum(tokens)} tokens")
    plan_us, apply_us = 1e6 * statistics.median(plan_s), 1e6 * statistics.median(apply_s)
    return {"requests": requests, "n": n, "sequences": seqs, "plan_ahead": plan_ahead, "plan_us": plan_us,
            "apply_us": apply_us, "per_seq_us": (plan_us + apply_us) / seqs, **wire_round_trip(plan)}


def burst_child(requests: int, n: int, plan_ahead: bool, bursts: int, block_size: int) -> None:
    """--burst-child: for each line K on stdin, K steps; prints their median step time (planning and
    applying). A long-lived process per tree, so an A/B comparison alternates bursts a fraction of a
    second apart, and a shared host's slow spells hit both sides alike."""
    import services

    if not Path(services.__file__).resolve().is_relative_to(TREE.resolve()):
        raise RuntimeError(f"the services under test come from {services.__file__}, not from {TREE}")
    engine, worker = decoding_engine(requests, n, BURST * bursts + 64, block_size)
    stepper = Stepper(engine, worker, plan_ahead)
    for line in sys.stdin:
        steps = [stepper.step() for _ in range(int(line))]
        if any(tokens != requests * n for *_, tokens in steps):  # a side doing less work would look faster
            raise RuntimeError(f"a step did not decode all {requests * n} sequences")
        print(statistics.median(planning + applying for planning, applying, _ in steps), flush=True)


def compare(other: Path, requests: int, n: int, plan_ahead: bool, block_size: int, bursts: int) -> dict:
    """This tree against ``other`` (another checkout), alternating bursts of BURST steps. Both sides run
    this script's worker stand-in over their own scheduler."""
    argv = [sys.executable, __file__, "--burst-child", str(requests), str(n), str(int(plan_ahead)), str(bursts),
            "--block-size", str(block_size)]
    children = [subprocess.Popen(argv, env={**os.environ, "SCHEDULER_OVERHEAD_TREE": str(tree)}, cwd=tree,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for tree in (TREE, other.resolve())]
    medians: list[list[float]] = [[], []]
    try:
        for burst in range(bursts):
            for i in (0, 1) if burst % 2 == 0 else (1, 0):
                children[i].stdin.write(f"{BURST}\n")
                children[i].stdin.flush()
                medians[i].append(float(children[i].stdout.readline()))
    finally:
        for child in children:
            child.kill()
    ratios = sorted(this / that for this, that in zip(*medians))
    return {"requests": requests, "n": n, "plan_ahead": plan_ahead, "this_us": 1e6 * statistics.median(medians[0]),
            "other_us": 1e6 * statistics.median(medians[1]), "ratio_median": statistics.median(ratios),
            "ratio_quartiles": statistics.quantiles(ratios, n=4)[::2]}


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
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 256], help="sequences decoding side by side")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print the 30 costliest functions")
    parser.add_argument("--against", type=Path, default=None,
                        help="another checkout (with this script): the step time of this tree over that one's, "
                             "in alternating bursts, for each batch with n=1 planned plainly and n=4 planned ahead")
    parser.add_argument("--bursts", type=int, default=40, help="with --against: bursts per side")
    parser.add_argument("--burst-child", nargs=4, type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).with_name("results") / "scheduler_overhead.json"))
    args = parser.parse_args()
    if args.burst_child:
        requests, n, ahead, bursts = args.burst_child
        return burst_child(requests, n, bool(ahead), bursts, args.block_size)
    if args.against is not None:
        if BURST * args.bursts + 64 + 256 > MAX_MODEL_LEN:
            parser.error(f"--bursts {args.bursts}: the sequences would reach the context length before the end")
        return report_comparison(args)
    profile = cProfile.Profile() if args.profile else None
    rows = [measure(batch // n, n, args.steps, args.block_size, ahead, profile)
            for batch in args.batch for n in (1, 4) if batch % n == 0 for ahead in (False, True)]
    print(f"{'seqs':>5} {'n':>2} {'ahead':>5} {'plan µs':>9} {'apply µs':>9} {'µs/seq':>7} "
          f"{'plan wire':>10} {'result wire':>11}")
    for r in rows:
        print(f"{r['sequences']:>5} {r['n']:>2} {str(r['plan_ahead']):>5} {r['plan_us']:>9.0f} {r['apply_us']:>9.0f} "
              f"{r['per_seq_us']:>7.1f} {r['plan_wire_us']:>10.0f} {r['result_wire_us']:>11.0f}")
    print(f"wrote {write_report(args.out, {'steps': args.steps, 'block_size': args.block_size, 'rows': rows})}")
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def report_comparison(args) -> None:
    rows = [compare(args.against, batch // n, n, ahead, args.block_size, args.bursts)
            for batch in args.batch for n, ahead in ((1, False), (4, True)) if batch % n == 0]
    print(f"this tree over {args.against}, step time (planning + applying), median of {args.bursts} bursts per side")
    print(f"{'seqs':>5} {'n':>2} {'ahead':>5} {'this µs':>9} {'other µs':>9} {'ratio':>6} {'quartiles':>12}"
          "   (µs: each side's median burst; ratio: median of the per-burst ratios)")
    for r in rows:
        low, high = r["ratio_quartiles"]
        print(f"{r['requests'] * r['n']:>5} {r['n']:>2} {str(r['plan_ahead']):>5} {r['this_us']:>9.0f} "
              f"{r['other_us']:>9.0f} {r['ratio_median']:>6.3f} {low:>5.3f}-{high:.3f}")
    print(f"wrote {write_report(args.out, {'against': str(args.against), 'rows': rows})}")


if __name__ == "__main__":
    main()
