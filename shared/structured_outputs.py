"""Structured outputs: a request's output held to a JSON schema, to any JSON object, to a regular
expression, to one of several strings, or to an EBNF grammar.

The fields are vLLM's StructuredOutputsParams (OpenAI's `response_format` maps onto them). The
grammar engine is xgrammar, as vLLM's default: here a request's constraint is described and
checked (a bad schema or pattern is a ValueError that names the field); the worker compiles it
against its tokenizer and masks every step's logits to the tokens the grammar allows
(services/worker/grammar.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import InitVar, dataclass
from typing import Any

from shared.invalid_parameter import require

# Its errors read as SamplingParams' (it is one of their fields), naming the field.
_check = functools.partial(require, owner="SamplingParams")

KINDS = ("json", "regex", "choice", "grammar", "json_object")
ANY_OBJECT = '{"type": "object"}'  # json_object: OpenAI's JSON mode means an object, not any JSON value


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | dict | None = None  # a JSON schema: an object, or its text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect; its start rule is `root`)
    json_object: bool = False  # any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace beyond single separators
    # False where the grammar was checked before (one hop back): building it again can take long.
    check_grammar: InitVar[bool] = True

    def __post_init__(self, check_grammar: bool) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        _check(len(given) == 1, "structured_outputs",
               f"must give exactly one of {', '.join(KINDS)}, got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None:
            _check(isinstance(self.regex, str) and self.regex, "regex", "must be a non-empty string")
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar.strip(), "grammar", "must be a non-empty string")
        if self.choice is not None:
            _check(not isinstance(self.choice, (str, bytes, dict)) and hasattr(self.choice, "__iter__"), "choice",
                   f"must be a list of strings, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
            _check(self.choice and all(isinstance(c, str) and c for c in self.choice), "choice",
                   "must be a non-empty list of non-empty strings")
        _check(isinstance(self.disable_any_whitespace, bool), "disable_any_whitespace", "must be true or false")
        if check_grammar:
            _check_grammar(self.kind, self.spec, not self.disable_any_whitespace)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a choice as the EBNF grammar it becomes): with kind, the key its
        compiled grammar is cached under."""
        if self.kind == "choice":
            return choice_grammar(self.choice)
        return ANY_OBJECT if self.kind == "json_object" else getattr(self, self.kind)

    @property
    def any_whitespace(self) -> bool:
        return not self.disable_any_whitespace

    # --- wire form (pagedserve.api.v1.StructuredOutputs) -------------------------------------------

    def to_proto(self):
        from shared.proto import pagedserve_api_pb2 as api

        message = api.StructuredOutputs(disable_any_whitespace=self.disable_any_whitespace)
        if self.kind == "choice":
            message.choice.values.extend(self.choice)
        elif self.kind == "json_object":
            message.json_object = True
        else:
            setattr(message, self.kind, getattr(self, self.kind))
        return message

    @classmethod
    def from_proto(cls, message, check_grammar: bool = True) -> StructuredOutputs:
        kind = message.WhichOneof("kind")
        if kind is None:
            raise ValueError("SamplingParams.structured_outputs must give exactly one of " + ", ".join(KINDS))
        value = list(message.choice.values) if kind == "choice" else getattr(message, kind)
        return cls(**{kind: value}, disable_any_whitespace=message.disable_any_whitespace, check_grammar=check_grammar)


def choice_grammar(choices: list[str]) -> str:
    """root ::= "a" | "b" | ... with each string a literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def xgrammar_schema(spec: str) -> str:
    """The schema as xgrammar should compile it: each string bounded by minLength / maxLength (and by no
    pattern or format) gets the bound as a pattern instead. xgrammar (to 0.2.9 at least, its issue #800)
    lowers such strings to a class that admits raw control characters, which JSON forbids (json.loads
    refuses the output); its pattern path keeps to JSON's characters. Like xgrammar's bounded strings,
    such strings hold no escapes and no line breaks."""
    schema = json.loads(spec)
    rewritten = _bounds_as_patterns(schema)
    return spec if rewritten == schema else json.dumps(rewritten, ensure_ascii=False)


# One character of a bounded string: not a line break (as xgrammar's own bounded strings), and not a
# surrogate code point (xgrammar's "." takes one, whose UTF-8 is invalid and decodes to three U+FFFD).
_JSON_CHARACTER = r"[^\n\uD800-\uDFFF]"
_LITERAL_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


def _bounds_as_patterns(node: Any) -> Any:
    if isinstance(node, list):
        return [_bounds_as_patterns(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: value if key in _LITERAL_KEYWORDS else _bounds_as_patterns(value) for key, value in node.items()}
    bounds = [out.get("minLength"), out.get("maxLength")]
    types = out.get("type", "string")
    may_be_string = types == "string" or (isinstance(types, list) and "string" in types)
    if (may_be_string and "pattern" not in out and "format" not in out and any(isinstance(b, int) for b in bounds)
            and all(b is None or (isinstance(b, int) and b >= 0) for b in bounds)):
        low, high = out.pop("minLength", None) or 0, out.pop("maxLength", None)
        out["pattern"] = f"^{_JSON_CHARACTER}{{{low},{'' if high is None else high}}}$"
    return out


def _schema_text(schema: Any) -> str:
    """The schema as text, its properties in the order given: the output follows that order (a
    model asked for its reasoning before its answer must write them so)."""
    text = schema if isinstance(schema, str) else None
    if text is not None:
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"SamplingParams.json is not valid JSON: {exc}") from None
    _check(isinstance(schema, dict), "json", f"must be a JSON schema (an object), got {type(schema).__name__}")
    if text is not None:
        return text
    try:
        return json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"SamplingParams.json cannot be written as JSON: {exc}") from None


@functools.lru_cache(maxsize=1024)
def _check_grammar(kind: str, spec: str, any_whitespace: bool) -> None:
    """Build the grammar once (no tokenizer needed): what xgrammar refuses is a bad request."""
    import xgrammar as xgr

    try:
        if kind in ("json", "json_object"):
            xgr.Grammar.from_json_schema(xgrammar_schema(spec), any_whitespace=any_whitespace)
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(spec)
    except RuntimeError as exc:
        raise ValueError(f"SamplingParams.{kind} is not usable: {engine_message(exc)}") from None


def engine_message(exc: BaseException) -> str:
    """xgrammar's message without its timestamp, source file and internal check."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text)
