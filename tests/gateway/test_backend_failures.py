"""Failures of the backend, each on a stack of its own (real worker, scheduler and gateway processes on
loopback): an overloaded, dead, restarted, stopping or hung worker or scheduler, and the gateway's drain."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
import time

import grpc
from tests import patient_http as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.gateway.shared_stack import WORKER_ARGS, error_of
from tests.services_harness import START_LIMIT_S, Stack, free_port, http_get


def test_overload_then_dead_worker_then_dead_scheduler(llama_dir, tmp_path):
    # A request the dead worker catches in flight waits for one to take it again (resumption), at most 3 s here.
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS,
                  gateway_args=("--max-concurrent-requests", "1", "--resume-timeout", "3")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        long = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=30) as first:  # holds the only slot
            lines = first.iter_lines()  # (keep it: a dropped line iterator closes the response)
            assert next(lines).startswith("data: ")
            turned_away = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2})
            assert error_of(turned_away, 429)["type"] == "TooManyRequestsError"
            assert turned_away.headers["retry-after"] == "1"
        # Leaving the stream early gives the slot back.
        deadline = time.monotonic() + 5
        while httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code == 429:
            assert time.monotonic() < deadline, "the slot of a closed stream was never freed"
            time.sleep(0.05)
        stack.kill("worker")
        started = time.monotonic()
        error = error_of(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=90), 503)
        # The engine failing on the lost worker (then no scheduler taking the request again), or (once
        # the health poll has seen it) the refusal it sets: an answer, not a hang (the bound is generous:
        # a loaded machine may take seconds; a hang would take the 120 s backend timeout).
        assert time.monotonic() - started < 60
        assert "unavailable" in error["message"] or "worker" in error["message"], error
        assert error["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 5  # the scheduler notices within its health poll
        while http_get(f"{stack.base_url}/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http_get(f"{stack.base_url}/health")[0] == 503
        # A restarted worker is picked up: the scheduler builds a new engine on it and serves again.
        stack.start_worker()
        deadline = time.monotonic() + START_LIMIT_S
        while httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, stack.log_tail("scheduler")
            time.sleep(0.5)
        while http_get(f"{stack.base_url}/health")[0] != 200:  # the health poll catches up within 0.5 s
            assert time.monotonic() < deadline, stack.log_tail("scheduler")
            time.sleep(0.1)

        stack.kill("scheduler")
        started = time.monotonic()
        error = error_of(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=90), 503)
        assert time.monotonic() - started < 60 and "scheduler" in error["message"]  # not the 120 s backend timeout
        status, body = http_get(f"{stack.base_url}/health")
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(text="Hi"), timeout=10))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            # The gRPC health service says what /health says (a gRPC-only probe would route to it).
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            for service in ("", "pagedserve.api.v1.Generation"):
                while health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status != \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, service
                    time.sleep(0.1)
    finally:
        codes = stack.stop()
    assert codes["gateway"] == 0, stack.log_tail("gateway")


def test_a_worker_restarted_while_idle_serves_the_very_next_request(llama_dir, tmp_path):
    """However briefly it was gone: the scheduler rebuilds its engine once the worker's stream ends,
    not when a request finds the stream broken (that request got a 503)."""
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS) as stack:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        for attempt in range(2):
            stack.kill("worker")
            if attempt == 0:  # gone for a while: requests meanwhile get 503s that say why
                deadline = time.monotonic() + 30
                while "went away" not in (stack.log_dir / "scheduler.log").read_text():
                    assert time.monotonic() < deadline, stack.log_tail("scheduler")
                    time.sleep(0.1)
                with concurrent.futures.ThreadPoolExecutor(10) as pool:  # a new session's submissions at once
                    replies = list(pool.map(lambda _: httpx.post(url, json={"prompt": "Hi", "max_tokens": 2},
                                                                 timeout=30), range(10)))
                messages = [error_of(reply, 503)["message"] for reply in replies]
                assert all("worker" in m for m in messages), messages  # not "Internal error from Core"
            stack.start_worker()  # on the same address (the second time at once)
            deadline = time.monotonic() + START_LIMIT_S
            while "engine restarted" not in (stack.log_dir / "scheduler.log").read_text():
                assert time.monotonic() < deadline, stack.log_tail("scheduler")
                time.sleep(0.1)
            while http_get(f"{stack.base_url}/health")[0] != 200:
                assert time.monotonic() < deadline, stack.log_tail("scheduler")
                time.sleep(0.1)
            reply = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert reply.status_code == 200, reply.text
            (stack.log_dir / "scheduler.log").write_text("")  # the next round's restart must log anew


def test_a_stopping_scheduler_finishes_its_requests_and_refuses_new_ones(llama_dir, tmp_path):
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS) as stack:
        url = f"{stack.base_url}/v1/completions"
        long = {"prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", url, json=long, timeout=60) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")
            stack.procs["scheduler"].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (reply := httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)).status_code == 200:
                assert time.monotonic() < deadline  # (a request may slip in before the signal lands)
                time.sleep(0.05)
            assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"], reply.text
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the running one finished


def test_a_scheduler_without_a_worker_exits_saying_why(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pagedserve", "scheduler", "--listen", f"127.0.0.1:{free_port()}",
                           "--worker", f"127.0.0.1:{free_port()}", "--connect-timeout", "1"],
                          capture_output=True, text=True, timeout=START_LIMIT_S)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "is not reachable (no connection within 1 s)" in done.stderr, done.stderr


def _wait_for_engine_requests(stack: Stack, count: int) -> None:
    """Until the schedulers hold at least ``count`` requests, running or waiting (their GetStats, on /metrics)."""
    deadline = time.monotonic() + START_LIMIT_S
    while True:
        text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
        held = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
        if held >= count:
            return
        assert time.monotonic() < deadline, f"the engines never held {count} requests: {held}"
        time.sleep(0.05)


def _wait_until_answered(url: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while (reply := httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.2)


def test_a_hung_scheduler_or_worker_fails_requests_and_serving_resumes(llama_dir, tmp_path):
    # Without resumption: abandoned requests would otherwise wait for the hung scheduler to take them again.
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS,
                  gateway_args=("--backend-timeout", "2", "--max-resumes", "0")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        stack.procs["scheduler"].send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            started = time.monotonic()
            error = error_of(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=90), 503)
            # After the 2 s backend timeout, never before; the upper bound only tells a hang from an answer.
            assert 2 <= time.monotonic() - started < 60, "abandoned after the backend timeout, not before"
            assert "sent nothing" in error["message"]
        finally:
            stack.procs["scheduler"].send_signal(signal.SIGCONT)
        # The next request opens a new session and is answered.
        _wait_until_answered(url)
        # A stream already under way when the scheduler hangs ends in an error event, then [DONE].
        body = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as reply:
            events = reply.iter_lines()
            first = next(line for line in events if line.startswith("data: "))
            stack.procs["scheduler"].send_signal(signal.SIGSTOP)
            try:
                rest = [line[6:] for line in events if line.startswith("data: ")]
            finally:
                stack.procs["scheduler"].send_signal(signal.SIGCONT)
        assert "choices" in json.loads(first[6:])
        assert rest[-1] == "[DONE]" and "sent nothing" in json.loads(rest[-2])["error"]["message"], rest[-3:]
        assert all("choices" in json.loads(event) for event in rest[:-2])
        # A worker that hangs (alive, silent) under a running request: the scheduler's health says so.
        with httpx.stream("POST", url, json=body, timeout=30) as reply:
            next(line for line in reply.iter_lines() if line.startswith("data: "))
            stack.procs["worker"].send_signal(signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 15
                while http_get(f"{stack.base_url}/health")[0] != 503:
                    assert time.monotonic() < deadline, "a hung worker was never reported"
                    time.sleep(0.2)
                # ... and a new request is refused at once rather than queued behind the hung step.
                refused = error_of(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30), 503)
                assert "worker" in refused["message"], refused  # not the gateway's "sent nothing" timeout
            finally:
                stack.procs["worker"].send_signal(signal.SIGCONT)
        _wait_until_answered(url)
    finally:
        stack.stop()


def test_requests_still_running_at_the_end_of_the_drain_get_a_503_not_a_cut_connection(llama_dir, tmp_path):
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS, gateway_args=("--drain-timeout", "0.5")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        long = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "n": 4}
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as stream:
            events = stream.iter_lines()
            next(line for line in events if line.startswith("data: "))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Eight sequences of 480 tokens: still running when the 0.5 s drain ends, however idle the
                # machine (four of them once finished in time and failed the test).
                whole = pool.submit(httpx.post, url, json={**long, "n": 8}, timeout=60)
                _wait_for_engine_requests(stack, 2)  # both under way (a loaded machine may take a while)
                stack.procs["gateway"].send_signal(signal.SIGTERM)
                rest = [line[6:] for line in events if line.startswith("data: ")]
                error = error_of(whole.result(), 503)
        assert stack.procs["gateway"].wait(60) == 0  # the 0.5 s drain, then its farewell: an exit, not a hang
        assert "shutting down" in error["message"]
        assert rest[-1] == "[DONE]" and "shutting down" in json.loads(rest[-2])["error"]["message"], rest[-3:]
    finally:
        stack.stop()
