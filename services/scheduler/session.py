"""A gateway's Session stream, scheduler side: the events of its requests, one batch per step.

The engine loop puts one SessionBatch per step (and admission refusals as they happen); the
servicer thread of the stream takes them out and sends them, merging any that queued up while it
was sending, so a slow reader still gets one message per turn rather than falling further behind.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass, field

import grpc

from services.scheduler.sequence import SequenceUpdate
from shared.grpc_errors import status_for
from shared.proto import pagedserve_internal_pb2 as wire

_END = object()


# A slow reader gets queued batches merged into one message, up to this many: a message must stay
# far below the gateway's receive limit, and one oversized message would fail the whole session.
MAX_MERGED_BATCHES = 16


@dataclass
class RequestError:
    """A request the engine refused at admission (it never started)."""
    key: int  # the request's session key
    code: grpc.StatusCode
    message: str

    def to_proto(self) -> wire.RequestError:
        return wire.RequestError(key=self.key, code=self.code.value[0], message=self.message)


@dataclass
class SessionBatch:
    outputs: list[tuple[int, SequenceUpdate]] = field(default_factory=list)  # (key, new output), in step order
    finished: list[int] = field(default_factory=list)  # keys that ended (finished or aborted)
    errors: list[RequestError] = field(default_factory=list)
    # The prefix caches' routing keys (cache_digest.py): with cache_snapshot, every one held; else the changes.
    cache_snapshot: bool = False
    cache_added: list[int] = field(default_factory=list)
    cache_removed: list[int] = field(default_factory=list)

    def merge(self, other: SessionBatch) -> None:
        self.outputs += other.outputs
        self.finished += other.finished
        self.errors += other.errors
        if other.cache_snapshot:  # it supersedes whatever came before it
            self.cache_snapshot, self.cache_added, self.cache_removed = True, [], []
        self.cache_added += other.cache_added
        self.cache_removed += other.cache_removed

    def to_proto(self) -> wire.SessionEvents:
        """Outputs that are only new tokens go in the token columns, the others whole, in their places."""
        m = wire.SessionEvents(finished=self.finished, errors=[e.to_proto() for e in self.errors],
                               cache_snapshot=self.cache_snapshot, cache_added=self.cache_added,
                               cache_removed=self.cache_removed)
        keys, seq_indexes, num_tokens, token_ids = [], [], [], []
        for position, (key, update) in enumerate(self.outputs):
            if update.is_plain:
                keys.append(key)
                seq_indexes.append(update.seq_index)
                num_tokens.append(len(update.new_token_ids))
                token_ids += update.new_token_ids
            else:
                m.detailed.append(update_to_proto(key, update))
                m.detailed_positions.append(position)
        m.tokens.keys.extend(keys)
        m.tokens.seq_indexes.extend(seq_indexes)
        m.tokens.num_tokens.extend(num_tokens)
        m.tokens.token_ids.extend(token_ids)
        return m


def update_to_proto(key: int, update: SequenceUpdate) -> wire.EngineOutput:
    out = wire.EngineOutput(key=key, seq_index=update.seq_index,
                            new_token_ids=update.new_token_ids,
                            new_logprobs=[p.to_proto() for p in update.new_logprobs],
                            prompt_logprobs=[p.to_proto() for p in update.prompt_logprobs],
                            finish_reason=update.finish_reason or "",
                            num_cached_tokens=update.num_cached_tokens, embedding=update.embedding)
    if isinstance(update.stop_reason, int):
        out.stop_token_id = update.stop_reason
    elif isinstance(update.stop_reason, str):
        out.stop_string = update.stop_reason
    return out


class Session:
    """One gateway stream: filled by the engine loop thread, drained by the stream's servicer thread."""

    def __init__(self, peer: str = ""):
        self.peer = peer
        self.requests: dict[int, str] = {}  # key -> request id, in flight; touched by the engine loop thread only
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def refuse(self, key: int, exc: BaseException) -> None:
        """The request with this key never started: it gets the status of exc."""
        self.put(SessionBatch(errors=[RequestError(key, status_for(exc), str(exc))]))

    def put(self, batch: SessionBatch) -> None:
        self._queue.put(batch)

    def fail(self, error: Exception) -> None:
        """End the stream with an error (the engine failed)."""
        self._queue.put(error)

    def end(self) -> None:
        self._queue.put(_END)

    def __iter__(self):
        while True:
            item = self._queue.get()
            merged = 1
            while isinstance(item, SessionBatch) and merged < MAX_MERGED_BATCHES:  # merge what queued up
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(following, SessionBatch):
                    yield item
                    item = following
                    break
                item.merge(following)
                merged += 1
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
