"""The worker's side of planning ahead: it appends its own last sample only when told, and only
if it drew one."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from shared.sampling_params import SamplingParams
from shared.step_protocol import NewSequence, RunningSequence, StepPlan


@pytest.fixture()
def worker(llama_dir):
    return LLM(str(llama_dir), block_size=4).engine.executor.worker


def new_sequence(prompt: list[int], scheduled: int) -> NewSequence:
    return NewSequence(request_id="r", seq_id=7, index=0, prompt_token_ids=prompt, output_token_ids=[],
                       sampling_params=SamplingParams(temperature=0), block_table=[0, 1, 2],
                       num_computed_tokens=0, num_scheduled_tokens=scheduled)


def test_the_worker_appends_the_token_it_sampled_when_told(worker):
    prompt = [5, 9, 13, 2, 8]
    result = worker.execute(StepPlan(step_id=1, new=[new_sequence(prompt, len(prompt))]))
    sampled = result.outputs[0].token_id
    worker.execute(StepPlan(step_id=2, running=[RunningSequence(7, [], [], len(prompt), 1, append_last_sample=True)]))
    assert worker.seqs[7].token_ids == prompt + [sampled]
    assert worker.seqs[7].sampling.num_output_tokens == 1


def test_a_sample_the_worker_did_not_draw_is_refused(worker):
    prompt = [5, 9, 13, 2, 8]
    result = worker.execute(StepPlan(step_id=1, new=[new_sequence(prompt, 3)]))  # mid-prefill: no sample
    assert result.outputs == []
    with pytest.raises(ValueError, match="sampled nothing in its previous step"):
        worker.execute(StepPlan(step_id=2, running=[RunningSequence(7, [], [], 3, 2, append_last_sample=True)]))


def test_a_token_sent_by_the_scheduler_is_used_instead_of_the_one_held(worker):
    prompt = [5, 9, 13, 2, 8]
    worker.execute(StepPlan(step_id=1, new=[new_sequence(prompt, len(prompt))]))
    worker.execute(StepPlan(step_id=2, running=[RunningSequence(7, [42], [], len(prompt), 1)]))  # a beam's choice
    assert worker.seqs[7].token_ids == prompt + [42]


def test_a_plan_the_worker_refuses_leaves_no_block_table_row_taken(worker):
    # A foreign or corrupt plan: its sequence is refused before it holds a row of the host tables.
    free = len(worker.block_tables.free_rows)
    bad = NewSequence(request_id="r", seq_id=8, index=0, prompt_token_ids=[1, 2], output_token_ids=[],
                      sampling_params=SamplingParams(temperature=0, logit_bias={9999: 1.0}), block_table=[0],
                      num_computed_tokens=0, num_scheduled_tokens=2)
    with pytest.raises(ValueError):
        worker.execute(StepPlan(step_id=1, new=[bad]))
    assert len(worker.block_tables.free_rows) == free and 8 not in worker.seqs
    prompt = [5, 9, 13, 2, 8]
    worker.execute(StepPlan(step_id=2, new=[new_sequence(prompt, len(prompt))]))
    with pytest.raises(ValueError, match="block ids"):  # a table the worker cannot hold: row and list unchanged
        worker.execute(StepPlan(step_id=3, running=[RunningSequence(7, [], [], len(prompt), 1,
                                                                    new_block_table=[0, -5])]))
    assert worker.seqs[7].block_table == [0, 1, 2]
    assert worker.block_tables.gather([worker.seqs[7].table_row]).tolist() == [[0, 1, 2]]


def test_a_step_reports_its_forward_and_sampling_times(worker):
    prompt = [5, 9, 13, 2, 8]
    result = worker.execute(StepPlan(step_id=1, new=[new_sequence(prompt, len(prompt))]))
    assert result.forward_time_s > 0 and result.sample_time_s > 0
    # A prefill chunk that samples nothing still reports its forward pass.
    chunk = worker.execute(StepPlan(step_id=2, new=[NewSequence(
        request_id="s", seq_id=8, index=0, prompt_token_ids=prompt, output_token_ids=[],
        sampling_params=SamplingParams(temperature=0), block_table=[3, 4], num_computed_tokens=0,
        num_scheduled_tokens=3)]))
    assert chunk.outputs == [] and chunk.forward_time_s > 0


def test_device_names_are_checked_before_anything_loads():
    from services.worker.worker_startup import resolve_device
    from shared.config import EngineConfig

    for name in ("gpu", "cuda:x", "CUDA", "mps", "cuda:"):
        with pytest.raises(ValueError, match="device must be"):
            EngineConfig(device=name)
    assert resolve_device("cpu").type == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("cuda").index is not None  # tensors report an index; so must the worker's device
    else:
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def decode_greedily(worker, seq_id: int, prompt: list[int], steps: int) -> list[int]:
    """Plain decoding, one token a step (the scheduler's part played here): the tokens it samples."""
    new = new_sequence(prompt, len(prompt))
    new.seq_id, new.block_table = seq_id, [3 + seq_id * 4 + i for i in range(4)]
    tokens = [worker.execute(StepPlan(step_id=1, new=[new])).outputs[0].token_id]
    for step in range(steps - 1):
        result = worker.execute(StepPlan(step_id=2 + step, running=[
            RunningSequence(seq_id, [tokens[-1]], [], len(prompt) + step, 1)]))
        tokens.append(result.outputs[0].token_id)
    return tokens


@pytest.mark.parametrize("num_right", [0, 2, 3])
def test_drafts_are_kept_up_to_the_first_wrong_one_and_the_table_is_cut_to_the_computed_tokens(worker, num_right):
    prompt = [5, 9, 13, 2, 8]
    truth = decode_greedily(worker, 1, prompt, 5)  # the first token, then what drafts should say
    worker.execute(StepPlan(step_id=10, new=[new_sequence(prompt, len(prompt))]))  # seq 7, blocks 0..2
    drafts = truth[1:4][:num_right] + [(t + 1) % 512 for t in truth[1 + num_right:4]]
    result = worker.execute(StepPlan(step_id=11, running=[
        RunningSequence(7, [truth[0]], [], len(prompt), 1 + len(drafts), draft_token_ids=drafts)]))
    out = result.outputs[0]
    assert out.accepted_token_ids == truth[1:1 + num_right] and out.token_id == truth[1 + num_right]
    seq = worker.seqs[7]
    assert seq.num_computed_tokens == len(prompt) + 1 + num_right
    assert seq.block_table == [0, 1, 2][:-(-seq.num_computed_tokens // 4)]  # blocks of rejected drafts dropped
    assert not seq.draft_token_ids


def test_drafts_that_do_not_follow_every_token_or_leave_the_vocabulary_are_refused(worker):
    prompt = [5, 9, 13, 2, 8]
    token = worker.execute(StepPlan(step_id=1, new=[new_sequence(prompt, len(prompt))])).outputs[0].token_id
    with pytest.raises(ValueError, match="draft tokens do not follow"):  # 2 scheduled: the token and one draft
        worker.execute(StepPlan(step_id=2, running=[RunningSequence(7, [token], [], 5, 2, draft_token_ids=[1, 2])]))
    assert worker.seqs[7].token_ids == prompt  # refused before anything changed
    with pytest.raises(ValueError, match="leave the vocabulary"):
        worker.execute(StepPlan(step_id=3, running=[RunningSequence(7, [token], [], 5, 2, draft_token_ids=[10**6])]))
