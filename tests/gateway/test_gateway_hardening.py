"""The gateway's HTTP server against hostile and odd traffic (bodies and headers too large, requests that never
finish arriving, more connections than it keeps, malformed HTTP, duplicate credentials, prompts far over the
context), vLLM's extra endpoints (/load, /invocations, /ping, /tokenizer_info), /health with the key store
down, and what /openapi.json says. Real processes on loopback: one stack, and a second gateway on its
scheduler with short timeouts (and an unreachable key store)."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import sys
import time

import grpc
from tests import patient_http as httpx
import pytest

from services.gateway.http_limits import HttpLimits
from services.gateway.prompt_bound import bounded_texts, counted_prefix
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.invalid_parameter import InvalidParameter
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.services_harness import REPO, Stack, free_port, http_get

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 * 1024
MAX_CONNECTIONS = 8
CLOSE_WITHIN_S = 30.0  # how long a test waits for the gateway to close a connection (its timeouts are 2 s)


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    stack = Stack(llama_dir, tmp_path_factory.mktemp("hardening-logs"), worker_args=("--num-gpu-blocks-override", "256"),
                  gateway_args=("--api-key", KEY, "--http-max-body-size", str(MAX_BODY), "--http-max-header-size",
                                "8192", "--http-max-connections", str(MAX_CONNECTIONS), "--enable-server-load-tracking",
                                "--enable-tokenizer-info-endpoint")).start(headers=AUTH)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def impatient(stack, tmp_path_factory):
    """A second gateway on the stack's scheduler: 2 s to send headers or a body, an API key store nobody
    listens at (its own key needs none). Yields its base URL."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("impatient-logs") / "gateway.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "gateway", "--port", str(port), "--grpc-port",
                             str(free_port()), "--scheduler", stack.scheduler_address, "--http-header-timeout", "2",
                             "--http-body-timeout", "2", "--api-key", KEY, "--api-key-store", "redis://127.0.0.1:1/0"],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _health_mentions(base, "API key store"):  # up, and past its scheduler check
            assert proc.poll() is None and time.monotonic() < deadline, "the second gateway did not start"
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _health_mentions(base: str, words: str) -> bool:
    try:
        status, body = http_get(f"{base}/health", 2)
    except OSError:
        return False
    return status == 503 and words in json.dumps(body)


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _connect(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=CLOSE_WITHIN_S)
    return sock


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a socket timeout fails the test)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    sock.close()
    return received


def _expect_431(sock: socket.socket) -> None:
    status, headers, body = _response(_read_until_closed(sock))
    assert status == 431 and headers["connection"] == "close"
    assert body["error"]["code"] == "request_header_fields_too_large"


def _response(raw: bytes) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one raw HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def _completion(stack, **body) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "Hello there", "max_tokens": 2, **body})


# --- no stack -------------------------------------------------------------------------------------------------

def test_counting_stops_as_soon_as_the_text_is_known_to_be_too_long():
    pieces = []

    def count(piece: str) -> int:
        pieces.append(piece)
        return len(piece.split())

    text = "word " * 1_000_000
    chars, tokens = counted_prefix(count, text, at_least=1000)
    assert tokens >= 1000 and chars == sum(map(len, pieces)) < 20_000  # a sliver of the 5 MB was looked at
    assert "".join(pieces) == text[:chars]
    assert counted_prefix(count, "word " * 100, at_least=1000) is None  # the whole text comes to fewer


def test_only_texts_that_reach_the_prompt_as_they_are_and_none_with_truncation():
    chat = ChatCompletionRequest(messages=[{"role": "system", "content": "be brief"},
                                           {"role": "assistant", "content": "<think>long</think>hi"},
                                           {"role": "user", "content": [{"type": "text", "text": "question"}]}])
    assert bounded_texts(chat) == [("messages", "be brief"), ("messages", "question")]
    assert bounded_texts(CompletionRequest(prompt=["a", "b"])) == [("prompt", "a"), ("prompt", "b")]
    assert bounded_texts(CompletionRequest(prompt=[[1, 2]])) == []  # token ids are counted as they are
    assert bounded_texts(CompletionRequest(prompt="a", truncate_prompt_tokens=5)) == []


def test_the_http_limits_refuse_what_cannot_work():
    for bad, flag in ((dict(max_body_bytes=0), "--http-max-body-size"), (dict(header_timeout_s=0), "header-timeout"),
                      (dict(max_connections=-1), "--http-max-connections"), (dict(body_timeout_s=-1), "body-timeout")):
        with pytest.raises(ValueError, match=flag):
            HttpLimits(**bad)


