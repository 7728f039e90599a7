"""The worker's sampler: every parameter's effect, logprobs, and seeded reproducibility."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.sampler import Sampler, SamplingState
from shared.sampling_params import SamplingParams

V = 32
EOS = 31


def make_state(prompt=(1, 2, 3), output=(), vocab_size=V, stream_index=0, **params) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt), list(output), vocab_size, stream_index)


def sample_tokens(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState]) -> list[int]:
    return [token for token, _ in sampler.sample(logits, states)]


def repeated_draws(logits_row: torch.Tensor, draws: int = 2000, seed: int = 0, **params) -> torch.Tensor:
    """Draw many times from one row by batching copies of it (unseeded, one sample call)."""
    sampler = Sampler(logits_row.shape[-1], [], seed=seed)
    states = [make_state(vocab_size=logits_row.shape[-1], **params) for _ in range(draws)]
    return torch.tensor(sample_tokens(sampler, logits_row.expand(draws, -1).clone(), states))


def logits_of_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log().unsqueeze(0)


def chi_square(tokens: torch.Tensor, probs: list[float]) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = torch.tensor(probs, dtype=torch.float64) * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


# With 4 degrees of freedom, P(chi2 > 30) is about 5e-6: loose, yet a wrong distribution blows past it.
CHI2_BOUND_4DOF = 30.0
FIVE_PROBS = [0.4, 0.25, 0.2, 0.1, 0.05]


# ---- greedy and temperature ----

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_greedy_is_argmax(batch, seed):
    logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(seed))
    states = [make_state(temperature=0.0) for _ in range(batch)]
    assert sample_tokens(Sampler(V, [EOS]), logits, states) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_take_the_argmax_of_logits_in_the_models_dtype(dtype):
    # A half-precision model's logits reach the sampler as they are: an all-greedy batch takes their argmax
    # without a float32 copy, any other batch widens them first; both choose as argmax of the float32 values.
    logits = (torch.randn(6, V, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    expected = logits.float().argmax(-1).tolist()
    greedy = [make_state(temperature=0.0) for _ in range(6)]
    assert sample_tokens(Sampler(V, [EOS]), logits, greedy) == expected
    with_logprobs = greedy[:5] + [make_state(temperature=0.0, logprobs=2)]
    samples = Sampler(V, [EOS]).sample(logits, with_logprobs)
    assert [token for token, _ in samples] == expected and samples[5][1] is not None


def test_only_argmax_rows_are_those_no_stage_touches():
    assert make_state(temperature=0.0).only_argmax
    assert make_state(temperature=1e-6, min_tokens=2, output=(4, 5)).only_argmax
    touched = [dict(temperature=1.0), dict(temperature=0.0, logprobs=0), dict(temperature=0.0, logit_bias={3: 1.0}),
               dict(temperature=0.0, allowed_token_ids=[3, 4]), dict(temperature=0.0, min_tokens=1),
               dict(temperature=0.0, presence_penalty=0.5), dict(temperature=0.0, repetition_penalty=1.1),
               dict(temperature=0.0, bad_words=["x"], bad_words_token_ids=[[7]])]
    assert not any(make_state(**params).only_argmax for params in touched)


def test_tiny_temperature_behaves_like_greedy():
    logits = torch.randn(64, V, generator=torch.Generator().manual_seed(1)) * 3
    expected = logits.argmax(-1).tolist()
    for temperature in (1e-7, 1e-3):
        states = [make_state(temperature=temperature) for _ in range(64)]
        assert sample_tokens(Sampler(V, [EOS]), logits, states) == expected


def test_high_temperature_spreads_and_low_concentrates():
    row = logits_of_probs([0.9] + [0.1 / (V - 1)] * (V - 1))
    hot = repeated_draws(row, temperature=100.0)
    cold = repeated_draws(row, temperature=0.2)
    assert len(hot.unique()) > V // 2
    assert (hot == 0).float().mean() < 0.2
    assert (cold == 0).all()


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    states = [make_state(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    tokens = sample_tokens(Sampler(V, [EOS]), logits, states)
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()


# ---- top_k, top_p, min_p ----

def test_top_k_one_equals_greedy():
    logits = torch.randn(50, V, generator=torch.Generator().manual_seed(3))
    states = [make_state(top_k=1, temperature=2.0) for _ in range(50)]
    assert sample_tokens(Sampler(V, [EOS]), logits, states) == logits.argmax(-1).tolist()


@settings(max_examples=15, deadline=None)
@given(st.integers(2, 10), st.integers(0, 2**31 - 1))
def test_top_k_never_leaves_the_top_k(k, seed):
    row = torch.randn(1, V, generator=torch.Generator().manual_seed(seed))
    allowed = set(row.topk(k).indices[0].tolist())
    tokens = repeated_draws(row, draws=300, seed=seed, top_k=k, temperature=5.0)
    assert set(tokens.tolist()) <= allowed


def test_small_top_p_keeps_only_the_top_token():
    row = logits_of_probs(FIVE_PROBS)
    assert (repeated_draws(row, top_p=0.01) == 0).all()


def test_top_p_keeps_exactly_the_nucleus():
    row = logits_of_probs(FIVE_PROBS)  # mass 0.4, 0.65, 0.85, ...: top_p 0.6 needs tokens 0 and 1
    tokens = repeated_draws(row, top_p=0.6)
    assert set(tokens.tolist()) == {0, 1}
    assert abs((tokens == 0).float().mean() - 0.4 / 0.65) < 0.05  # renormalised over the nucleus


def test_top_p_applies_after_top_k():
    row = logits_of_probs(FIVE_PROBS)  # top 3 renormalised: 0.47, 0.29, 0.24
    assert set(repeated_draws(row, top_k=3, top_p=0.7).tolist()) == {0, 1}


def test_min_p_filters_unlikely_tokens():
    row = logits_of_probs(FIVE_PROBS)  # min_p 0.45: keep p >= 0.18, tokens 0, 1, 2
    tokens = repeated_draws(row, min_p=0.45)
    assert set(tokens.tolist()) == {0, 1, 2}


# ---- penalties ----

def close_pair_logits(first: float = 1.0, second: float = 0.9) -> torch.Tensor:
    logits = torch.full((1, V), -5.0)
    logits[0, 0], logits[0, 1] = first, second
    return logits


def greedy_choice(logits: torch.Tensor, **params) -> int:
    return sample_tokens(Sampler(V, [EOS]), logits, [make_state(temperature=0.0, **params)])[0]


def test_presence_penalty_pushes_away_and_negative_pulls_back():
    assert greedy_choice(close_pair_logits(), output=[0]) == 0
    assert greedy_choice(close_pair_logits(), output=[0], presence_penalty=0.5) == 1
    assert greedy_choice(close_pair_logits(), output=[1], presence_penalty=-0.5) == 1
    assert greedy_choice(close_pair_logits(), prompt=[0], presence_penalty=0.5) == 0  # prompt tokens don't count


def test_frequency_penalty_grows_with_count():
    logits = close_pair_logits(1.0, 0.5)
    assert greedy_choice(logits, output=[0], frequency_penalty=0.3) == 0
    assert greedy_choice(logits, output=[0, 0], frequency_penalty=0.3) == 1
    assert greedy_choice(close_pair_logits(), output=[1, 1], frequency_penalty=-0.3) == 1


def test_frequency_penalty_follows_appended_tokens():
    state = make_state(temperature=0.0, frequency_penalty=0.3)
    sampler, logits = Sampler(V, [EOS]), close_pair_logits(1.0, 0.5)
    state.append(0)
    assert sample_tokens(sampler, logits, [state]) == [0]
    state.append(0)
    assert sample_tokens(sampler, logits, [state]) == [1]


def test_repetition_penalty_covers_prompt_and_output_both_signs():
    assert greedy_choice(close_pair_logits(), prompt=[0], repetition_penalty=2.0) == 1
    assert greedy_choice(close_pair_logits(), prompt=[5], output=[0], repetition_penalty=2.0) == 1
    # Negative logits are multiplied: a seen token gets less likely there too.
    assert greedy_choice(close_pair_logits(-1.0, -1.1), prompt=[0], repetition_penalty=2.0) == 1
    # Below 1 the penalty pulls towards seen tokens.
    assert greedy_choice(close_pair_logits(), prompt=[1], repetition_penalty=0.5) == 1


def reference_scores(logits: torch.Tensor, params: SamplingParams,
                     prompt: list[int], output: list[int]) -> torch.Tensor:
    """The processing order written out token by token, as the oracle for the vectorised code."""
    scores = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        scores[token] += bias
    if len(output) < params.min_tokens:
        for token in params.stop_token_ids + ([] if params.ignore_eos else [EOS]):
            scores[token] = float("-inf")
    for token in range(len(scores)):
        if token in prompt or token in output:
            penalty = params.repetition_penalty
            scores[token] = scores[token] / penalty if scores[token] > 0 else scores[token] * penalty
        count = output.count(token)
        scores[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return scores


token_ids = st.lists(st.integers(0, V - 1), max_size=6)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_processing_matches_a_token_by_token_reference(data):
    batch = data.draw(st.integers(1, 4))
    logits = torch.randn(batch, V, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 999))))
    rows = []
    for _ in range(batch):
        params = SamplingParams(
            presence_penalty=data.draw(st.sampled_from([0.0, 0.7, -1.0])),
            frequency_penalty=data.draw(st.sampled_from([0.0, 0.4, -0.3])),
            repetition_penalty=data.draw(st.sampled_from([1.0, 1.5, 0.8])),
            logit_bias=data.draw(st.none() | st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=3)),
            min_tokens=data.draw(st.integers(0, 3)), max_tokens=None,
            stop_token_ids=data.draw(st.lists(st.integers(0, V - 1), max_size=2)),
            ignore_eos=data.draw(st.booleans()))
        rows.append((params, data.draw(token_ids), data.draw(token_ids)))
    states = [SamplingState(p, prompt, output, V) for p, prompt, output in rows]
    got = Sampler(V, [EOS])._processed_scores(logits, states)
    for i, (params, prompt, output) in enumerate(rows):
        torch.testing.assert_close(got[i], reference_scores(logits[i], params, prompt, output))


# ---- logit_bias and min_tokens ----

def test_logit_bias_forces_and_forbids():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(4))
    best = int(logits.argmax())
    assert greedy_choice(logits, logit_bias={7: 100.0}) == 7
    assert greedy_choice(logits, logit_bias={best: -100.0}) != best
    assert set(repeated_draws(logits[0:1], draws=300, logit_bias={7: 100.0}).tolist()) == {7}


def eos_favoured_logits() -> torch.Tensor:
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 9], logits[0, 4] = 10.0, 9.0, 1.0
    return logits


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    sampler, logits = Sampler(V, [EOS]), eos_favoured_logits()
    state = make_state(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    assert sample_tokens(sampler, logits, [state]) == [4]
    state.append(4)
    assert sample_tokens(sampler, logits, [state]) == [4]
    state.append(4)
    assert sample_tokens(sampler, logits, [state]) == [EOS]  # min_tokens reached: nothing masked


def test_min_tokens_counts_tokens_from_before_a_recompute():
    logits = eos_favoured_logits()
    assert greedy_choice(logits, output=[4], min_tokens=2) != EOS
    assert greedy_choice(logits, output=[4, 4], min_tokens=2) == EOS


def test_ignore_eos_leaves_eos_unmasked_but_still_masks_stop_ids():
    logits = eos_favoured_logits()
    assert greedy_choice(logits, min_tokens=2, ignore_eos=True) == EOS
    logits[0, EOS] = 0.0
    assert greedy_choice(logits, min_tokens=2, ignore_eos=True, stop_token_ids=[9]) == 4


def test_all_eos_ids_are_masked():
    logits = eos_favoured_logits()
    logits[0, 30] = 11.0
    sampler = Sampler(V, [EOS, 30])
    assert sample_tokens(sampler, logits, [make_state(temperature=0.0, min_tokens=1)]) == [9]


# ---- logprobs ----

def test_logprobs_come_from_the_raw_distribution():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    states = [make_state(logprobs=5, temperature=0.7, top_k=4, presence_penalty=1.0, output=[3], logit_bias={2: 3.0}),
              make_state(logprobs=3, temperature=0.0),
              make_state(logprobs=0, seed=11)]
    raw = torch.log_softmax(logits, -1)
    for row, ((token, position), state) in enumerate(zip(Sampler(V, [EOS]).sample(logits, states), states)):
        assert position.token_id == token
        assert position.logprob == pytest.approx(float(raw[row, token]), abs=1e-6)
        assert position.rank == 1 + int((raw[row] > raw[row, token]).sum())
        expected_top = raw[row].topk(state.params.logprobs)
        assert position.top_token_ids == expected_top.indices.tolist()
        assert position.top_logprobs == pytest.approx(expected_top.values.tolist(), abs=1e-6)


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_none():
    logits = torch.randn(2, V)
    (_, zero), (_, none) = Sampler(V, [EOS]).sample(logits, [make_state(logprobs=0), make_state()])
    assert zero.top_token_ids == [] and zero.top_logprobs == []
    assert none is None


def test_greedy_token_has_rank_one():
    logits = torch.randn(4, V)
    results = Sampler(V, [EOS]).sample(logits, [make_state(temperature=0.0, logprobs=1) for _ in range(4)])
    assert all(p.rank == 1 and p.top_token_ids == [t] for t, p in results)


def test_prompt_logprobs_match_log_softmax():
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(6))
    targets = [3, 0, 31, 7, 7]
    raw = torch.log_softmax(logits, -1)
    positions = Sampler(V, [EOS]).prompt_logprobs(logits, targets, num_top=2)
    assert [p.token_id for p in positions] == targets
    for row, position in enumerate(positions):
        assert position.logprob == pytest.approx(float(raw[row, targets[row]]), abs=1e-6)
        assert position.rank == 1 + int((raw[row] > raw[row, targets[row]]).sum())
        assert position.top_token_ids == raw[row].topk(2).indices.tolist()
    assert Sampler(V, [EOS]).prompt_logprobs(logits, targets, num_top=0)[0].top_token_ids == []


def test_raw_logits_are_not_modified():
    logits = torch.randn(2, V)
    before = logits.clone()
    Sampler(V, [EOS]).sample(logits, [make_state(logit_bias={1: 5.0}, presence_penalty=1.0, output=[2], top_p=0.5),
                                      make_state(min_tokens=3, temperature=0.0)])
    assert torch.equal(logits, before)


# ---- seeded sampling ----

def flat_logits(batch: int, vocab: int = 1000) -> torch.Tensor:
    return torch.zeros(batch, vocab)


def test_seeded_row_is_the_same_alone_and_in_any_batch():
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7))

    def seeded():
        return make_state(vocab_size=vocab, seed=1234, output=[5, 6], temperature=0.9, top_p=1.0)

    alone = sample_tokens(Sampler(vocab, [EOS], seed=1), logits, [seeded()])[0]
    others = [make_state(vocab_size=vocab), make_state(vocab_size=vocab, seed=99),
              make_state(vocab_size=vocab, top_k=5, top_p=0.5, min_p=0.1),
              make_state(vocab_size=vocab, temperature=0.0)]
    noise = torch.randn(len(others), vocab)
    for position in range(len(others) + 1):
        states = others[:position] + [seeded()] + others[position:]
        batch = torch.cat([noise[:position], logits, noise[position:]])
        assert sample_tokens(Sampler(vocab, [EOS], seed=position + 50), batch, states)[position] == alone


def test_seeded_sequence_survives_a_recompute():
    vocab, sampler = 1000, Sampler(1000, [EOS])
    logits = flat_logits(1, vocab)
    live = make_state(vocab_size=vocab, seed=42)
    tokens = []
    for _ in range(8):
        token = sample_tokens(sampler, logits, [live])[0]
        live.append(token)
        tokens.append(token)
    rebuilt = make_state(vocab_size=vocab, seed=42, output=tokens[:4])
    for token in tokens[4:]:
        assert sample_tokens(Sampler(vocab, [EOS], seed=5), logits, [rebuilt]) == [token]
        rebuilt.append(token)


def seeded_stream(seed: int, stream_index: int = 0, steps: int = 10, vocab: int = 1000) -> list[int]:
    state = make_state(vocab_size=vocab, seed=seed, stream_index=stream_index)
    sampler, tokens = Sampler(vocab, [EOS]), []
    for _ in range(steps):
        tokens.append(sample_tokens(sampler, flat_logits(1, vocab), [state])[0])
        state.append(tokens[-1])
    return tokens


def test_seeds_and_stream_indices_give_different_streams():
    base = seeded_stream(1)
    assert seeded_stream(1) == base
    assert seeded_stream(2) != base
    assert seeded_stream(1, stream_index=1) != base
    assert seeded_stream(-1) != base and seeded_stream(2**40 + 1) != base
    assert len(set(base)) > 5  # the counter moves the stream on


def test_seeded_hash_follows_the_distribution_over_counters():
    vocab, steps = len(FIVE_PROBS), 4000
    sampler, logits = Sampler(vocab, [], seed=0), logits_of_probs(FIVE_PROBS)
    state = make_state(vocab_size=vocab, prompt=[0], seed=2024)
    tokens = []
    for _ in range(steps):
        tokens.append(sample_tokens(sampler, logits, [state])[0])
        state.append(tokens[-1])
    tokens = torch.tensor(tokens)
    assert chi_square(tokens, FIVE_PROBS) < CHI2_BOUND_4DOF
    assert chi_square(tokens, [0.2] * 5) > CHI2_BOUND_4DOF  # the check can fail


def test_seeded_hash_follows_the_distribution_over_seeds():
    vocab, rows = len(FIVE_PROBS), 6000
    states = [make_state(vocab_size=vocab, prompt=[0], seed=seed) for seed in range(rows)]
    logits = logits_of_probs(FIVE_PROBS).expand(rows, -1).clone()
    tokens = torch.tensor(sample_tokens(Sampler(vocab, []), logits, states))
    assert chi_square(tokens, FIVE_PROBS) < CHI2_BOUND_4DOF


def test_unseeded_sampling_follows_the_distribution():
    tokens = repeated_draws(logits_of_probs(FIVE_PROBS), draws=6000)
    assert chi_square(tokens, FIVE_PROBS) < CHI2_BOUND_4DOF
    assert chi_square(tokens, [0.35, 0.3, 0.2, 0.1, 0.05]) > CHI2_BOUND_4DOF


def test_unseeded_sampler_seed_reproduces_and_varies():
    logits = flat_logits(50)
    states = [make_state(vocab_size=1000) for _ in range(50)]
    first = sample_tokens(Sampler(1000, [EOS], seed=3), logits, states)
    assert sample_tokens(Sampler(1000, [EOS], seed=3), logits, states) == first
    assert sample_tokens(Sampler(1000, [EOS], seed=4), logits, states) != first


# ---- everything at once ----

def test_mixed_batch_each_row_obeys_its_own_params():
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(8)).expand(8, -1).clone()
    logits[:, EOS] = 8.0
    order = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)
    params = [dict(temperature=0.0),
              dict(top_k=3),
              dict(top_p=0.05),
              dict(min_p=0.9, temperature=0.5),
              dict(logit_bias={5: 100.0}, seed=3),
              dict(min_tokens=1, stop_token_ids=[order[1]], temperature=0.0, logprobs=2),
              dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=1.5, output=[EOS], seed=8),
              dict(temperature=1.0, seed=4, logprobs=0)]
    sampler = Sampler(V, [EOS], seed=9)
    for _ in range(40):
        results = sampler.sample(logits, [make_state(**p) for p in params])
        tokens = [t for t, _ in results]
        assert tokens[0] == EOS
        assert tokens[1] in order[:3]
        assert tokens[2] == EOS
        assert probs[tokens[3]] >= 0.9 * probs.max()
        assert tokens[4] == 5
        assert tokens[5] == order[2]  # EOS and the stop id masked before min_tokens
        assert results[5][1].top_token_ids == order[:2]
        assert [r[1] is None for r in results] == [True] * 5 + [False, True, False]


# ---- validation ----

def test_token_ids_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match="logit_bias"):
        make_state(logit_bias={V: 1.0})
    with pytest.raises(ValueError, match="stop_token_ids"):
        make_state(stop_token_ids=[V + 3])
    with pytest.raises(ValueError):
        Sampler(V, [V])
    with pytest.raises(ValueError):
        make_state().append(V)


def test_logits_shape_must_match_states_and_vocabulary():
    with pytest.raises(ValueError):
        Sampler(V, [EOS]).sample(torch.zeros(2, V), [make_state()])
    with pytest.raises(ValueError):
        Sampler(V, [EOS]).sample(torch.zeros(1, V + 1), [make_state()])
    assert Sampler(V, [EOS]).sample(torch.zeros(0, V), []) == []


def test_penalty_state_is_dense_only_when_needed():
    plain = make_state()
    assert plain.output_counts is None and plain.prompt_mask is None and plain.bias_row is None
    penalised = make_state(prompt=[1, 1, 2], output=[4, 4], repetition_penalty=1.2, logit_bias={3: 1.0})
    assert penalised.output_counts[4] == 2 and penalised.prompt_mask.sum() == 2 and penalised.bias_row[3] == 1.0
    penalised.append(4)
    assert penalised.output_counts[4] == 3 and penalised.num_output_tokens == 3
    assert int(penalised.output_counts.sum()) == 3


def test_top_k_samples_the_same_with_or_without_the_sort():
    # A batch with a top_p row takes the sort path; without one, the cheaper top-k path.
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(9))
    beside = {"alone": [], "plain": [make_state(vocab_size=vocab)], "top_p": [make_state(vocab_size=vocab, top_p=0.3)]}
    for seed in range(20):
        tokens = set()
        for others in beside.values():
            states = [make_state(vocab_size=vocab, seed=seed, top_k=5, temperature=3.0)] + others
            batch = torch.cat([logits, torch.randn(len(others), vocab)])
            tokens.add(sample_tokens(Sampler(vocab, []), batch, states)[0])
        assert len(tokens) == 1 and tokens <= set(logits.topk(5).indices[0].tolist())


@settings(max_examples=60, deadline=None)
@given(drafts=st.lists(st.integers(0, V - 1), min_size=1, max_size=5), output=st.lists(st.integers(0, V - 1), max_size=6),
       seed=st.integers(0, 2**31), min_tokens=st.integers(0, 8))
def test_verification_states_equal_states_that_sampled_the_drafts_one_by_one(drafts, output, seed, min_tokens):
    """Speculative decoding samples position j of a verification from a view of the state as if
    drafts 0..j-1 had been appended: the same penalties, min_tokens mask and seeded counter, so the
    same token as decoding one step at a time."""
    params = dict(temperature=1.0, seed=seed, presence_penalty=1.5, frequency_penalty=2.0, repetition_penalty=1.5,
                  min_tokens=min_tokens, stop_token_ids=[5], logit_bias={3: 1.0})
    state = make_state(output=output, **params)
    views = state.verification_states(drafts, torch.device("cpu"))
    assert len(views) == len(drafts) + 1
    logits = torch.randn(len(views), V, generator=torch.Generator().manual_seed(seed)) * 3
    one_by_one = []
    for j in range(len(views)):
        reference = make_state(output=output + drafts[:j], **params)
        assert views[j].num_output_tokens == reference.num_output_tokens
        assert torch.equal(views[j].output_counts, reference.output_counts)
        one_by_one.append(sample_tokens(Sampler(V, [EOS]), logits[j:j + 1], [reference])[0])
    assert sample_tokens(Sampler(V, [EOS]), logits, views) == one_by_one
    assert state.num_output_tokens == len(output)  # the views leave the state itself alone
    assert torch.equal(state.output_counts, make_state(output=output, **params).output_counts)
