"""Whether a sequence's newest token ends it, and how (vLLM's check_stop).

In order: EOS (unless ignore_eos) and the request's stop token ids, both only once min_tokens
tokens are out; then max_tokens and the context length. Stop strings are matched on the text, by
the front ends, which end the sequence through Scheduler.finish_by_stop_string.
"""

from __future__ import annotations

from typing import NamedTuple

from services.scheduler.sequence import Sequence, SequenceStatus


class Stop(NamedTuple):
    status: SequenceStatus
    reason: int | None  # the stop token id that ended the sequence (None for EOS and the length limits)


STOPPED_BY_EOS = Stop(SequenceStatus.FINISHED_STOPPED, None)
STOPPED_BY_LENGTH = Stop(SequenceStatus.FINISHED_LENGTH, None)


def stop_for(seq: Sequence, token_id: int, eos_token_ids: frozenset[int], max_model_len: int) -> Stop | None:
    """How ``token_id``, just appended to the sequence, ends it; None if it goes on."""
    num_out = len(seq.output_token_ids)
    params = seq.params
    if num_out >= params.min_tokens:
        if token_id in eos_token_ids and not params.ignore_eos:
            return STOPPED_BY_EOS
        if token_id in params.stop_token_ids:
            return Stop(SequenceStatus.FINISHED_STOPPED, token_id)
    if num_out >= seq.max_output_tokens or seq.num_tokens >= max_model_len:
        return STOPPED_BY_LENGTH
    return None