# --- the stack ------------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_gets_413_before_it_is_read(stack):
    error = _error(httpx.post(f"{stack.base_url}/v1/completions", headers=AUTH,
                              json={"prompt": "x" * MAX_BODY, "max_tokens": 1}), 413)
    assert error["code"] == "request_too_large" and "--http-max-body-size" in error["message"]

    def chunks():  # no Content-Length: counted as it comes
        for _ in range(20):
            yield b" " * 8192

    assert _error(httpx.post(f"{stack.base_url}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                             content=chunks()), 413)["code"] == "request_too_large"
    # A Content-Length over the limit is refused at once, not one byte of the body read.
    sock = _connect(stack.base_url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n")
    status, _, body = _response(_until_body(sock))  # (head and body may come in separate segments)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert _completion(stack).status_code == 200  # and it serves on


def test_a_prompt_far_over_the_context_is_refused_before_it_is_all_tokenized(stack):
    long = "lorem ipsum dolor sit amet " * 2000  # 54 kB, 100 times the 512-token context's worth of characters
    error = _error(_completion(stack, prompt=long), 400)
    chars = int(error["message"].split("its first ")[1].split()[0])
    assert error["param"] == "prompt" and "far longer" in error["message"] and chars < len(long)
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": long}], "max_tokens": 2})
    assert _error(chat, 400)["param"] == "messages"
    responses = httpx.post(f"{stack.base_url}/v1/responses", headers=AUTH, timeout=60,
                           json={"input": long, "max_output_tokens": 2})
    assert _error(responses, 400)["param"] == "input"
    # With truncation any length fits: tokenized whole, its last tokens kept, served.
    kept = _completion(stack, prompt=long, truncate_prompt_tokens=100)
    assert kept.status_code == 200 and kept.json()["usage"]["prompt_tokens"] == 100
    # A prompt just over the context is refused by the ordinary check, with its count.
    assert "the prompt has" in _error(_completion(stack, prompt="hello " * 600), 400)["message"]
    # Over gRPC alike: INVALID_ARGUMENT naming the field, for a generation and for an embedding's input.
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        metadata = [("authorization", f"Bearer {KEY}")]
        with pytest.raises(grpc.RpcError) as refused:
            list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(
                text=long, params=api.SamplingParameters(max_tokens=1)), timeout=60, metadata=metadata))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text is far longer" in \
            refused.value.details()
        kept = list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(
            text=long, params=api.SamplingParameters(max_tokens=1, truncate_prompt_tokens=100)), timeout=60,
            metadata=metadata))
        assert kept[-1].usage.prompt_tokens == 100


def test_a_header_flood_gets_431_and_malformed_http_an_error_object(stack):
    sock = _connect(stack.base_url)  # 64 headers of 1 kB at once: the parser counts them, however they are read
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-Filler-%d: " % i + b"a" * 1000 + b"\r\n" for i in range(64)))
    _expect_431(sock)

    sock = _connect(stack.base_url)  # one header that never ends, a kB at a time until the gateway answers
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Filler: ")
    for _ in range(1024):
        if select.select([sock], [], [], 0.01)[0]:
            break
        sock.sendall(b"a" * 1024)
    _expect_431(sock)

    sock = _connect(stack.base_url)
    sock.sendall(b"THIS IS NOT HTTP\r\n\r\n")
    status, headers, body = _response(_read_until_closed(sock))
    assert status == 400 and headers["content-type"] == "application/json"
    assert body["error"]["type"] == "BadRequestError" and "malformed HTTP" in body["error"]["message"]


def test_two_authorization_headers_or_grpc_entries_are_refused(stack):
    reply = httpx.get(f"{stack.base_url}/v1/models", headers=[("Authorization", f"Bearer {KEY}"),
                                                             ("Authorization", "Bearer someone-else")])
    assert "2 Authorization headers" in _error(reply, 400)["message"]
    assert httpx.get(f"{stack.base_url}/v1/models", headers=AUTH).status_code == 200
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:  # and over gRPC, INVALID_ARGUMENT
        request = api.GenerateRequest(text="Hi", params=api.SamplingParameters(max_tokens=1))
        with pytest.raises(grpc.RpcError) as refused:
            list(api_grpc.GenerationStub(channel).Generate(request, timeout=30, metadata=[
                ("authorization", f"Bearer {KEY}"), ("authorization", "Bearer someone-else")]))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2 authorization" in refused.value.details()


