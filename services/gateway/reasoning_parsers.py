"""Reasoning models' thinking, told from their answer (vLLM's --reasoning-parser).

DeepSeek-R1 and Qwen3 write their reasoning between ``<think>`` and ``</think>``, then the answer. The
parser splits a choice's text into the two, as it streams: each delta's text into reasoning and content
pieces, holding back only what may be the start of a tag split across deltas.

- ``deepseek_r1``: the output starts inside the reasoning (R1's template opens ``<think>`` in the prompt,
  and the model may not write it); without ``</think>`` everything is reasoning (cut short by max_tokens).
- ``qwen3``: reasoning only where the output opens with ``<think>``, or the prompt ends with it (the
  thinking-only checkpoints' templates); otherwise all is content (``enable_thinking: false``).

A request constrained from its first token (structured outputs) has reasoning only where its output
opens with ``<think>``: otherwise the constraint left the model no room to reason, and its whole output
is the answer. (A forced tool call's output is the call, never split.)
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.tool_parsers import partial_suffix

START, END = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    opens_in_reasoning: bool  # the output is reasoning from its first token, tag or no tag

    def stream(self, prompt_text: str = "", constrained: bool = False) -> "ReasoningStream":
        """One choice's splitter; ``prompt_text``: its rendered prompt (a template may open the tag);
        ``constrained``: structured outputs shape the output from its first token (module docstring)."""
        implicit = self.opens_in_reasoning or prompt_text.rstrip().endswith(START)
        return ReasoningStream(implicit and not constrained)

    def split(self, text: str, prompt_text: str = "", constrained: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        stream = self.stream(prompt_text, constrained)
        reasoning, content = stream.feed(text)
        last_reasoning, last_content = stream.finish()
        return (reasoning + last_reasoning) or None, (content + last_content) or None


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}


def reasoning_flag_error(name: str | None) -> str | None:
    """What is wrong with --reasoning-parser (its choices unchecked when it comes from the environment)."""
    if name and name not in REASONING_PARSERS:
        return f"--reasoning-parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {name!r}"
    return None


class ReasoningStream:
    """A choice's text, fed delta by delta: each feed returns the (reasoning, content) it is sure of."""

    def __init__(self, in_reasoning: bool):
        # "opening": the output's first characters may still become <think>; then "reasoning" or "content".
        self.state = "opening"
        self.reasons_without_tag = in_reasoning
        self.held = ""  # text not given out yet: a possible tag's start

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state == "opening":
            opening = self.held.lstrip()
            if opening.startswith(START):
                self.state, self.held = "reasoning", opening[len(START):]
            elif START.startswith(opening):
                return "", ""  # whitespace, or part of the tag so far
            else:
                self.state = "reasoning" if self.reasons_without_tag else "content"
        if self.state == "reasoning":
            end = self.held.find(END)
            if end < 0:
                keep = partial_suffix(self.held, END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:end], self.held[end + len(END):], "content"
        content, self.held = self.held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held, once the output ends: a tag that never completed is text."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "opening" and self.reasons_without_tag):
            return held, ""
        return "", held
