"""Well-formed UTF-8 under a grammar: which tokens may come next so that the output's bytes stay valid
UTF-8, given the character the output may have left unfinished.

xgrammar decodes a multi-byte character leniently: it takes a surrogate (ED A0..BF ..) or an overlong
form (E0 80..9F .., F0 80..8F .. ..) as the code point it spells. Such bytes are not UTF-8, so the text
a client gets holds U+FFFD in their place: a string the grammar counted as 7 characters arrives as 9,
and a pattern it matched no longer matches. A constrained sequence's mask is therefore the grammar's
and this one's.

The state is what the next byte must be: nothing pending, or `remaining` continuation bytes of which
the first lies in [low, high] (RFC 3629's table: E0 takes A0..BF next, ED 80..9F, F0 90..BF, F4 80..8F).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Pending(NamedTuple):
    remaining: int  # continuation bytes still due (0: the text so far ends on a whole character)
    low: int  # the range of the next one
    high: int


COMPLETE = Pending(0, 0x80, 0xBF)
_ANY = (0x80, 0xBF)
# A lead byte's state: what may follow it. Bytes absent here (80..BF, C0, C1, F5..FF) never start a character.
_LEADS = {**{b: Pending(1, *_ANY) for b in range(0xC2, 0xE0)}, 0xE0: Pending(2, 0xA0, 0xBF),
          **{b: Pending(2, *_ANY) for b in [*range(0xE1, 0xED), 0xEE, 0xEF]}, 0xED: Pending(2, 0x80, 0x9F),
          0xF0: Pending(3, 0x90, 0xBF), **{b: Pending(3, *_ANY) for b in range(0xF1, 0xF4)},
          0xF4: Pending(3, 0x80, 0x8F)}
STATES = (COMPLETE, *sorted(set(_LEADS.values())))  # every state (a lead byte's, or one a continuation leaves)


def after(state: Pending, data: bytes) -> Pending | None:
    """The state after these bytes, or None where they break UTF-8."""
    for byte in data:
        if state.remaining == 0:
            if byte < 0x80:
                continue
            state = _LEADS.get(byte)
            if state is None:
                return None
        elif state.low <= byte <= state.high:
            state = COMPLETE if state.remaining == 1 else Pending(state.remaining - 1, *_ANY)
        else:
            return None
    return state


class Utf8Masks:
    """For each state, the bitmask (xgrammar's layout: bit j of word i is token 32 i + j) of the tokens
    whose bytes keep the output well-formed."""

    def __init__(self, token_bytes: Sequence[bytes], vocab_size: int):
        self.token_bytes = list(token_bytes) + [b""] * (vocab_size - len(token_bytes))
        self.masks = {state: _packed([after(state, data) is not None for data in self.token_bytes])
                      for state in STATES}

    def next_state(self, state: Pending, token_id: int) -> Pending:
        """After a token the grammar took (bytes that break UTF-8 leave the state as it was: the mask
        could not keep them out, and the next character starts afresh)."""
        return after(state, self.token_bytes[token_id]) or COMPLETE

    def restrict(self, bitmask: torch.Tensor, row: int, state: Pending) -> None:
        """Row ``row`` keeps only the tokens that are well-formed after ``state`` (unless that would leave
        none: then the grammar's choice stands)."""
        allowed = bitmask[row] & self.masks[state]
        if bool(allowed.any()):
            bitmask[row] = allowed


def _packed(allowed: list[bool]) -> torch.Tensor:
    """[ceil(V / 32)] int32 words from V flags."""
    flags = torch.tensor(allowed + [False] * (-len(allowed) % 32), dtype=torch.int64).view(-1, 32)
    words = (flags << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
