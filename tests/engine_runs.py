"""Runs an engine core's requests to their end, step by step, as the offline LLM does."""

from __future__ import annotations


def run_to_end(engine) -> tuple[dict[str, list[int]], dict[str, str]]:
    """The tokens each request made, and the error of each that failed, by request id."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    while engine.has_unfinished():
        for update in engine.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.error is not None:
                errors[update.request_id] = update.error
    return tokens, errors
