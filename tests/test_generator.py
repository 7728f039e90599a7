"""The gateway's generation core without a scheduler: submission is all or nothing."""

from __future__ import annotations

import asyncio
import re

import pytest

from services.gateway import generation
from services.gateway.generation import Generator
from services.gateway.metrics import GatewayMetrics
from shared.sampling_params import SamplingParams


class RecordingStream:
    def __init__(self, request_id: str, cancelled: list[str]):
        self.request_id, self._cancelled = request_id, cancelled

    def cancel(self) -> None:
        self._cancelled.append(self.request_id)

    async def __anext__(self):
        raise StopAsyncIteration  # no output: enough for start(), which waits for the first


class RecordingClient:
    def __init__(self):
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    async def submit(self, request_id, prompt, params):
        self.submitted.append(request_id)
        return RecordingStream(request_id, self.cancelled)


class AnyPrompt:
    tokenizer = None

    def check_prompt(self, prompt, params) -> None:
        pass


def test_a_run_that_fails_to_start_aborts_every_submitted_request(monkeypatch):
    """The second prompt's run fails after its request went to the scheduler: both are aborted."""
    built = []

    def detokenizer(*args, **kwargs):
        built.append(1)
        if len(built) > 1:
            raise RuntimeError("the tokenizer refused")
        return object()

    monkeypatch.setattr(generation, "IncrementalDetokenizer", detokenizer)
    client = RecordingClient()
    gen = Generator(client, GatewayMetrics())
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(gen.start(AnyPrompt(), "req-1", [[1, 2], [3, 4], [5]], SamplingParams(max_tokens=4)))
    first, second = client.submitted
    assert re.fullmatch(r"req-1-[0-9a-f]{8}-0", first) and second == first[:-1] + "1"
    assert sorted(client.cancelled) == client.submitted


def test_a_client_request_id_that_repeats_gives_distinct_engine_ids(monkeypatch):
    monkeypatch.setattr(generation, "IncrementalDetokenizer", lambda *args, **kwargs: object())
    client = RecordingClient()
    gen = Generator(client, GatewayMetrics())
    for _ in range(2):  # X-Request-Id is a tracing header: a retry or a proxy may send it again
        asyncio.run(gen.start(AnyPrompt(), "same", [[1, 2]], SamplingParams(max_tokens=4)))
    assert len(set(client.submitted)) == 2 and all(i.startswith("same-") for i in client.submitted)
