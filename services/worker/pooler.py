"""A pooling model's embeddings: a sequence's final-normed hidden states pooled into one vector.

A prompt may be computed over several steps (chunked prefill), so the pooler keeps, per sequence, what
its chunks so far leave to pool: nothing for "last" (its last chunk's last state is the embedding), the
running float32 sum for "mean", the first state for "cls". The scheduler computes "mean" and "cls"
prompts from their start (no prefix-cache hit), and a sequence preempted by recompute comes back new, so
the state always covers every token before the step's. Embeddings are pooled in float32, cut to a
request's ``dimensions``, then normalized (as sentence-transformers cuts matryoshka embeddings). A
classifier's pooled states go through its score head in one batch on the device; each request's logits
then through the activation (or not: ``use_activation`` false).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.pooling import PoolerConfig, PoolingParams


_ACTIVATIONS = {"sigmoid": torch.sigmoid, "softmax": lambda logits: torch.softmax(logits, dim=0),
                "identity": lambda logits: logits}


class PoolingState:
    """One sequence's pooling so far."""

    __slots__ = ("total", "count", "first")

    def __init__(self):
        self.total: torch.Tensor | None = None  # mean: the float32 sum of the states pooled so far [hidden]
        self.count = 0  # mean: how many
        self.first: torch.Tensor | None = None  # cls: the first token's state [hidden]


class Pooler:
    def __init__(self, config: PoolerConfig):
        self.config = config

    def add_chunk(self, state: PoolingState, rows: torch.Tensor, first_position: int) -> None:
        """Take one step's states of a sequence: ``rows [n, hidden]`` for its tokens from ``first_position`` on."""
        kind = self.config.pooling_type
        if kind == "mean":
            chunk = rows.float().sum(dim=0)
            state.total = chunk if state.total is None else state.total + chunk
            state.count += rows.shape[0]
        elif kind == "cls" and first_position == 0:
            state.first = rows[0].float().clone()  # not a view: it would keep the step's states alive

    def pooled(self, state: PoolingState, last_row: torch.Tensor) -> torch.Tensor:
        """The finished sequence's pooled state (float32 [hidden], on the device), after add_chunk took its
        last chunk; ``last_row``: the state of its last token."""
        kind = self.config.pooling_type
        if kind == "mean":
            return state.total / state.count
        if kind == "cls":
            if state.first is None:
                raise ValueError("cls pooling without the first token's state: the prompt was not computed from "
                                 "its start")
            return state.first
        return last_row.float()

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A pooled vector as the request asked: cut to its dimensions, then normalized (or not); a
        classifier's logits through its activation, unless the request turns it off."""
        if self.config.classifies:
            return vector if params.use_activation is False else _ACTIVATIONS[self.config.activation](vector)
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return F.normalize(vector, dim=0) if normalize else vector
