"""A /v1/completions answer: choice k of a request with several prompts is prompt k // n, sequence k % n;
with echo, each choice starts with its prompt (and its prompt's logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.json_text import json_scalar, json_string
from services.gateway.logprob_format import completion_logprobs, vllm_prompt_logprobs
from services.gateway.merge import merge
from services.gateway.model import Model
from services.gateway.protocol import CompletionRequest
from services.gateway.reply import Reply, usage
from services.gateway.run import Run
from shared.detokenizer import IncrementalDetokenizer


def _echoed_text(model: Model, token_ids: list[int]) -> str:
    """The text of a prompt given as token ids, only needed to echo it; checked first, since the
    tokenizer fails on an id outside the vocabulary (a 500) before the scheduler's checks run."""
    model.check_token_ids(token_ids)
    return model.decode(token_ids)


class CompletionReply(Reply):
    object_whole = object_chunk = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args):
        super().__init__(*args)
        self.echoed: set[int] = set()
        self._ids_sent: set[int] = set()  # the choices whose prompt_token_ids a chunk carried (return_token_ids)

    @staticmethod
    def prompts(model: Model, body: CompletionRequest) -> tuple[list[list[int]], list[str], list[tuple]]:
        """The prompts' token ids (truncate_prompt_tokens applied), the texts an echo shows (as given, unless
        truncation cut them: then the tokens kept, decoded), and their images (none here)."""
        ids, texts = [], []
        for prompt in body.prompts():
            given = model.encode(prompt) if isinstance(prompt, str) else list(prompt)
            kept = body.truncated(given, model.max_model_len)
            ids.append(kept)
            if not body.echo:
                texts.append(prompt if isinstance(prompt, str) else "")
            else:
                texts.append(prompt if isinstance(prompt, str) and kept is given else _echoed_text(model, kept))
        return ids, texts, [()] * len(ids)

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
        return (f'{self._chunk_head}[{{"index": {k}, "text": {json_string(delta.text)}, "finish_reason": '
                f'{json_scalar(delta.finish_reason)}, "stop_reason": {json_scalar(delta.stop_reason)}, '
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
