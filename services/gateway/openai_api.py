"""/v1/completions and /v1/chat/completions: requests through the generation core, answers in
OpenAI's shapes (whole responses, or stream chunks for SSE).

Choice k of a completions request with several prompts is prompt k // n, sequence k % n.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

from services.gateway.api_keys import ApiKey
from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from services.gateway.logprob_format import chat_logprobs, completion_logprobs
from services.gateway.merge import merge
from services.gateway.model import Model
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, template_messages
from services.gateway.run import Run
from services.gateway.tool_calls import tool_call
from services.gateway.tool_parsers import ToolCallStream
from shared.detokenizer import IncrementalDetokenizer
from shared.invalid_parameter import InvalidParameter
from shared.sampling_params import SamplingParams


async def create_completion(gen: Generator, body: CompletionRequest, request_id: str, api_key: ApiKey | None = None):
    return await _answer(gen, body, request_id, api_key, _Completion)


async def create_chat_completion(gen: Generator, body: ChatCompletionRequest, request_id: str,
                                 api_key: ApiKey | None = None):
    return await _answer(gen, body, request_id, api_key, _Chat)


async def _answer(gen: Generator, body, request_id: str, api_key: ApiKey | None, reply_class):
    """The whole answer (a dict), or for stream=True the started reply (events(), then aclose())."""
    async with AsyncExitStack() as stack:
        admission = await stack.enter_async_context(gen.admitted(api_key))
        model = await gen.model()
        lora = model.resolve(body.model)
        try:
            # (Off the event loop too: checking a structured output's grammar can take long.)
            params = await asyncio.to_thread(reply_class.checked_params, model, body)
            # Off the event loop: a megabyte prompt takes seconds to tokenize (or render and tokenize),
            # and every other stream would wait that long (the tokenizer lets go of the GIL).
            prompts, texts = await asyncio.to_thread(reply_class.prompts, model, body)
            runs = await gen.start(model, engine_requests(request_id, prompts, params=params,
                                                          cache_salt=body.cache_salt, lora=lora), admission=admission)
        except InvalidParameter as exc:
            raise body.public_error(exc) from None
        reply = reply_class(model, body, reply_class.response_id(request_id), runs, texts)
        if not body.stream:
            return await reply.whole()
        reply.slot = stack.pop_all()  # the stream holds the request's slot until reply.aclose()
        return reply


_JSON = json.JSONEncoder(ensure_ascii=False)  # stateless; json.dumps with options makes one per call
_json_string = json.encoder.encode_basestring  # what _JSON writes for a str (non-ASCII kept as is)


def _json_scalar(value: str | int | None) -> str:
    """A finish or stop reason as _JSON writes it."""
    if value is None:
        return "null"
    return _json_string(value) if isinstance(value, str) else str(int(value))


def usage(runs: list[Run]) -> dict:
    prompt = sum(len(run.prompt) for run in runs)
    completion = sum(run.completion_tokens for run in runs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)}}


class _Reply:
    """A request's answer: whole(), or events() for streaming followed by aclose()."""
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
        return _JSON.encode(error)

    def __init__(self, model: Model, body, response_id: str, runs: list[Run], prompt_texts: list[str]):
        self.model, self.body, self.id, self.runs, self.prompt_texts = model, body, response_id, runs, prompt_texts
        # The name the client asked for: the model's, or the adapter's it runs with.
        self.model_name = runs[0].request.lora.name if runs and runs[0].request.lora is not None else model.name
        self.n = body.n
        self.created = int(time.time())
        self.slot = AsyncExitStack()
        # Every stream chunk shares these fields: their JSON is made once, and each chunk only
        # serializes its choices (the gateway writes one chunk per token per stream).
        self._json = _JSON.encode
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
        return body.checked_params()


def _echoed_text(model: Model, token_ids: list[int]) -> str:
    """The text of a prompt given as token ids, only needed to echo it; checked first, since the
    tokenizer fails on an id outside the vocabulary (a 500) before the scheduler's checks run."""
    model.check_token_ids(token_ids)
    return model.decode(token_ids)


