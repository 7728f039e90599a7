"""The OpenAI stream chunks the gateway writes directly equal what the JSON encoder makes of them."""

from __future__ import annotations

import json
import random
import types

import pytest

from services.gateway.completion_reply import CompletionReply
from services.gateway.deltas import SeqDelta
from services.gateway.model import Model
from services.gateway.protocol import CompletionRequest
from services.gateway.reply import Reply

ALPHABET = ["a", "Z", " ", '"', "\\", "/", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "東", "🎉", "\u2028", "\ud7ff"]


def completion(**body) -> CompletionReply:
    model = Model("model-ü", 4096, 32000, 20, tokenizer=None)
    return CompletionReply(model, CompletionRequest(model="model-ü", prompt="hi", stream=True, **body), "cmpl-1", [],
                           ["hi"])


@pytest.mark.parametrize("stream_options", [None, {"include_usage": True}])
def test_the_direct_chunk_is_the_encoders_chunk(stream_options):
    rng = random.Random()
    reply = completion(stream_options=stream_options)
    for _ in range(500):
        text = "".join(rng.choices(ALPHABET, k=rng.randrange(0, 12)))
        finish, stop = rng.choice([(None, None), ("length", None), ("stop", 2), ("stop", 'E"ND\\'), ("abort", None)])
        delta = SeqDelta(rng.randrange(3), [rng.randrange(100)], text, None, finish, stop, 0)
        k = rng.randrange(10)
        direct = reply.chunk_event(k, 0, delta)
        assert direct == Reply.chunk_event(reply, k, 0, delta)
        assert json.loads(direct)["choices"][0]["text"] == text
        assert ("usage" in json.loads(direct)) == (stream_options is not None)  # null until the last chunk


def test_nothing_to_say_is_no_chunk_and_logprobs_take_the_general_path():
    assert completion().chunk_event(0, 0, SeqDelta(0, [], "")) is None
    with_logprobs = completion(logprobs=1)
    chunk = json.loads(with_logprobs.chunk_event(0, 0, SeqDelta(0, [5], "x", [], None, None, 0)))
    assert chunk["choices"][0]["logprobs"] == {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                               "text_offset": []}


class _BosTokenizer:
    """Words as ids, with a BOS id in front, as many tokenizers encode."""
    words = ["<s>", "The", "quick", "brown", "fox"]

    def __call__(self, text, add_special_tokens=True):
        class Encoded:
            input_ids = [0] * add_special_tokens + [self.words.index(w) for w in text.split()]
        return Encoded()

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def test_echo_shows_the_prompt_as_given_unless_truncation_cut_it():
    model = Model("m", 4096, 5, 20, tokenizer=_BosTokenizer())
    given = "The quick brown fox"
    for keep, ids, text in [(None, [0, 1, 2, 3, 4], given), (100, [0, 1, 2, 3, 4], given),
                            (-1, [0, 1, 2, 3, 4], given), (2, [3, 4], "brown fox")]:
        body = CompletionRequest(prompt=given, echo=True, truncate_prompt_tokens=keep)
        assert CompletionReply.prompts(model, body) == ([ids], [text], [()]), keep
    tokens = CompletionRequest(prompt=[1, 2, 3], echo=True, truncate_prompt_tokens=2)
    assert CompletionReply.prompts(model, tokens) == ([[2, 3]], ["quick brown"], [()])


def test_a_logprob_of_minus_infinity_is_minus_9999_as_vllm_s():
    class Position:
        token_id, logprob, rank, top_token_ids, top_logprobs = 1, float("-inf"), 5, [2], [float("-inf")]

    model = Model("m", 4096, 5, 20, tokenizer=_BosTokenizer())
    entry = model.logprob(Position())
    assert entry.logprob == -9999.0 and entry.top[0].logprob == -9999.0
    assert json.loads(json.dumps(entry.logprob)) == -9999.0


def test_the_direct_responses_text_delta_is_the_encoders_event():
    from services.gateway.responses_api import _EventWriter

    rng = random.Random()
    writer = _EventWriter(types.SimpleNamespace(body=types.SimpleNamespace(logprobs=False)))
    writer.text("")  # opens the message item
    for _ in range(500):
        text = "".join(rng.choices(ALPHABET, k=rng.randrange(1, 12)))
        writer.items = [None] * rng.randrange(3)  # output_index follows the finished items
        number = rng.randrange(10_000)
        writer.numbers = iter([number])
        direct = writer.plain_delta(text)
        writer.numbers = iter([number])
        assert direct == writer.part_event("response.output_text.delta", delta=text, logprobs=[])
        assert json.loads(direct.split("data: ", 1)[1])["delta"] == text


def test_a_request_s_own_chat_template_needs_the_gateway_s_trust():
    from shared.invalid_parameter import InvalidParameter

    model = Model("m", 4096, 5, 20, tokenizer=_BosTokenizer())
    with pytest.raises(InvalidParameter, match="--trust-request-chat-template") as refused:
        model.encode_chat([{"role": "user", "content": "hi"}], chat_template="{{ messages }}")
    assert refused.value.param == "chat_template"
