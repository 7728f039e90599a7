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
from shared.proto import pagedserve_internal_pb2 as wire

_END = object()


@dataclass
class RequestError:
    """A request the engine refused at admission (it never started)."""
    request_id: str
    code: grpc.StatusCode
    message: str

    def to_proto(self) -> wire.RequestError:
        return wire.RequestError(request_id=self.request_id, code=self.code.value[0], message=self.message)


@dataclass
class SessionBatch:
    outputs: list[SequenceUpdate] = field(default_factory=list)  # new output per sequence, in step order
    finished_request_ids: list[str] = field(default_factory=list)  # ended (finished or aborted)
    errors: list[RequestError] = field(default_factory=list)

    def merge(self, other: SessionBatch) -> None:
        self.outputs += other.outputs
        self.finished_request_ids += other.finished_request_ids
        self.errors += other.errors

    def to_proto(self) -> wire.SessionEvents:
        return wire.SessionEvents(outputs=[update_to_proto(u) for u in self.outputs],
                                  finished_request_ids=self.finished_request_ids,
                                  errors=[e.to_proto() for e in self.errors])


def update_to_proto(update: SequenceUpdate) -> wire.EngineOutput:
    out = wire.EngineOutput(request_id=update.request_id, seq_index=update.seq_index,
                            new_token_ids=update.new_token_ids,
                            new_logprobs=[p.to_proto() for p in update.new_logprobs],
                            prompt_logprobs=[p.to_proto() for p in update.prompt_logprobs],
                            finish_reason=update.finish_reason or "")
    if isinstance(update.stop_reason, int):
        out.stop_token_id = update.stop_reason
    elif isinstance(update.stop_reason, str):
        out.stop_string = update.stop_reason
    return out


class Session:
    """One gateway stream: filled by the engine loop thread, drained by the stream's servicer thread."""

    def __init__(self, peer: str = ""):
        self.peer = peer
        self.request_ids: set[str] = set()  # requests in flight; touched by the engine loop thread only
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

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
            while isinstance(item, SessionBatch):  # merge what queued up behind it
                try:
                    following = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(following, SessionBatch):
                    yield item
                    item = following
                    break
                item.merge(following)
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item
