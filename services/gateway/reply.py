"""A completions or chat request's answer, whatever its kind: the whole answer's envelope and usage, or its stream
of chunks (each one's shared fields written once), and its end however the client goes (aclose)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.json_text import JSON
from services.gateway.merge import merge
from services.gateway.model import Model
from services.gateway.run import Run
from shared.sampling_params import SamplingParams


def usage(runs: list[Run]) -> dict:
    prompt = sum(len(run.prompt) for run in runs)
    completion = sum(run.completion_tokens for run in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)}}


class Reply:
    """A request's answer: whole(), or events() for streaming followed by aclose(). Its kinds say how a
    choice looks (CompletionReply, ChatReply) and how their prompts are made (prompts, checked_params)."""
    object_whole = object_chunk = id_prefix = ""
    done_frame: bytes | None = b"data: [DONE]\n\n"  # what ends the event stream (OpenAI's chat and completions)

    @classmethod
    def response_id(cls, request_id: str) -> str:
        return f"{cls.id_prefix}-{request_id}"

    def frame(self, event: str) -> bytes:
        """One of events() as a server-sent event."""
        return f"data: {event}\n\n".encode()

    def error_event(self, error: dict) -> str:
        """The event that ends a stream whose generation failed, from the error's OpenAI object."""
        return JSON.encode(error)

    def __init__(self, model: Model, body, response_id: str, runs: list[Run], prompt_texts: list[str]):
        self.model, self.body, self.id, self.runs, self.prompt_texts = model, body, response_id, runs, prompt_texts
        # The name the client asked for: the model's, or the adapter's it runs with.
        self.model_name = runs[0].request.lora.name if runs and runs[0].request.lora is not None else model.name
        self.n = body.n
        self.created = int(time.time())
        self.slot = AsyncExitStack()
        # Every stream chunk shares these fields: their JSON is made once, and each chunk only
        # serializes its choices (the gateway writes one chunk per token per stream).
        self._json = JSON.encode
        self._chunk_head = self._json(self.envelope(self.object_chunk, []))[:-len('[]}')]
        # With stream_options.include_usage, OpenAI's chunks carry "usage": null until the last one
        # (with vLLM's continuous_usage_stats too, the usage so far).
        self._chunk_tail = ', "usage": null}' if body.include_usage else "}"
        self.continuous_usage = body.continuous_usage
        # vLLM's: logprobs name tokens by id (the request says, else the gateway's flag), and answers carry the
        # prompt's and the choices' token ids.
        self.as_ids = model.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None \
            else body.return_tokens_as_token_ids
        self.token_ids = bool(body.return_token_ids)

    def envelope(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name,
                "choices": choices, **extra}

    def chunk_json(self, choices: list[dict], usage: dict | None = None, **fields) -> str:
        """One stream chunk as JSON: the envelope, these choices, other top-level ``fields`` and, on the last one,
        usage."""
        more = "".join(f', "{name}": {self._json(value)}' for name, value in fields.items())
        return self._chunk_head + self._json(choices) + more + self.chunk_tail(usage)

    def chunk_tail(self, usage: dict | None = None) -> str:
        if usage is None and self.continuous_usage:
            usage = self.usage()
        return self._chunk_tail if usage is None else f', "usage": {self._json(usage)}}}'

    def chunk_event(self, k: int, position: int, delta: SeqDelta) -> str | None:
        """One delta's stream chunk as JSON; None when it carries nothing."""
        choice = self.chunk_choice(k, position, delta)
        return None if choice is None else self.chunk_json([choice])

    async def events(self) -> AsyncIterator[str]:
        """The stream's chunks, as JSON text."""
        for event in self.opening_events():
            yield event
        n = self.n
        async for delta in self.deltas():
            event = self.chunk_event(delta.position * n + delta.index, delta.position, delta)
            if event is not None:
                yield event
        if self.body.include_usage:
            yield self.chunk_json([], usage=self.usage())

    async def aclose(self) -> None:
        """Idempotent; also right when events() never started (a client gone before the first byte)."""
        for run in self.runs:
            run.cancel()
            run.record_abandoned()  # (a client gone before the stream began)
        await self.slot.aclose()

    async def whole(self) -> dict:
        texts: dict[int, str] = defaultdict(str)
        logprobs: dict[int, list[TokenLogprob]] = defaultdict(list)
        token_ids: dict[int, list[int]] = defaultdict(list)
        ends: dict[int, SeqDelta] = {}
        async for delta in self.deltas():
            k = delta.position * self.n + delta.index
            texts[k] += delta.text
            logprobs[k] += delta.logprobs or []
            token_ids[k] += delta.token_ids
            if delta.finish_reason:
                ends[k] = delta
        choices = []
        for k in range(len(self.runs) * self.n):
            choice = self.whole_choice(k, k // self.n, texts[k], logprobs[k], ends.get(k))
            choice["token_ids"] = token_ids[k] if self.token_ids else None
            choices.append(choice)
        # vLLM's answers carry all their fields, null where unused.
        return self.envelope(self.object_whole, choices, usage=self.usage(), system_fingerprint=None,
                             service_tier=None, kv_transfer_params=None, **self.whole_fields())

    def whole_fields(self) -> dict:
        """A whole answer's top-level fields of its own kind."""
        return {}

    def deltas(self) -> AsyncIterator[SeqDelta]:
        return merge(self.runs)

    def usage(self) -> dict:
        return usage(self.runs)

    def opening_events(self) -> list[str]:
        """The chunks a stream starts with, before any output."""
        return []

    @staticmethod
    def checked_params(model: Model, body) -> SamplingParams:
        body.check_text()
        body.count_whole_vocabulary(model.vocab_size, model.max_logprobs)
        return body.checked_params(model.generation_defaults)