class _Completion(_Reply):
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args):
        super().__init__(*args)
        self.echoed: set[int] = set()
        self._ids_sent: set[int] = set()  # the choices whose prompt_token_ids a chunk carried (return_token_ids)

    @staticmethod
    def prompts(model: Model, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """The prompts' token ids (truncate_prompt_tokens applied) and the texts an echo shows: as given,
        unless truncation cut them (then the tokens kept, decoded)."""
        ids, texts = [], []
        for prompt in body.prompts():
            given = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
            kept = body.truncated(given, model.max_model_len)
            ids.append(kept)
            if not body.echo:
                texts.append(prompt if isinstance(prompt, str) else "")
            else:
                texts.append(prompt if isinstance(prompt, str) and kept is given else _echoed_text(model, kept))
        return ids, texts

    def deltas(self) -> AsyncIterator[SeqDelta]:
        return _nothing_generated(merge(self.runs)) if self.body.echo_only else merge(self.runs)

    def usage(self) -> dict:
        counts = usage(self.runs)
        if self.body.echo_only:  # the token the engine sampled is not part of the answer
            counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
        return counts

    def _prefix(self, k: int, position: int) -> tuple[str, list[TokenLogprob]]:
        """The echoed prompt (text and its token logprobs), once per choice."""
        if not self.body.echo or k in self.echoed:
            return "", []
        self.echoed.add(k)
        return self.prompt_texts[position], self._prompt_entries(self.runs[position])

    def _prompt_entries(self, run: Run) -> list[TokenLogprob]:
        got = run.prompt_logprobs or []
        # Offsets into the prompt's text as it decodes, not sums of single-token strings: a token
        # holding part of a character decodes alone to U+FFFD, and special tokens to their names.
        text = IncrementalDetokenizer(self.model.tokenizer, [])
        entries = []
        for i, token_id in enumerate(run.prompt):
            entry = got[i] if i < len(got) and got[i] is not None else \
                TokenLogprob(token_id, self.model.token_string(token_id), None, 0, [])
            entries.append(TokenLogprob(entry.token_id, entry.token, entry.logprob, entry.rank,
                                        entry.top[:self.body.logprobs or 0], len(text.text)))
            text.append([token_id])
        return entries

    def _logprobs(self, position: int, prompt_entries: list[TokenLogprob], entries: list[TokenLogprob]) -> dict | None:
        if self.body.logprobs is None:
            return None
        base = len(self.prompt_texts[position]) if self.body.echo else 0
        head = completion_logprobs(prompt_entries, 0, self.as_ids)
        tail = completion_logprobs(entries, base, self.as_ids)
        return {key: head[key] + tail[key] for key in tail}

    def chunk_event(self, k: int, position: int, delta: SeqDelta) -> str | None:
        if self.body.logprobs is not None or self.token_ids or (self.body.echo and k not in self.echoed):
            return super().chunk_event(k, position, delta)
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None
        # The chunk of nearly every token, written out directly: the same JSON that chunk_choice's
        # dict gives through the encoder (a test holds them equal), at a fraction of the cost.
        return (f'{self._chunk_head}[{{"index": {k}, "text": {_json_string(delta.text)}, "finish_reason": '
                f'{_json_scalar(delta.finish_reason)}, "stop_reason": {_json_scalar(delta.stop_reason)}, '
                f'"logprobs": null}}]{self.chunk_tail()}')

    def chunk_choice(self, k: int, position: int, delta: SeqDelta) -> dict | None:
        prefix, prompt_entries = self._prefix(k, position)
        if not (prefix or delta.text or delta.token_ids or delta.finish_reason):
            return None
        choice = {"index": k, "text": prefix + delta.text, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason, "logprobs": self._logprobs(position, prompt_entries,
                                                                               delta.logprobs or [])}
        if self.token_ids:  # as vLLM's: each chunk's new tokens, and a choice's first chunk its prompt's
            choice["token_ids"] = delta.token_ids
            if k not in self._ids_sent:
                self._ids_sent.add(k)
                choice["prompt_token_ids"] = self.runs[position].prompt
        return choice

    def whole_choice(self, k, position, text, logprobs, end) -> dict:
        prefix, prompt_entries = self._prefix(k, position)
        asked = self.body.prompt_logprobs
        return {"index": k, "text": prefix + text, "finish_reason": end and end.finish_reason,
                "stop_reason": end and end.stop_reason, "logprobs": self._logprobs(position, prompt_entries, logprobs),
                "prompt_logprobs": None if asked is None else vllm_prompt_logprobs(self.runs[position], asked),
                "prompt_token_ids": self.runs[position].prompt if self.token_ids else None}


async def _nothing_generated(deltas: AsyncIterator[SeqDelta]) -> AsyncIterator[SeqDelta]:
    """Each sequence's end, without what it generated (echo with max_tokens=0)."""
    async for delta in deltas:
        if delta.finish_reason is not None:
            yield SeqDelta(delta.index, [], "", [], "length", None, delta.position)


def vllm_prompt_logprobs(run: Run, num_top: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (null for the first, which nothing comes before) a
    map from token id to {logprob, rank, decoded_token}, the prompt's own token first, then the top ones."""
    entries = run.prompt_logprobs or []
    out: list[dict | None] = []
    for i in range(len(run.prompt)):
        entry = entries[i] if i < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        position = {str(entry.token_id): {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token}}
        for rank, top in enumerate(entry.top[:num_top], 1):
            position.setdefault(str(top.token_id), {"logprob": top.logprob, "rank": rank, "decoded_token": top.token})
        out.append(position)
    return out


class _Chat(_Reply):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    @staticmethod
    def prompts(model: Model, body: ChatCompletionRequest) -> tuple[list[list[int]], list[str]]:
        text, ids = model.encode_chat(template_messages(body.messages),
                                      add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message,
                                      template_kwargs=body.chat_template_kwargs,
                                      tools=body.tools or None, chat_template=body.chat_template)
        return [body.truncated(ids, model.max_model_len)], [text]

    @staticmethod
    def checked_params(model: Model, body: ChatCompletionRequest) -> SamplingParams:
        params = _Reply.checked_params(model, body)
        body.check_tool_parser(model.tool_parser)
        return params

    def __init__(self, *args):
        super().__init__(*args)
        self.forced = self.body.forced_tool_call
        self._call_ids: dict[int, str] = {}  # a named call's id, per choice, from its first delta on
        self._held: dict[int, str] = defaultdict(str)  # "required": each choice's text, until it ends
        # tool_choice "auto": each choice's text through the model's tool-call parser, and its calls so far
        self._auto = self.model.tool_parser if self.body.auto_tool_choice else None
        self._streams: dict[int, ToolCallStream] = defaultdict(self._auto.stream) if self._auto else {}
        self._calls_made: dict[int, int] = defaultdict(int)
        self._max_calls = 1 if self.body.parallel_tool_calls is False else None  # as OpenAI's: the first call only
        # --reasoning-parser: each choice's thinking apart from its answer (a forced call's output is the call).
        self._reasoning = self.model.reasoning_parser if self.forced is None else None
        self._constrained = self._reasoning is not None and self.body.structured_outputs_asked() is not None
        self._thinking = defaultdict(self.reasoning_stream) if self._reasoning else {}
        self._counters = defaultdict(self.reasoning_stream) if self._reasoning else {}  # which tokens are thinking
        self._reasoning_tokens: dict[int, int] = defaultdict(int)
        # No parser between the text and the answer: every delta carries its content ("" while held back).
        self._plain = self.forced is None and self._auto is None and self._reasoning is None

    def opening_events(self) -> list[str]:
        # OpenAI's first delta of each choice carries the role; with return_token_ids, its chunk the prompt's
        # token ids (vLLM's). With echo, each choice's next chunk the text it continues (vLLM's).
        role, prompt = self.body.response_role, {"prompt_token_ids": self.runs[0].prompt} if self.token_ids else {}
        events = [self.chunk_json([_chunk_choice(i, {"role": role, "content": ""})], **prompt) for i in range(self.n)]
        if echoed := self.body.echoed_text:
            events += [self.chunk_json([_chunk_choice(i, {"content": echoed})]) for i in range(self.n)]
        return events

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.body.logprobs:
            return None
        return chat_logprobs(entries, self.body.top_logprobs or 0, self.as_ids)

    def chunk_choice(self, k: int, position: int, delta: SeqDelta) -> dict | None:
        if not (delta.text or delta.token_ids or delta.finish_reason):
            return None
        reasoning = ""
        if self._reasoning is not None:  # the answer's part of the text goes on to the tool-call parser
            reasoning, text = self._split_delta(k, delta)
            delta = dataclasses.replace(delta, text=text)
        message, finish = {"content": delta.text} if delta.text or self._plain else {}, delta.finish_reason
        if self.forced is not None:
            message, finish = self._tool_call_delta(k, delta)
        elif self._auto is not None:
            message, finish = self._auto_delta(k, delta)
        if reasoning and self.body.include_reasoning:
            message = {"reasoning": reasoning, "reasoning_content": reasoning, **message}  # vLLM's two names
        ids = {"token_ids": delta.token_ids} if self.token_ids else {}
        if not (message or finish or delta.logprobs or ids.get("token_ids")):
            return None  # all held back (a possible call or tag), or reasoning left out
        return {"index": k, "delta": message, "logprobs": self._logprobs(delta.logprobs or []),
                "finish_reason": finish, "stop_reason": delta.stop_reason, **ids}

    def deltas(self) -> AsyncIterator[SeqDelta]:
        return self._counting_reasoning(super().deltas()) if self._reasoning is not None else super().deltas()

    async def _counting_reasoning(self, deltas: AsyncIterator[SeqDelta]) -> AsyncIterator[SeqDelta]:
        """The deltas as they come, counting each choice's tokens that come before its thinking ended."""
        async for delta in deltas:
            k = delta.position * self.n + delta.index
            stream = self._counters[k]
            reasoning, content = stream.feed(delta.text)
            if not content and (reasoning or stream.state != "content"):
                self._reasoning_tokens[k] += len(delta.token_ids)
            yield delta

    def reasoning_tokens(self) -> int:
        return sum(self._reasoning_tokens.values())

    def usage(self) -> dict:
        counts = super().usage()
        if self._reasoning is not None:  # OpenAI's place for them
            counts["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens()}
        return counts

    def reasoning_stream(self):
        """A choice's splitter of reasoning from content (--reasoning-parser)."""
        return self._reasoning.stream(self.prompt_texts[0] if self.prompt_texts else "", self._constrained)

    def _split_delta(self, k: int, delta: SeqDelta) -> tuple[str, str]:
        """(reasoning, content) of one delta's text; the choice's last delta gives out what was held."""
        stream = self._thinking[k]
        reasoning, content = stream.feed(delta.text)
        if delta.finish_reason is not None:
            last_reasoning, last_content = stream.finish()
            reasoning, content = reasoning + last_reasoning, content + last_content
        return reasoning, content

    def _tool_call_delta(self, k: int, delta: SeqDelta) -> tuple[dict, str | None]:
        """A named call streams its arguments as they come; "required" calls come whole at the end
        (which of them a partial array holds is not known before)."""
        if self.forced.named is not None:
            call = {"index": 0, "function": {"arguments": delta.text}}
            if k not in self._call_ids:
                first = tool_call(self.forced.named, delta.text)
                self._call_ids[k] = first["id"]
                call = {"index": 0, **first}
            message = {"tool_calls": [call]} if delta.text or len(call) > 2 else {}
            return message, self.forced.finish_reason(delta.finish_reason)
        self._held[k] += delta.text
        if delta.finish_reason is None:
            return {}, None
        calls = self.forced.calls(self._held[k])
        if calls is None:  # cut off (max_tokens): what came, as text
            return {"content": self._held[k]}, delta.finish_reason
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, \
            self.forced.finish_reason(delta.finish_reason)

    def _auto_delta(self, k: int, delta: SeqDelta) -> tuple[dict, str | None]:
        """The content the parser is sure of and each call it completes, whole (with its id and name)."""
        stream = self._streams[k]
        piece = stream.feed(delta.text)
        if delta.finish_reason is not None:
            piece.extend(stream.finish())
        message = {"content": piece.content} if piece.content else {}
        calls = piece.calls if self._max_calls is None else piece.calls[:max(0, self._max_calls - self._calls_made[k])]
        if calls:
            first = self._calls_made[k]
            self._calls_made[k] += len(calls)
            message["tool_calls"] = [{"index": first + i, **tool_call(c.name, c.arguments)}
                                     for i, c in enumerate(calls)]
        return message, _auto_finish(delta.finish_reason, self._calls_made[k] > 0)

    def whole_fields(self) -> dict:
        asked = self.body.prompt_logprobs  # vLLM's place for them in a chat answer
        return {"prompt_logprobs": None if asked is None else vllm_prompt_logprobs(self.runs[0], asked),
                "prompt_token_ids": self.runs[0].prompt if self.token_ids else None}

    def whole_choice(self, k, position, text, logprobs, end) -> dict:
        reasoning = None
        if self._reasoning is not None:
            reasoning, content = self._reasoning.split(text, self.prompt_texts[0] if self.prompt_texts else "",
                                                       self._constrained)
            text = content if content is not None else ("" if reasoning is None else None)  # all reasoning: null
        message, finish = _message(self.body.response_role, text), end and end.finish_reason
        calls = self.forced.calls(text) if self.forced is not None else None
        if calls is not None:
            message, finish = _message(message["role"], None, tool_calls=calls), self.forced.finish_reason(finish)
        elif self._auto is not None and text:
            parsed = self._auto.stream().parse(text)
            if parsed.calls:
                message = _message(message["role"], parsed.content or None,
                                   tool_calls=[tool_call(c.name, c.arguments) for c in parsed.calls[:self._max_calls]])
                finish = _auto_finish(finish, True)
        if self.model.reasoning_parser is not None:  # (a forced call's answer too: it has none)
            shown = reasoning if self.body.include_reasoning else None
            message.update(reasoning=shown, reasoning_content=shown)  # vLLM's two names for it
        if echoed := self.body.echoed_text:  # vLLM's echo: the continued message's text, then the answer's
            message["content"] = echoed + (message["content"] or "")
        return {"index": k, "message": message, "logprobs": self._logprobs(logprobs), "finish_reason": finish,
                "stop_reason": end and end.stop_reason}


def _message(role: str, content: str | None, **fields) -> dict:
    """A whole answer's message with every field vLLM's has (null where unused; tool_calls only when made)."""
    return {"role": role, "content": content, "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "reasoning": None, **fields}


def _chunk_choice(i: int, delta: dict) -> dict:
    return {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}


def _auto_finish(reason: str | None, called: bool) -> str | None:
    """As OpenAI's: an answer that ends in calls ends as "tool_calls"."""
    return "tool_calls" if called and reason == "stop" else reason

