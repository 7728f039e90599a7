"""A pooling request's result: its sequence computes the prompt and ends with one update, which
carries the embedding (or a classifier's class scores) instead of tokens."""

from __future__ import annotations

from services.scheduler.sequence import Sequence, SequenceUpdate


def embedding_update(seq: Sequence, embedding: list[float]) -> SequenceUpdate:
    """The update that ends the sequence with its embedding; ValueError when the sequence is not an
    embedding request's (a worker out of step with its plans)."""
    if seq.request.pooling is None:
        raise ValueError(f"the worker sent an embedding for sequence {seq.seq_id}, which is no embedding request")
    update = SequenceUpdate(seq)
    update.embedding, update.finish_reason = embedding, "stop"
    return update
