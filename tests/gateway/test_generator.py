"""The gateway's generation core without a scheduler: submission is all or nothing."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import types

import pytest

from services.gateway import sequence
from services.gateway.billing import Admission
from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
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

    async def submit(self, request):
        self.submitted.append(request.request_id)
        return RecordingStream(request.request_id, self.cancelled)


class AnyPrompt:
    tokenizer = None
    max_model_len = 512

    def checked(self, request):
        return request


def test_a_run_that_fails_to_start_aborts_every_submitted_request(monkeypatch):
    """The second prompt's run fails after its request went to the scheduler: both are aborted."""
    built = []

    def detokenizer(*args, **kwargs):
        built.append(1)
        if len(built) > 1:
            raise RuntimeError("the tokenizer refused")
        return object()

    monkeypatch.setattr(sequence, "IncrementalDetokenizer", detokenizer)
    client = RecordingClient()
    gen = Generator(client, GatewayMetrics())
    with pytest.raises(RuntimeError, match="refused"):
        asyncio.run(gen.start(AnyPrompt(), engine_requests("req-1", [[1, 2], [3, 4], [5]],
                                                           params=SamplingParams(max_tokens=4))))
    first, second = client.submitted
    assert re.fullmatch(r"req-1-[0-9a-f]{8}-0", first) and second == first[:-1] + "1"
    assert sorted(client.cancelled) == client.submitted


def test_a_client_request_id_that_repeats_gives_distinct_engine_ids(monkeypatch):
    monkeypatch.setattr(sequence, "IncrementalDetokenizer", lambda *args, **kwargs: object())
    client = RecordingClient()
    gen = Generator(client, GatewayMetrics())
    for _ in range(2):  # X-Request-Id is a tracing header: a retry or a proxy may send it again
        asyncio.run(gen.start(AnyPrompt(), engine_requests("same", [[1, 2]], params=SamplingParams(max_tokens=4))))
    assert len(set(client.submitted)) == 2 and all(i.startswith("same-") for i in client.submitted)


# --- tokenization runs off the event loop --------------------------------------------------------


class ThreadRecordingTokenizer:
    """Records the thread that tokenizes or renders: a megabyte prompt takes seconds."""
    chat_template = "{{ messages }}"

    def __init__(self):
        self.threads: list[int] = []

    def __call__(self, text, add_special_tokens=True):
        self.threads.append(threading.get_ident())
        return types.SimpleNamespace(input_ids=[1, 2, 3])

    def apply_chat_template(self, messages, **kwargs):
        self.threads.append(threading.get_ident())
        return "rendered"


class Submitted(Exception):
    pass


class RefusingGen:
    """Enough of a Generator for a request to reach start(), which stops it."""
    tracing = None
    tokenized = Generator.tokenized  # the real way off the event loop

    def __init__(self, tokenizer):
        self.model_card = Model("m", 512, 512, 20, tokenizer)

    def admitted(self, api_key=None):
        return contextlib.nullcontext(Admission())

    async def model(self):
        return self.model_card

    async def start(self, *args, **kwargs):
        raise Submitted


def test_prompts_are_tokenized_off_the_event_loop():
    from services.gateway.grpc_api import GenerationServicer
    from services.gateway.openai_api import create_chat_completion, create_completion
    from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
    from shared.proto import pagedserve_api_pb2 as api

    class Context:
        async def abort(self, code, details):
            raise Submitted(details)

    async def main():
        tokenizer = ThreadRecordingTokenizer()
        gen = RefusingGen(tokenizer)
        with pytest.raises(Submitted):
            await create_completion(gen, CompletionRequest(prompt=["a", "b"], max_tokens=2), "r1")
        with pytest.raises(Submitted):
            await create_chat_completion(gen, ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                                                    max_tokens=2), "r2")
        with pytest.raises(Submitted):
            await GenerationServicer(gen).Generate(api.GenerateRequest(text="hi"), Context())
        return threading.get_ident(), tokenizer.threads

    loop_thread, threads = asyncio.run(main())
    assert len(threads) == 5 and loop_thread not in threads
