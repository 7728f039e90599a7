"""The gateway's generation core without a scheduler: submission is all or nothing."""

from __future__ import annotations

import asyncio

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
    assert client.submitted == ["req-1-0", "req-1-1"]
    assert sorted(client.cancelled) == ["req-1-0", "req-1-1"]
