"""Tool calls a model makes of its own accord (tool_choice "auto"), told from its text.

Each model family writes its calls in its own format, so the gateway is told which one to read
(`--tool-call-parser`, as vLLM's):
- `hermes` (Hermes, Qwen 2.5 and 3, the built-in model): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in the text;
- `llama3_json` (Llama 3.1 to 3.3): the whole output is one or more `{"name": ..., "parameters": {...}}`
  objects separated by `;` (after `<|python_tag|>`, where special tokens are shown).

A parser reads a stream of text deltas and hands back, per delta, the text that is content for sure
and the calls completed so far; text that may still turn out to be part of a call is held back
until it is known. Reading the whole output at once is the same as reading it in pieces, whatever
the pieces (a test holds them equal). A call whose JSON does not parse stays in the content, as
written: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object's text


@dataclass
class Parsed:
    """What one piece of output holds: content text, and calls completed in it."""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def extend(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


class ToolCallStream(ABC):
    """One sequence's output, read delta by delta."""

    @abstractmethod
    def feed(self, text: str) -> Parsed:
        """What the text so far makes certain, beyond what earlier calls handed back."""

    @abstractmethod
    def finish(self) -> Parsed:
        """The rest, once the output has ended."""

    def parse(self, text: str) -> Parsed:
        """A whole output at once."""
        return self.feed(text).extend(self.finish())


def read_call(text: str) -> ParsedCall | None:
    """{"name": ..., "arguments": {...}} (or "parameters", as Llama writes it); None if it is not one
    (an object without either key is an answer in JSON, not a call). The arguments are kept as
    written: decoding and encoding them again could change their numbers."""
    fields = _object_fields(text.strip())
    if fields is None or not isinstance(fields.get("name", (None,))[0], str):
        return None
    key = "arguments" if "arguments" in fields else "parameters" if "parameters" in fields else None
    if key is None:
        return None
    arguments, written = fields[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        written = arguments
        try:
            arguments = _DECODER.decode(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(fields["name"][0], written.strip())


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; a client's parser may not


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def _object_fields(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's fields, each as (value, its text); None unless the text is one object."""
    try:
        if not isinstance(_DECODER.decode(text), dict):
            return None
    except ValueError:
        return None
    fields, position = {}, text.index("{") + 1
    while True:  # the text is a valid object: only its layout is walked here
        position = _skip_space(text, position)
        if text[position] == "}":
            return fields
        key, position = _DECODER.raw_decode(text, position)
        position = _skip_space(text, _skip_space(text, position) + 1)  # past the colon
        value, end = _DECODER.raw_decode(text, position)
        fields[key] = (value, text[position:end])
        position = _skip_space(text, end)
        position += text[position] == ","


def _skip_space(text: str, position: int) -> int:
    while text[position] in " \t\r\n":
        position += 1
    return position


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins the marker (it may be completed next)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesStream(ToolCallStream):
    """Calls between <tool_call> and </tool_call>. The whitespace around a call is not content; an
    output without calls is content exactly as written."""
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self._held = ""  # not handed back yet: what may begin a start marker, or the body of a call
        self._in_call = False
        # Whitespace on either side of a call is dropped, but where content goes on after the call, the
        # whitespace before it stays (the text either side keeps its spacing).
        self._space = ""  # trailing whitespace of the content so far: held until content or the end
        self._after_call = False  # nothing but whitespace since the last call

    def feed(self, text: str) -> Parsed:
        self._held += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._held.find(self.END)
                if end == -1:
                    return out
                self._close_call(self._held[:end], self.END, out)
                self._held = self._held[end + len(self.END):]
                continue
            start = self._held.find(self.START)
            if start == -1:
                keep = len(self._held) - partial_suffix(self._held, self.START)
                self._content(self._held[:keep], out)
                self._held = self._held[keep:]
                return out
            self._content(self._held[:start], out)
            self._held = self._held[start + len(self.START):]
            self._in_call = True

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:  # no end marker (EOS or a stop string came first): the call stands if its JSON is whole
            self._close_call(self._held, "", out)
        else:
            self._content(self._held, out)
        self._held = ""
        if not self._after_call:  # trailing whitespace of the content, with no call after it
            out.content += self._space
        self._space = ""
        return out

    def _close_call(self, body: str, end: str, out: Parsed) -> None:
        self._in_call = False
        call = read_call(body)
        if call is None:  # not a call after all: content, as written
            self._content(self.START + body + end, out)
            return
        out.calls.append(call)
        self._after_call = True

    def _content(self, text: str, out: Parsed) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body):]
        out.content += body


class Llama3JsonStream(ToolCallStream):
    """An output that opens with `{` (or `<|python_tag|>`) is calls, read once it ends; any other is content,
    handed back as it comes."""
    TAG = "<|python_tag|>"

    def __init__(self):
        self._held = ""
        self._calls: bool | None = None  # None: not known yet (only whitespace, or part of the tag, so far)

    def feed(self, text: str) -> Parsed:
        if self._calls is False:
            return Parsed(text)
        self._held += text
        head = self._held.lstrip()
        if not head or (self.TAG.startswith(head) and head != self.TAG):
            return Parsed()
        self._calls = head.startswith("{") or head.startswith(self.TAG)
        if self._calls:
            return Parsed()
        text, self._held = self._held, ""
        return Parsed(text)

    def finish(self) -> Parsed:
        text, self._held = self._held, ""
        if not self._calls:
            return Parsed(text)
        calls = self._read_calls(text.strip().removeprefix(self.TAG))
        return Parsed(calls=calls) if calls else Parsed(text)

    @staticmethod
    def _read_calls(text: str) -> list[ParsedCall] | None:
        """Objects separated by ';' (and whitespace); None unless every one is a call."""
        calls, position = [], 0
        while True:
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
            if position == len(text):
                return calls or None
            try:
                _, end = _DECODER.raw_decode(text, position)
            except ValueError:
                return None
            call = read_call(text[position:end])
            if call is None:
                return None
            calls.append(call)
            position = end


TOOL_CALL_PARSERS: dict[str, type[ToolCallStream]] = {"hermes": HermesStream, "llama3_json": Llama3JsonStream}


def flag_error(enable_auto_tool_choice: bool | None, tool_call_parser: str | None) -> str | None:
    """What is wrong with a command line's --enable-auto-tool-choice and --tool-call-parser, if anything
    (a name from the environment skips argparse's choices)."""
    if enable_auto_tool_choice and not tool_call_parser:
        return "--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format)"
    if tool_call_parser and tool_call_parser not in TOOL_CALL_PARSERS:
        return f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(TOOL_CALL_PARSERS)}"
    return None


@dataclass(frozen=True)
class ToolCallParser:
    """The served model's call format."""
    name: str

    def __post_init__(self):
        if self.name not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")

    def stream(self) -> ToolCallStream:
        return TOOL_CALL_PARSERS[self.name]()
