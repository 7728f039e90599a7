"""A request resumed after a lost scheduler carries on exactly where it stopped (the engine's side)."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from shared.proto import pagedserve_internal_pb2 as wire
from shared.resumption import Resumption
from tests.oracle import assert_greedy_equal, hf_greedy
from shared.request import EngineRequest

MAX_TOKENS = 24


def run_to_the_end(engine, request_id: str, prompt: list[int], params: SamplingParams,
                   resumption: Resumption | None = None) -> dict[int, tuple[list[int], list, str]]:
    """By sequence index: the tokens generated in this run, their logprobs and the finish reason."""
    num_seqs = engine.add_request(EngineRequest(request_id, prompt, params, resumption=resumption))
    out: dict[int, tuple[list[int], list, str]] = {}
    while engine.has_unfinished():
        for update in engine.step():
            tokens, logprobs, _ = out.setdefault(update.seq_index, ([], [], ""))
            tokens += update.new_token_ids
            logprobs += update.new_logprobs
            if update.finish_reason is not None:
                out[update.seq_index] = (tokens, logprobs, update.finish_reason)
    assert len(out) == num_seqs and engine.get_stats()["kv_blocks_used"] == 0
    return out


@pytest.fixture(scope="module")
def engine(llama_dir):
    # Small blocks and budget: the resumed tokens are recomputed over several chunks and blocks.
    return LLM(str(llama_dir), block_size=8, max_num_batched_tokens=32, enable_chunked_prefill=True).engine


def test_a_resumed_greedy_request_goes_on_as_transformers_does(engine, llama_dir):
    prompt = [random.Random(1).randrange(1, 500) for _ in range(37)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    whole = run_to_the_end(engine, "whole", prompt, params)[0]
    ref, ref_logprobs = hf_greedy(llama_dir, prompt, MAX_TOKENS)
    assert_greedy_equal(whole[0], ref, ref_logprobs)
    for cut in (1, 9, MAX_TOKENS - 1):  # one token, past a block boundary of prompt + output, the last one left
        rest = run_to_the_end(engine, f"cut-{cut}", prompt, params, Resumption({0: whole[0][:cut]}))[0]
        assert rest[0] == whole[0][cut:] and rest[2] == "length"
        assert [p.token_id for p in rest[1]] == rest[0]
        for mine, theirs in zip(rest[1], whole[1][cut:]):  # the same distribution at the same place
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_resumed_seeded_samples_with_penalties_continue_each_sequence_s_own_stream(engine):
    """n = 3, seeded, with penalties over the output so far and min_tokens: each sequence resumed
    at its own point (one with nothing yet, one not at all: it had ended) samples what it would have."""
    prompt = [random.Random(2).randrange(1, 500) for _ in range(21)]
    params = SamplingParams(n=3, temperature=0.9, top_k=40, seed=1234, repetition_penalty=1.3,
                            frequency_penalty=0.5, presence_penalty=0.3, min_tokens=10,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    whole = run_to_the_end(engine, "seeded", prompt, params)
    assert len({tuple(whole[i][0]) for i in range(3)}) == 3, "three different samples were meant"
    cuts = {0: 5, 2: 0}  # sequence 1 is left out, as one a stop string had ended at the gateway
    resumed = run_to_the_end(engine, "seeded-again", prompt, params,
                             Resumption({i: whole[i][0][:cut] for i, cut in cuts.items()}))
    assert set(resumed) == set(cuts)
    for index, cut in cuts.items():
        assert resumed[index][0] == whole[index][0][cut:], f"sequence {index}"


def test_what_cannot_be_resumed_is_refused(engine):
    prompt = [3, 4, 5]
    with pytest.raises(ValueError, match="beam search cannot be resumed"):
        engine.add_request(EngineRequest("beams", prompt, SamplingParams(use_beam_search=True, n=2, max_tokens=4),
                                         resumption=Resumption({0: [1]})))
    with pytest.raises(ValueError, match="not one of the request's n=2"):
        engine.add_request(EngineRequest("index", prompt, SamplingParams(n=2, max_tokens=4),
                                         resumption=Resumption({2: [1]})))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineRequest("vocab", prompt, SamplingParams(max_tokens=4),
                                         resumption=Resumption({0: [1, 10 ** 6]})))
    with pytest.raises(ValueError, match="it had finished"):
        engine.add_request(EngineRequest("done", prompt, SamplingParams(max_tokens=2),
                                         resumption=Resumption({0: [1, 2]})))
    assert not engine.has_unfinished()  # nothing refused was left behind
    with pytest.raises(ValueError, match="at least one sequence"):
        Resumption({})
    with pytest.raises(ValueError, match="twice"):
        Resumption.from_proto([wire.ResumedSequence(seq_index=0), wire.ResumedSequence(seq_index=0)])
    assert Resumption.from_proto([]) is None
    entries = Resumption({1: [7, 8], 0: []}).to_proto()
    assert Resumption.from_proto(entries) == Resumption({0: [], 1: [7, 8]})


def test_a_stop_string_ends_the_resumed_sequence_it_names(engine):
    """Sequence 0 had ended: 1 and 2 are resumed, and the stop string seen in 1 ends 1 (not the
    second sequence the request holds)."""
    prompt = [random.Random(3).randrange(1, 500) for _ in range(11)]
    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
    engine.add_request(EngineRequest("stopped", prompt, params, resumption=Resumption({1: [11, 12], 2: [13, 14]})))
    engine.step()
    assert engine.finish_by_stop_string("stopped", 1, "xyz") and not engine.finish_by_stop_string("stopped", 0, "x")
    after = []
    while engine.has_unfinished():
        after += [(u.seq_index, u.finish_reason) for u in engine.step()]
    assert {i for i, _ in after} == {2} and after[-1] == (2, "length")
