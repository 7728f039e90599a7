"""JSON as the gateway streams it: one encoder for every chunk (json.dumps with options makes one per call),
and the pieces of JSON that the chunks of nearly every token write out directly."""

from __future__ import annotations

import json

JSON = json.JSONEncoder(ensure_ascii=False)  # stateless
json_string = json.encoder.encode_basestring  # what JSON writes for a str (non-ASCII kept as is)


def json_scalar(value: str | int | None) -> str:
    """A finish or stop reason as JSON writes it."""
    if value is None:
        return "null"
    return json_string(value) if isinstance(value, str) else str(int(value))
