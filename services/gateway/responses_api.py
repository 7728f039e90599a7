"""POST /v1/responses: a chat completion's one choice, as OpenAI's Response object or its stream of events.

The answer is made by the chat code (chat_reply.ChatReply: text, logprobs, forced and parsed tool calls);
this turns its message into output items (a message with an output_text part, then a function_call
per call) and its chunks into the typed events a Responses stream is made of, in OpenAI's order:

    response.created, response.in_progress,
    per item: response.output_item.added,
        reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done (--reasoning-parser)
        a message: response.content_part.added, response.output_text.delta..., response.output_text.done,
                   response.content_part.done
        a call:    response.function_call_arguments.delta..., response.function_call_arguments.done
        response.output_item.done,
    response.completed (or response.incomplete: cut at max_output_tokens)

every event numbered by ``sequence_number`` and sent as ``event: <type>`` + ``data: <json>``, with no
``[DONE]`` after the last (OpenAI sends none).
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator

from services.gateway.api_keys import ApiKey
from services.gateway.chat_reply import ChatReply
from services.gateway.generator import Generator
from services.gateway.json_text import json_string
from services.gateway.openai_api import answer
from services.gateway.responses_protocol import ResponsesRequest


async def create_response(gen: Generator, body: ResponsesRequest, request_id: str, api_key: ApiKey | None = None):
    return await answer(gen, body, request_id, api_key, _Response)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response(ChatReply):
    done_frame = None  # a Responses stream ends with response.completed, not [DONE]

    @staticmethod
    def response_id(request_id: str) -> str:
        return f"resp_{request_id}"

    @staticmethod
    def prompts(model, body: ResponsesRequest):
        return ChatReply.prompts(model, body.chat)

    @staticmethod
    def checked_params(model, body: ResponsesRequest):
        body.check_reasoning(model.reasoning_parser)
        return ChatReply.checked_params(model, body.chat)

    def __init__(self, model, body: ResponsesRequest, response_id: str, runs, prompt_texts):
        self.request = body
        super().__init__(model, body.chat, response_id, runs, prompt_texts)

    # --- the Response object ----------------------------------------------------------------------

    def response(self, output: list[dict], status: str, error: dict | None = None) -> dict:
        request = self.request
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.model_name, "output": output, "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": request.reasoning, "store": False, "temperature": request.temperature,
            "top_p": request.top_p, "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "truncation": "disabled",
            "top_logprobs": request.top_logprobs, "metadata": request.metadata or {}, "user": request.user,
            "usage": self.response_usage() if done and error is None else None,
        }

    def response_usage(self) -> dict:
        counts = self.usage()
        return {"input_tokens": counts["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": counts["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens()},
                "total_tokens": counts["total_tokens"]}

    @staticmethod
    def status(finish_reason: str | None) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    async def whole(self) -> dict:
        choice = (await super().whole())["choices"][0]
        message, logprobs = choice["message"], (choice["logprobs"] or {}).get("content")
        calls = message.get("tool_calls") or []
        output = [_reasoning_item(_item_id("rs"), message["reasoning"], "completed")] if message.get("reasoning") \
            else []
        if output and logprobs:  # the thinking's tokens come first: the message's text is what follows them
            logprobs = _last_covering(logprobs, len(message["content"] or ""))
        if not (calls or output) or message["content"]:
            output.append(_message_item(_item_id("msg"), message["content"] or "", logprobs, "completed"))
        output += [_call_item(_item_id("fc"), call, "completed") for call in calls]
        status = self.status(choice["finish_reason"])
        output[-1]["status"] = status  # the item the cut came in (if it was cut), as OpenAI marks it
        return self.response(output, status)

    # --- the stream ---------------------------------------------------------------------------------

    def frame(self, event: str) -> bytes:
        return f"{event}\n\n".encode()

    def error_event(self, error: dict) -> str:
        """An error event, numbered after the events sent, then response.failed with the items so far."""
        stream, body = self._stream, error["error"]
        failed = self.response(stream.items, "failed", {"code": "server_error", "message": body["message"]})
        return (f'{stream.event("error", code=body["code"], message=body["message"], param=body["param"])}\n\n'
                f'{stream.event("response.failed", response=failed)}')

    async def events(self) -> AsyncIterator[str]:
        stream = self._stream = _EventWriter(self)
        yield stream.event("response.created", response=self.response([], "in_progress"))
        yield stream.event("response.in_progress", response=self.response([], "in_progress"))
        finish = None
        async for delta in self.deltas():
            choice = self.chunk_choice(0, 0, delta)
            if choice is None:
                continue
            stream.hold_logprobs((choice["logprobs"] or {}).get("content") or [])
            message = choice["delta"]
            if message.get("reasoning"):
                for event in stream.reasoning(message["reasoning"]):
                    yield event
            if message.get("content"):
                for event in stream.text(message["content"]):
                    yield event
            for call in message.get("tool_calls") or []:
                for event in stream.call(call):
                    yield event
            finish = choice["finish_reason"] or finish
        if not stream.items and stream.open is None:  # nothing came: an empty message, as whole() has
            for event in stream.text(""):
                yield event
        status = self.status(finish)
        for event in stream.close(status):
            yield event
        yield stream.event(f"response.{status}", response=self.response(stream.items, status))


class _EventWriter:
    """A stream's events in order: opens and closes output items around their deltas."""

    def __init__(self, reply: _Response):
        self.numbers = itertools.count()
        self.items: list[dict] = []  # the finished output items
        self.open: dict | None = None  # the item being streamed
        self.logprobs: list[dict] = []  # a delta's logprobs not yet sent with text
        self.with_logprobs = reply.body.logprobs

    def event(self, kind: str, **fields) -> str:
        return _sse(kind, {"type": kind, "sequence_number": next(self.numbers), **fields})

    def hold_logprobs(self, entries: list[dict]) -> None:
        self.logprobs += entries

    def text(self, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self.close()
            self.open = _message_item(_item_id("msg"), "", [] if self.with_logprobs else None, "in_progress")
            self.open["content"] = []  # the part comes with its own event
            events += [self.event("response.output_item.added", output_index=len(self.items), item=self.open),
                       self.part_event("response.content_part.added", _text_part("", None))]
            self.open["text"], self.open["entries"] = "", []
        self.open["text"] += text
        entries, self.logprobs = self.logprobs, []
        self.open["entries"] += entries
        if text:
            events.append(self.part_event("response.output_text.delta", delta=text, logprobs=entries)
                          if self.with_logprobs else self.plain_delta(text))
        return events

    def reasoning(self, text: str) -> list[str]:
        """Thinking: a reasoning item of its own, before the answer's message (its tokens' logprobs are
        not the message's)."""
        events, self.logprobs = [], []
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close()
            self.open = _reasoning_item(_item_id("rs"), "", "in_progress")
            self.open["content"] = []  # the part comes with its own event
            events += [self.event("response.output_item.added", output_index=len(self.items), item=self.open),
                       self.part_event("response.content_part.added", _reasoning_part(""))]
            self.open["text"] = ""
        self.open["text"] += text
        events.append(self.part_event("response.reasoning_text.delta", delta=text))
        return events

    def plain_delta(self, text: str) -> str:
        """The open message's text delta without logprobs (nearly every event of a stream), written out
        directly: the same text that part_event gives through the encoder (a test holds them equal)."""
        return (f'event: response.output_text.delta\ndata: {{"type": "response.output_text.delta", "sequence_number": '
                f'{next(self.numbers)}, "item_id": "{self.open["id"]}", "output_index": {len(self.items)}, '
                f'"content_index": 0, "delta": {json_string(text)}, "logprobs": []}}')

    def call(self, call: dict) -> list[str]:
        events = []
        arguments = call["function"].get("arguments") or ""
        if "id" in call:  # a new call
            events += self.close()
            self.open = _call_item(_item_id("fc"), {**call, "function": {**call["function"], "arguments": ""}},
                                   "in_progress")
            events.append(self.event("response.output_item.added", output_index=len(self.items), item=dict(self.open)))
        if arguments:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.items), delta=arguments))
        return events

    def part_event(self, kind: str, part: dict | None = None, **fields) -> str:
        if part is not None:
            fields["part"] = part
        return self.event(kind, item_id=self.open["id"], output_index=len(self.items), content_index=0, **fields)

    def close(self, status: str = "completed") -> list[str]:
        """The open item's closing events (``status``: "incomplete" for the one a cut ends); it joins the
        finished ones."""
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "reasoning":
            part = _reasoning_part(item.pop("text"))
            events += [self.part_event("response.reasoning_text.done", text=part["text"]),
                       self.part_event("response.content_part.done", part)]
            item["content"] = [part]
        elif item["type"] == "message":
            text, entries = item.pop("text"), item.pop("entries")
            part = _text_part(text, entries if self.with_logprobs else None)
            events += [self.part_event("response.output_text.done", text=text, logprobs=entries),
                       self.part_event("response.content_part.done", part)]
            item["content"] = [part]
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=len(self.items), name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open = None
        return events


def _sse(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}"


def _text_part(text: str, logprobs: list[dict] | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(item_id: str, text: str, logprobs: list[dict] | None, status: str) -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text, logprobs)]}


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [_reasoning_part(text)], "status": status}


def _last_covering(entries: list[dict], chars: int) -> list[dict]:
    """The last of a text's token entries that spell its last ``chars`` characters."""
    kept, covered = len(entries), 0
    while kept and covered < chars:
        kept -= 1
        covered += len(entries[kept]["token"])
    return entries[kept:]


def _call_item(item_id: str, call: dict, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}