def test_connections_beyond_the_cap_get_503_and_the_gateway_serves_on(stack):
    held = [_connect(stack.base_url) for _ in range(MAX_CONNECTIONS)]  # open, silent (well within 20 s)
    try:
        extra = _connect(stack.base_url)  # accepted after them: one too many
        extra.sendall(b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = _response(_read_until_closed(extra))
        assert status == 503 and headers["retry-after"] == "1" and "--http-max-connections" in body["error"]["message"]
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + CLOSE_WITHIN_S  # once the gateway has seen them go
    while http_get(f"{stack.base_url}/version")[0] != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_load_counts_the_requests_in_flight(stack):
    assert http_get(f"{stack.base_url}/load")[1] == {"server_load": 0}  # open, as /metrics
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    sock = _connect(stack.base_url)  # a request whose body has not all come: in flight until it has
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" +
                 body[:5])
    deadline = time.monotonic() + CLOSE_WITHIN_S
    while http_get(f"{stack.base_url}/load")[1]["server_load"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sock.sendall(body[5:])
    assert _response(_until_body(sock))[0] == 200
    while http_get(f"{stack.base_url}/load")[1]["server_load"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _until_body(sock: socket.socket) -> bytes:
    """One whole response with a Content-Length."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536)
    head, _, body = raw.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    sock.close()
    return head + b"\r\n\r\n" + body


def test_invocations_route_by_the_body_s_shape(stack):
    url = f"{stack.base_url}/invocations"
    chat = httpx.post(url, headers=AUTH, json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(url, headers=AUTH, json={"prompt": "Hi", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    with httpx.stream("POST", url, headers=AUTH, json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.read().rstrip().endswith(b"data: [DONE]")
    # An embedding request to a model that generates: none of the shapes it answers.
    assert "ChatCompletionRequest, CompletionRequest" in _error(httpx.post(url, headers=AUTH, json={"input": "x"}),
                                                                 400)["message"]
    assert "malformed JSON" in _error(httpx.post(url, headers={**AUTH, "Content-Type": "application/json"},
                                                 content=b"{nope"), 400)["message"]
    assert _error(httpx.post(url, json={"prompt": "Hi"}), 401)["code"] == "invalid_api_key"
    for method in ("GET", "POST"):  # SageMaker's health check, open
        assert httpx.request(method, f"{stack.base_url}/ping").json() == {"status": "ok"}


def test_tokenizer_info(stack):
    info = httpx.get(f"{stack.base_url}/tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"] and info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"  # AddedTokens as their text, as vLLM gives them
    assert "name_or_path" not in info and "vocab_file" not in info  # the server's paths stay its own
    assert httpx.get(f"{stack.base_url}/tokenizer_info").status_code == 401


def test_openapi_says_what_the_server_answers(stack):
    spec = httpx.get(f"{stack.base_url}/openapi.json").json()
    operations = {(method, path): op for path, item in spec["paths"].items() for method, op in item.items()}
    assert not [key for key, op in operations.items() if "422" in op["responses"]]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for (method, path), op in operations.items():
        for status, response in op["responses"].items():
            if status == "default" or status[0] in "45":
                assert response["content"] == {"application/json": {"schema": error}}, (method, path, status)
        if "requestBody" in op:
            assert "400" in op["responses"] and "413" in op["responses"], path
    assert set(operations["post", "/v1/responses"]["responses"]["200"]["content"]) == {"application/json",
                                                                                     "text/event-stream"}
    assert set(operations["get", "/metrics"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "401" in operations["get", "/v1/models"]["responses"]  # this gateway wants keys
    assert "401" not in operations["get", "/health"]["responses"]  # but not for its probes
    # What the server does: a field of the wrong type is a 400, not 422.
    assert _error(_completion(stack, max_tokens="many"), 400)["param"] == "max_tokens"


# --- the impatient gateway -----------------------------------------------------------------------------------

def test_requests_that_never_finish_arriving_are_cut_off(impatient):
    half_headers = []
    for _ in range(20):
        sock = _connect(impatient)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nUser-Ag")
        half_headers.append(sock)
    silent = _connect(impatient)
    short_body = _connect(impatient)
    short_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                       b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    for sock in half_headers:
        status, _, body = _response(_read_until_closed(sock))
        assert status == 408 and "--http-header-timeout" in body["error"]["message"]
    assert _read_until_closed(silent) == b""  # never a byte sent: closed without a word
    status, _, body = _response(_read_until_closed(short_body))
    assert status == 408 and body["error"]["code"] == "request_timeout" and "--http-body-timeout" in \
        body["error"]["message"]
    assert http_get(f"{impatient}/version")[0] == 200  # and it serves on


def test_health_is_503_while_the_key_store_is_unreachable(impatient):
    status, body = http_get(f"{impatient}/health")
    assert status == 503 and body["error"]["message"].startswith("degraded: the API key store")
    assert httpx.post(f"{impatient}/ping").status_code == 503
    assert http_get(f"{impatient}/version")[0] == 200  # the process itself answers (a liveness probe's)
