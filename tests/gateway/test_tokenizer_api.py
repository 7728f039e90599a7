"""/tokenize without a server: which special tokens each form adds (the test models' tokenizer adds none)."""

from __future__ import annotations

import pytest

from services.gateway.tokenizer_api import TokenizeRequest, _tokenize
from shared.invalid_parameter import InvalidParameter


class BosModel:
    """A tokenizer that puts a BOS (id 1) in front when asked to add special tokens; the template adds one too."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def encode_chat(self, messages, add_generation_prompt, continue_final_message, template_kwargs, chat_template=None,
                    tools=None):
        shown = "".join(tool["function"]["name"] for tool in tools or [])  # a template that lists the tools
        text = "\x01" + shown + "".join(m["content"] for m in messages) + ("A:" if add_generation_prompt else "")
        return text, self.encode(text, add_special_tokens=False)


def test_a_prompt_gets_special_tokens_unless_asked_not_to_and_messages_only_when_asked():
    model = BosModel()
    assert _tokenize(model, TokenizeRequest(prompt="hi")) == [1, 104, 105]
    assert _tokenize(model, TokenizeRequest(prompt="hi", add_special_tokens=False)) == [104, 105]
    messages = [{"role": "user", "content": "hi"}]
    assert _tokenize(model, TokenizeRequest(messages=messages)) == [1, 104, 105, 65, 58]  # the template's BOS only
    assert _tokenize(model, TokenizeRequest(messages=messages, add_special_tokens=True)) == [1, 1, 104, 105, 65, 58]
    assert _tokenize(model, TokenizeRequest(messages=messages, add_generation_prompt=False)) == [1, 104, 105]


def test_exactly_one_form_and_a_consistent_template_request():
    model = BosModel()
    for body in (TokenizeRequest(), TokenizeRequest(prompt="x", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(InvalidParameter, match="exactly one") as refused:
            _tokenize(model, body)
        assert refused.value.param == "prompt"
    with pytest.raises(InvalidParameter) as refused:
        _tokenize(model, TokenizeRequest(messages=[{"role": "user", "content": "x"}], continue_final_message=True))
    assert refused.value.param == "continue_final_message"


def test_messages_show_the_tools_they_are_given_and_must_be_what_openai_takes():
    model, messages = BosModel(), [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert _tokenize(model, TokenizeRequest(messages=messages, tools=tools, add_generation_prompt=False)) == \
        [1, ord("f"), 104, 105]
    for bad, why in [([{"role": "robot", "content": "x"}], "role"), ([{"role": "user", "content": None}], "content"),
                     ([{"role": "tool", "content": "x"}], "tool_call_id")]:
        with pytest.raises(InvalidParameter, match=why) as refused:
            _tokenize(model, TokenizeRequest(messages=bad))
        assert refused.value.param == "messages"
    with pytest.raises(InvalidParameter, match="lone surrogate") as refused:
        _tokenize(model, TokenizeRequest(prompt="a\ud800"))
    assert refused.value.param == "prompt"
