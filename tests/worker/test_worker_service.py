"""The worker's Steps stream, driven directly: plans sent ahead of their predecessor's result run
in order, a failed step fails the stream with its reason, and the next scheduler starts clean."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.scheduler.grpc_executor import GrpcExecutor
from shared.grpc_errors import ServiceUnavailable
from shared.sampling_params import SamplingParams
from shared.step_protocol import NewSequence, RunningSequence, StepPlan
from tests.services_harness import REPO, free_port, grpc_serving, wait_until_ready

PROMPT = [5, 9, 13, 2, 8, 11]


@pytest.fixture(scope="module")
def worker_address(llama_dir, tmp_path_factory):
    address, log_dir = f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("worker-service")
    log = open(log_dir / "worker.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "worker", "--model", str(llama_dir), "--listen",
                             address, "--block-size", "4", "--num-gpu-blocks-override", "64"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    try:
        wait_until_ready(lambda: grpc_serving(address), {"worker": proc}, log_dir, "the worker to serve")
        yield address
    finally:
        proc.terminate()
        proc.wait(15)


def new_sequence(seq_id: int) -> NewSequence:
    return NewSequence(request_id="r", seq_id=seq_id, index=0, prompt_token_ids=PROMPT, output_token_ids=[],
                       sampling_params=SamplingParams(temperature=0), block_table=[0, 1, 2],
                       num_computed_tokens=0, num_scheduled_tokens=len(PROMPT))


def decode(seq_id: int, step: int, ahead: bool, token: int | None = None) -> RunningSequence:
    computed = len(PROMPT) + step - 1
    return RunningSequence(seq_id, [] if ahead else [token], [], computed, 1, append_last_sample=ahead)


def test_plans_sent_ahead_run_in_order_and_equal_plans_sent_after(worker_address):
    executor = GrpcExecutor(worker_address, connect_timeout_s=120)
    try:
        executor.submit(StepPlan(step_id=1, new=[new_sequence(1)]))  # one after another
        tokens_after = [executor.wait().outputs[0].token_id]
        for step in (2, 3):
            executor.submit(StepPlan(step_id=step, running=[decode(1, step - 1, False, tokens_after[-1])]))
            tokens_after.append(executor.wait().outputs[0].token_id)
        executor.submit(StepPlan(step_id=4, new=[new_sequence(2)]))  # all three sent before any result
        executor.submit(StepPlan(step_id=5, running=[decode(2, 1, True)]))
        executor.submit(StepPlan(step_id=6, running=[decode(2, 2, True)]))
        results = [executor.wait() for _ in range(3)]
        assert [r.step_id for r in results] == [4, 5, 6]
        assert [r.outputs[0].token_id for r in results] == tokens_after
    finally:
        executor.shutdown()


def test_a_failed_step_fails_the_stream_and_the_next_scheduler_starts_clean(worker_address):
    executor = GrpcExecutor(worker_address, connect_timeout_s=120)
    try:
        executor.submit(StepPlan(step_id=1, new=[new_sequence(3)]))
        executor.submit(StepPlan(step_id=2, running=[decode(99, 1, True)]))  # a sequence it never saw
        executor.submit(StepPlan(step_id=3, running=[decode(3, 1, True)]))  # queued behind the failure
        assert executor.wait().step_id == 1
        with pytest.raises(ServiceUnavailable, match="unknown to this worker"):
            executor.wait()
    finally:
        executor.shutdown()
    again = GrpcExecutor(worker_address, connect_timeout_s=30)
    try:  # the same seq id is new again: the worker forgot the failed stream's sequences
        again.submit(StepPlan(step_id=1, new=[new_sequence(3)]))
        assert again.wait().outputs[0].token_id is not None
    finally:
        again.shutdown()
