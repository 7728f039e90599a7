"""Outputs sent as columns with the uncommon ones whole: putting them back in order.

The step result and the session stream both send their common outputs (a token, nothing else) as
columns and the others whole, each with its position in the step's order; this restores that order.
"""

from __future__ import annotations


def merge_by_position(plain: list, detailed: list, positions: list[int], what: str) -> list:
    """detailed[i] at positions[i], the plain entries in the gaps, in their order. Raises ValueError
    naming `what` unless the positions are increasing and inside the merged list."""
    total = len(plain) + len(detailed)
    if len(positions) != len(detailed) or positions != sorted(set(positions)) or (positions and positions[-1] >= total):
        raise ValueError(f"malformed {what}: the output columns do not line up")
    if not detailed:
        return plain
    merged, taken = [], 0
    for position, entry in zip(positions, detailed):
        gap = position - len(merged)  # plain entries before this one
        merged += plain[taken:taken + gap]
        taken += gap
        merged.append(entry)
    merged += plain[taken:]
    return merged
