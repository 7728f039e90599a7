"""--reasoning-parser: a choice's text split into reasoning and content, the same however it streams."""

from __future__ import annotations

import os
import random

import pytest

from services.gateway.reasoning_parsers import REASONING_PARSERS

CASES = [  # text, qwen3's (reasoning, content), deepseek_r1's
    ("<think>\nhmm</think>\n\nAnswer", ("\nhmm", "\n\nAnswer"), ("\nhmm", "\n\nAnswer")),
    ("no tags at all", (None, "no tags at all"), ("no tags at all", None)),
    ("  <think>cut short", ("cut short", None), ("cut short", None)),
    ("<thi", (None, "<thi"), ("<thi", None)),  # a tag that never completed is text
    ("done</think>answer", (None, "done</think>answer"), ("done", "answer")),
    ("<think></think>", (None, None), (None, None)),
    ("<think>a</thinkb</think>c", ("a</thinkb", "c"), ("a</thinkb", "c")),
    ("", (None, None), (None, None)),
]


@pytest.mark.parametrize("text, qwen3, deepseek_r1", CASES)
def test_whole_outputs_split_as_each_parser_reads_them(text, qwen3, deepseek_r1):
    assert REASONING_PARSERS["qwen3"].split(text) == qwen3
    assert REASONING_PARSERS["deepseek_r1"].split(text) == deepseek_r1


def test_a_template_that_opens_the_tag_and_a_constrained_output():
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    # Thinking-only checkpoints' templates end the prompt with <think>: the output starts inside it.
    assert qwen3.split("plan</think>go", prompt_text="<|im_start|>assistant\n<think>\n") == ("plan", "go")
    # Structured outputs shape the output from its first token: reasoning only where it opens the tag.
    assert r1.split('{"a": 1}', constrained=True) == (None, '{"a": 1}')
    assert r1.split("<think>x</think>y", constrained=True) == ("x", "y")


def test_any_split_into_deltas_gives_the_whole_output_s_pieces():
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    alphabet = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "<thin", "k>"]
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 12)))
        for parser in REASONING_PARSERS.values():
            prompt = rng.choice(["", "<think>"])
            stream, pieces = parser.stream(prompt), ["", ""]
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 6))))
            for start, end in zip([0, *cuts], [*cuts, len(text)]):
                for i, piece in enumerate(stream.feed(text[start:end])):
                    pieces[i] += piece
            for i, piece in enumerate(stream.finish()):
                pieces[i] += piece
            assert (pieces[0] or None, pieces[1] or None) == parser.split(text, prompt), (seed, parser.name, text)
