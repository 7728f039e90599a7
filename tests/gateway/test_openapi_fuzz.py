"""A schema-based fuzzer (schemathesis) against a real gateway stack: for every operation /openapi.json
describes, requests made from its schema (valid ones, and invalid ones) get no 5xx, and each answer is
what the document says: a documented status, a documented content type, a body that fits its schema.

Bounded and deterministic (a fixed number of examples per operation, derandomized): it finds what the
schema lets through, the same way on every run. Requests drawn at random from these loose schemas are
mostly refused (a made-up model, token ids outside the vocabulary, penalties out of range), so a few
requests that succeed, streamed and whole, go through the same checks first."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_headers_conformance,
                                 response_schema_conformance, status_code_conformance)

from tests.services_harness import Stack

EXAMPLES = {schemathesis.GenerationMode.POSITIVE: 20, schemathesis.GenerationMode.NEGATIVE: 6}  # per operation
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
SUCCEEDING = {  # path: bodies it answers with 200
    "/v1/completions": [{"prompt": "Hi", "max_tokens": 3}, {"prompt": "Hi", "max_tokens": 3, "stream": True}],
    "/v1/chat/completions": [CHAT, {**CHAT, "stream": True}],
    "/v1/responses": [{"input": "Hi", "max_output_tokens": 3}, {"input": "Hi", "max_output_tokens": 3, "stream": True}],
    "/invocations": [CHAT, {"prompt": "Hi", "max_tokens": 3, "stream": True}],
    "/tokenize": [{"prompt": "Hi"}],
    "/detokenize": [{"tokens": [1, 2]}],
}


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    # Every optional route on; a context of 512 tokens keeps the longest generation short.
    stack = Stack(llama_dir, tmp_path_factory.mktemp("fuzz-logs"), worker_args=("--num-gpu-blocks-override", "256"),
                  gateway_args=("--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes")).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_every_operation_answers_as_its_schema_says(stack):
    schema = schemathesis.openapi.from_url(f"{stack.base_url}/openapi.json", timeout=30)
    operations = {(op.method.upper(), op.path): op for op in (result.ok() for result in schema.get_all_operations())}
    assert len(operations) > 20
    for path, bodies in SUCCEEDING.items():
        for body in bodies:
            response = operations["POST", path].Case(body=body).call_and_validate(checks=CHECKS, timeout=60)
            assert response.status_code == 200, (path, body, response.text)
    failures = {}
    for (method, path), operation in operations.items():
        for mode, examples in EXAMPLES.items():
            try:
                _fuzz(operation, mode, examples)
            except Unsatisfiable:  # no invalid request to make: an operation without parameters or a body
                assert not mode.is_positive
            except Exception as exc:  # each operation's failure, reported together at the end
                failures[f"{method} {path} ({mode})"] = f"{type(exc).__name__}: {exc}"
    assert not failures, "\n\n".join(f"{name}: {error}" for name, error in failures.items())


def _fuzz(operation, mode, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=_cases(operation, mode))
    def run(case):
        case.call_and_validate(checks=CHECKS, timeout=60)

    run()


def _cases(operation, mode):
    """The operation's cases; valid ones also without a ``model`` (a made-up name gets only a 404), so that
    more of them get as far as the engine."""
    cases = operation.as_strategy(generation_mode=mode)
    if not mode.is_positive:
        return cases
    return cases | cases.map(_without_model)


def _without_model(case):
    if isinstance(case.body, dict):
        case.body.pop("model", None)
    return case
