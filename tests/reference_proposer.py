"""A draft proposer for tests and benchmarks: drafts from known continuations, some made wrong on purpose.

The random test models never repeat themselves, so n-gram drafts are all rejected on them. This
proposer knows what the model will say (a reference run) and proposes it, with a chosen share of
drafts corrupted: it drives acceptance, rejection at every position, and their mix, through the real
worker, and in the benchmark it sets the acceptance rate.
"""

from __future__ import annotations

import random

import numpy as np

from services.worker.ngram_proposer import NgramProposer


class ReferenceProposer(NgramProposer):
    """The n-gram proposer's batch method and token histories, with drafts of its own."""

    def __init__(self, references: list[list[int]], num_tokens: int, vocab_size: int, wrong: float = 0.2,
                 seed: int = 0):
        """references: whole sequences (prompt + the continuation to propose); wrong: the chance that a
        draft (and every draft after it) is corrupted."""
        self.references = [list(r) for r in references]
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.calls = 0

    def propose(self, tokens: np.ndarray) -> list[int]:
        self.calls += 1
        seq = tokens.tolist()
        for ref in self.references:
            if len(ref) > len(seq) and ref[:len(seq)] == seq:
                drafts = ref[len(seq):len(seq) + self.rng.randint(1, self.num_tokens)]
                return [t if j < self._first_wrong(len(drafts)) else (t + 1) % self.vocab_size
                        for j, t in enumerate(drafts)]
        return []

    def _first_wrong(self, count: int) -> int:
        for j in range(count):
            if self.rng.random() < self.wrong:
                return j
        return count
