"""Prefill/decode disaggregation with real processes on loopback: a prefill worker, a decode worker pulling its
blocks over ReadBlocks, the scheduler driving both, and the gateway. Greedy tokens equal the colocated
engine's, with prefix-cache hits on either side, and through a decode worker killed while sequences are
handed to it (the gateway resumes them)."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from benchmarks.serving import parse_engine_stats
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.services_harness import Stack, free_port, http_get

WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "256")
PROMPTS = [list(range(3, 3 + n)) for n in (5, 40, 97)] + [[7] * 33 + list(range(50, 80))]


class DisaggregatedStack(Stack):
    """The gateway and the scheduler as usual; the scheduler drives a prefill worker and a decode worker."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_port = free_port()

    def start_worker(self) -> None:
        """The decode worker (again, after kill("worker")); the prefill worker the first time."""
        super().start_worker()
        if "prefill" not in self.procs:
            self._spawn("prefill", "--model", str(self.model_dir), "--listen", f"127.0.0.1:{self.prefill_port}",
                        *self.worker_args, command="worker")

    def start_scheduler(self) -> None:
        self._spawn("scheduler", "--prefill-worker", f"127.0.0.1:{self.prefill_port}", "--decode-worker",
                    f"127.0.0.1:{self.worker_port}", "--listen", self.scheduler_address, *self.scheduler_args)


def generate(stack: Stack, request_id: str, prompt: list[int], max_tokens: int, interrupt=None) -> list[int]:
    params = api.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = []
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        for reply in api_grpc.GenerationStub(channel).Generate(
                api.GenerateRequest(request_id=request_id, token_ids=api.TokenIds(ids=prompt), params=params),
                timeout=180):
            tokens += reply.token_ids
            if interrupt is not None and reply.token_ids:
                interrupt()
                interrupt = None
    return tokens


def engine_stats(stack: Stack) -> dict[str, float]:
    return parse_engine_stats(http_get(f"{stack.base_url}/metrics")[1])


@pytest.fixture(scope="module")
def colocated_tokens(llama_dir):
    """The colocated engine's greedy tokens for PROMPTS (the offline engine: the same code as one worker)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(llama_dir), block_size=16, num_gpu_blocks_override=256)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.close()


def test_disaggregated_stack_gives_the_colocated_tokens_and_survives_a_decode_worker(llama_dir, tmp_path,
                                                                                     colocated_tokens):
    with DisaggregatedStack(llama_dir, tmp_path, worker_args=WORKER_ARGS,
                            gateway_args=("--resume-timeout", "120")) as stack:
        for round_ in range(2):  # the second round hits both sides' prefix caches
            got = [generate(stack, f"r{round_}-{i}", prompt, 24) for i, prompt in enumerate(PROMPTS)]
            assert got == colocated_tokens, f"round {round_}"
        stats = engine_stats(stack)
        assert stats["num_kv_pulls"] == 2 * len(PROMPTS) and stats["kv_pull_blocks"] > 0
        assert stats["kv_pull_blocks_cached"] > 0 and stats["prefix_cache_hits"] > 0
        assert "kv_pull_failed" not in (tmp_path / "worker.log").read_text()

        def crash_decode_worker():
            stack.kill("worker")
            stack.start_worker()

        # The decode worker is frozen first: the first token comes from the prefill worker, and the step that
        # pulls the sequence's blocks can never finish: the worker dies in the middle of the transfer.
        stack.procs["worker"].send_signal(signal.SIGSTOP)
        got = generate(stack, "through-a-crash", PROMPTS[2], 24, interrupt=crash_decode_worker)
        assert got == colocated_tokens[2]
        assert "request resumed" in (tmp_path / "scheduler.log").read_text()
        deadline = time.monotonic() + 10
        while engine_stats(stack).get("kv_blocks_used", 1) != 0:
            assert time.monotonic() < deadline, "a stage kept blocks after its requests ended"
            time.sleep(0.1)
