"""The n-gram (prompt lookup) proposer against a brute-force reference, and the speculative config."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.worker.ngram_proposer import NgramProposer, TokenHistory
from shared.config import EngineConfig
from shared.speculative_config import SpeculativeConfig


def proposer(k=4, min_n=1, max_n=4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest suffix (max_n down to min_n) with an earlier occurrence; its latest one; the tokens
    after it, continued with the proposal itself once the sequence ends."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        starts = [i for i in range(length - n) if tokens[i:i + n] == suffix]
        if starts:
            extended = list(tokens)
            for position in range(starts[-1] + n, starts[-1] + n + k):
                extended.append(extended[position])
            return extended[length:]
    return []


def test_the_longest_suffix_wins_over_a_later_shorter_one():
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 5, 1, 2, 3]
    assert proposer(k=3, max_n=3).propose(np.array(tokens)) == [9, 8, 2]
    assert proposer(k=3, max_n=2).propose(np.array(tokens)) == [7, 5, 1]  # [2, 3]: its latest occurrence


def test_a_repeating_loop_is_continued_past_the_end():
    assert proposer(k=5).propose(np.array([5, 6, 5, 6, 5])) == [6, 5, 6, 5, 6]
    assert proposer(k=3).propose(np.array([4, 4])) == [4, 4, 4]


def test_nothing_is_proposed_for_a_new_suffix_or_one_shorter_than_min_n():
    assert proposer().propose(np.array([1, 2, 3, 4])) == []
    assert proposer().propose(np.array([7])) == []
    assert proposer(min_n=2).propose(np.array([1, 2, 9, 2])) == []  # only [2] occurred before
    assert proposer(min_n=2).propose(np.array([1, 2, 9, 1, 2])) == [9, 1, 2, 9]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60), k=st.integers(1, 6),
       sizes=st.tuples(st.integers(1, 5), st.integers(0, 3)))
def test_matches_the_brute_force_reference(tokens, k, sizes):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    got = proposer(k, min_n, max_n).propose(np.array(tokens, dtype=np.int32))
    assert got == brute_force(tokens, k, min_n, max_n)


def test_token_history_grows_and_pending_tokens_are_not_kept():
    history = TokenHistory([1, 2, 3])
    history.extend(list(range(100)))
    assert history.length == 103
    view = history.with_pending([7, 8])
    assert view.tolist() == [1, 2, 3, *range(100), 7, 8]
    assert history.length == 103
    history.extend([9])
    assert history.with_pending([]).tolist()[-2:] == [99, 9]
    clone = history.copy()
    clone.extend([5])
    assert history.length == 104 and clone.with_pending([]).tolist()[-1] == 5


@pytest.mark.parametrize("value, match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported here"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, r"in \[1, 64\]"),
    ({"num_speculative_tokens": True}, r"in \[1, 64\]"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must not exceed"),
    ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown speculative_config key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "use it with method 'draft_model'"),
    ({"model": "/m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
    ("{not json", "not valid JSON"),
    ("[1]", "JSON object"),
])
def test_bad_speculative_configs_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(value)
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=value)


def test_a_model_without_a_method_is_a_draft_model_as_in_vllm():
    config = SpeculativeConfig.parse({"model": "/draft", "num_speculative_tokens": 3})
    assert config.method == "draft_model" and config.prompt_lookup_max is None
    assert SpeculativeConfig.parse(config.to_json()) == config


def test_prompt_lookup_sizes_default_as_vllm_s():
    assert (SpeculativeConfig(2).prompt_lookup_min, SpeculativeConfig(2).prompt_lookup_max) == (5, 5)
    assert SpeculativeConfig(2, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(2, prompt_lookup_min=2).prompt_lookup_max == 2


def test_a_speculative_config_round_trips_through_json():
    config = EngineConfig(speculative_config='{"num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2)
    assert SpeculativeConfig.parse(config.speculative_config.to_json()) == config.speculative_config
