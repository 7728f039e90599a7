"""A /v1/chat/completions answer: each choice's message, its text told into reasoning (--reasoning-parser),
content and tool calls (forced by tool_choice, or parsed with --tool-call-parser), whole or as they stream."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import AsyncIterator

from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.logprob_format import chat_logprobs, vllm_prompt_logprobs
from services.gateway.model import Model
from services.gateway.media import load_image
from services.gateway.protocol import ChatCompletionRequest, image_parts, template_messages
from services.gateway.reply import Reply
from services.gateway.tool_calls import tool_call
from services.gateway.tool_parsers import ToolCallStream
from shared.invalid_parameter import InvalidParameter
from shared.sampling_params import SamplingParams


class ChatReply(Reply):
    object_whole, object_chunk = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    @staticmethod
    def prompts(model: Model, body: ChatCompletionRequest) -> tuple[list[list[int]], list[str], list[tuple]]:
        """The conversation's token ids, its text, and its images (fetched here: this runs off the event loop)."""
        urls = image_parts(body.messages) if model.image_prompts is not None else []
        if len(urls) > model.media.max_images_per_prompt:
            raise InvalidParameter(f"hold {len(urls)} images; a prompt may hold at most "
                                   f"{model.media.max_images_per_prompt} (--limit-mm-per-prompt)", "messages")
        text, ids = model.encode_chat(template_messages(body.messages, model.image_placeholder),
                                      add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message,
                                      template_kwargs=body.chat_template_kwargs,
                                      tools=body.tools or None, chat_template=body.chat_template)
        if not urls:
            return [body.truncated(ids, model.max_model_len)], [text], [()]
        if body.truncate_prompt_tokens is not None:
            raise InvalidParameter("cannot cut a prompt with images (it could cut one in two)", "truncate_prompt_tokens")
        images = [load_image(url, model.media, field) for url, field in urls]
        ids, inputs = model.image_prompts.process(text, images, add_special_tokens=False)
        return [ids], [text], [inputs]

    @staticmethod
    def checked_params(model: Model, body: ChatCompletionRequest) -> SamplingParams:
        params = Reply.checked_params(model, body)
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
