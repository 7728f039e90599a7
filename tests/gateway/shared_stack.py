"""What the gateway tests read from a stack (conftest.py starts the one most of them share): its engine's
stats, its error objects, and the prompts and worker flags they use."""

from __future__ import annotations

import time

from tests import patient_http as httpx

from benchmarks.serving import parse_engine_stats
from tests.services_harness import http_get

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time"]
WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "512")


def engine_stats(stack) -> dict[str, float]:
    status, text = http_get(f"{stack.base_url}/metrics")
    assert status == 200
    return parse_engine_stats(text)


def wait_blocks_free(stack, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(stack)
        if stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def error_of(reply: httpx.Response, status: int) -> dict:
    """The OpenAI error object of a reply that must have this status."""
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error
