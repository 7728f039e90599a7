"""How a preempted sequence gives back its blocks: swap them to host memory, or drop them and
recompute later.

The rule for mode None (automatic): swap when the victim's request has other live sequences
(n > 1 siblings share its prompt blocks; recomputing would prefill the prompt once per sibling)
or when recomputing it would take more than one step's token budget; recompute otherwise, since
a short sequence is cheaper to recompute than to copy out and back. Swap needs host blocks for
every block of the victim; without them the victim is recomputed whatever the mode.
"""

from __future__ import annotations

from services.scheduler.sequence import Sequence

PREEMPTION_MODES = (None, "swap", "recompute")


def choose_preemption(mode: str | None, seq: Sequence, num_live_siblings: int, token_budget: int,
                      can_swap: bool) -> str:
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be 'swap', 'recompute' or None (automatic), got {mode!r}")
    if not can_swap or mode == "recompute":
        return "recompute"
    if mode == "swap":
        return "swap"
    expensive = num_live_siblings > 0 or seq.num_computed_tokens > token_budget
    return "swap" if expensive else "recompute"
