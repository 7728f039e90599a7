"""Draft tokens by prompt lookup (n-gram speculation): no second model, only the sequence's own tokens.

The sequence's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the longest
that occurred before) are looked up earlier in its prompt and output; the tokens that followed their
latest earlier occurrence are the drafts. Where that occurrence ends so close to the end that fewer
than k tokens follow it (a repeating loop), the drafts continue the same pattern: the proposal is
what the sequence would be if it went on repeating itself.

The search is vectorised over the whole context (numpy, one comparison per token), so per step the
Python work is a few calls per sequence, whatever its length.
"""

from __future__ import annotations

import numpy as np

from shared.speculative_config import SpeculativeConfig


class TokenHistory:
    """A sequence's token ids as a growing int32 array; appends cost what they add."""

    def __init__(self, token_ids: list[int]):
        self._buffer = np.empty(max(64, 2 * len(token_ids)), dtype=np.int32)
        self._buffer[:len(token_ids)] = token_ids
        self.length = len(token_ids)

    def extend(self, token_ids: list[int]) -> None:
        self._fit(self.length + len(token_ids))
        self._buffer[self.length:self.length + len(token_ids)] = token_ids
        self.length += len(token_ids)

    def with_pending(self, token_ids: list[int]) -> np.ndarray:
        """The tokens followed by ``token_ids``, which are not kept (the scheduler sends them next step)."""
        end = self.length + len(token_ids)
        self._fit(end)
        self._buffer[self.length:end] = token_ids
        return self._buffer[:end]

    def copy(self) -> "TokenHistory":
        clone = TokenHistory([])
        clone._buffer, clone.length = self._buffer.copy(), self.length
        return clone

    def _fit(self, size: int) -> None:
        if size > len(self._buffer):
            grown = np.empty(max(size, 2 * len(self._buffer)), dtype=np.int32)
            grown[:self.length] = self._buffer[:self.length]
            self._buffer = grown


class NgramProposer:
    needs_history = True  # the worker keeps each sequence's tokens as a TokenHistory

    def __init__(self, config: SpeculativeConfig):
        self.num_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose_batch(self, seqs: list, computed_before: list[int], new_tokens: list[list[int]], tables=None,
                      wanted: bool = True) -> list[list[int]]:
        """Drafts for each sequence that sampled (new_tokens: its accepted drafts, then the sampled token);
        none at all unless ``wanted``."""
        return [self.propose(seq.history.with_pending(new)) if new and wanted and not seq.constrained else []
                for seq, new in zip(seqs, new_tokens)]

    def propose(self, tokens: np.ndarray) -> list[int]:
        """Up to num_tokens drafts to follow ``tokens`` (the whole sequence); [] when its suffix is new."""
        start = self.latest_match_end(tokens)
        if start is None:
            return []
        proposal: list[int] = []
        length = len(tokens)
        for position in range(start, start + self.num_tokens):
            proposal.append(int(tokens[position]) if position < length else proposal[position - length])
        return proposal

    def latest_match_end(self, tokens: np.ndarray) -> int | None:
        """Where the tokens after the latest earlier occurrence of the longest matching suffix start."""
        last = len(tokens) - 1
        if last < self.min_n:  # no room for a suffix of min_n tokens and an earlier occurrence
            return None
        # Ends (last index) of earlier occurrences of the final token; then keep those whose
        # preceding tokens match the suffix too, one more token at a time, up to max_n.
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        matched = 1
        while ends.size and matched < self.max_n and matched <= last:
            longer = ends[ends >= matched]
            longer = longer[tokens[longer - matched] == tokens[last - matched]]
            if not longer.size:
                break
            ends, matched = longer, matched + 1
        if not ends.size or matched < self.min_n:
            return None
        return int(ends[-1]) + 1
