"""`pagedserve serve`: its processes up and healthy, a crashed one started again, and always all gone
after a stop or a crash of the launcher."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services_harness import START_LIMIT_S, free_port, http_get

REPO = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def start_serve(model_dir: Path, tmp_path: Path, *extra: str, num_children: int = 3) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir), "--port", str(port),
                             "--grpc-port", str(free_port()), "--kv-cache-memory-bytes", str(8 << 20), *extra],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    # Seconds when idle; CI's other test process may be compiling kernels on both cores meanwhile (a
    # two-backend start once took over 120 s there).
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if http_get(f"http://127.0.0.1:{port}/health", 2)[0] == 200 and \
                    len(children_of(proc.pid)) == num_children:
                return proc, port
        except OSError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError((tmp_path / "serve.log").read_text()[-3000:])


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_serve_starts_and_leaves_nothing_behind(llama_dir, tmp_path, how):
    proc, port = start_serve(llama_dir, tmp_path)
    children = children_of(proc.pid)
    try:
        # /health answers once the scheduler does; the first model request may still wait for the
        # gateway's tokenizer load, seconds on a loaded 2-core machine.
        status, models = http_get(f"http://127.0.0.1:{port}/v1/models", 60)
        assert status == 200 and models["data"][0]["id"]
        if how == "sigterm":  # drain and stop in order; exit code 0
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        else:  # the launcher crashes: the kernel tells its children to stop
            proc.kill()
            proc.wait(10)
        assert wait_gone(children, 30) == []
    finally:
        for pid in [proc.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_worker_gets_every_engine_option():
    # The worker sizes activations, its KV pool, the sampler's logprobs and its CUDA graphs for the
    # scheduler's limits: a worker that kept the defaults while the scheduler ran 512 sequences (or allowed
    # 100 logprobs) would under-count its memory.
    from pagedserve.launcher import build_parser, worker_argv
    from services.worker import server as worker_server
    from shared.config import EngineConfig
    from shared.options import values

    serve = build_parser()
    args = serve.parse_args(["--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--enforce-eager",
                             "--no-enable-chunked-prefill", "--block-size", "8", "--max-model-len", "300",
                             "--max-logprobs", "50", "--watermark", "0.2", "-tp", "1",
                             "--speculative-config", '{"num_speculative_tokens": 2}'])
    argv = worker_argv(serve, args, "unix:/tmp/w.sock")
    worker_args = worker_server.build_parser().parse_args(argv)
    assert worker_args.listen == "unix:/tmp/w.sock"
    assert values(EngineConfig, worker_args) == values(EngineConfig, args)
    assert len(values(EngineConfig, args)) == len(dataclasses.fields(EngineConfig))
    assert (worker_args.max_num_seqs, worker_args.enforce_eager, worker_args.enable_chunked_prefill,
            worker_args.max_logprobs, worker_args.watermark) == (7, True, False, 50, 0.2)


def test_the_gateway_and_the_scheduler_get_every_flag_of_theirs():
    """serve takes every option the services declare (one added to a service needs no change to the
    launcher), and each child parses what it is given back into the values serve read; an option of
    another service with the same name (the gateway's --drain-timeout) leaves the child's default."""
    from pagedserve.launcher import build_parser
    from pagedserve.serve_flags import SET_BY_LAUNCHER, service_options
    from services.gateway.server import build_parser as gateway_parser
    from services.scheduler.server import build_parser as scheduler_parser

    serve = build_parser()
    given = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-resumes", "1",
             "--max-concurrent-requests", "5", "--drain-timeout", "3", "--allowed-origins", "", "--backend-timeout",
             "30", "--served-model-name", "a", "b", "--max-logprobs", "7", "--watermark", "0.1",
             "--no-async-scheduling", "--max-num-seqs", "9", "--tokenizer", "/t", "--api-key", "k"]
    args = serve.parse_args(given)
    for name, parser in {"gateway": gateway_parser(), "scheduler": scheduler_parser()}.items():
        child = parser.parse_args(serve.argv_for(name, args))
        for option in service_options()[name]:
            if option.name in SET_BY_LAUNCHER or option.secret:
                continue
            theirs = serve.declared[option.name] == option
            expected = getattr(args, option.name) if theirs else option.default
            assert getattr(child, option.name) == expected, (name, option.name)
    gateway = gateway_parser().parse_args(serve.argv_for("gateway", args))
    assert (gateway.max_concurrent_requests, gateway.drain_timeout, gateway.allowed_origins,
            gateway.backend_timeout, gateway.served_model_name, gateway.tokenizer, gateway.api_key) == \
        (5, 3.0, "", 30.0, ["a", "b"], "/t", None)  # the key reaches it in its environment
    scheduler = scheduler_parser().parse_args(serve.argv_for("scheduler", args))
    assert (scheduler.drain_timeout, scheduler.max_logprobs, scheduler.async_scheduling) == (30.0, 7, False)
    assert not gateway_parser().parse_args(serve.argv_for("gateway", serve.parse_args([]))).enable_auto_tool_choice


def test_serve_help_gives_every_flag_a_text_and_its_default_grouped_by_service():
    from pagedserve.launcher import build_parser
    from shared.option_flags import HelpFormatter

    serve = build_parser()
    formatter = HelpFormatter("pagedserve serve")
    for action in serve._actions:
        if action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help text"
            assert "default" in formatter._get_help_string(action), action.option_strings[0]
    text = serve.format_help()
    for flag in ("--port", "--grpc-port", "--dtype", "--max-model-len", "--max-num-seqs", "--drain-timeout",
                 "--max-concurrent-requests", "--allowed-origins", "--backend-timeout", "--watermark"):
        assert f"\n  {flag} " in text, flag
    assert "(default: 8000)" in text and "(default: 256)" in text
    groups = [line for line in text.splitlines() if line and not line[0].isspace() and line.endswith(":")]
    assert [group.split()[0].rstrip(":") for group in groups[-5:]] == ["engine", "gateway", "scheduler", "every",
                                                                        "launcher"]
    assert "--connect-timeout and --drain-timeout above are the gateway's" in groups[-3]
    assert text.index("--max-streams") > text.index("\nscheduler") > text.index("--drain-timeout")


def test_a_child_not_healthy_within_its_start_up_limit_counts_as_a_crash(capsys):
    """A restarted worker stuck at start would keep the stack at 503 for good: past --startup-timeout it
    is stopped and started again, and one that never gets healthy ends the stack as a crash loop does.
    A healthy one is left alone."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from pagedserve.launcher import MAX_FAILED_STARTS, Child, Stack, build_parser

    serve = build_parser()
    stack = Stack(serve.parse_args(["--startup-timeout", "0"]), serve)
    stack.program = [sys.executable, "-c", "import time; time.sleep(600)"]  # then the child's subcommand: ignored
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix:{stack.socket_dir}/healthy.sock")
    server.start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # stop() ignores them
    try:
        well = stack._spawn(Child("scheduler", "scheduler", [], {}, ("grpc", f"unix:{stack.socket_dir}/healthy.sock")))
        stuck = stack._spawn(Child("worker", "worker", [], {}, ("grpc", f"unix:{stack.socket_dir}/silent.sock")))
        pids = [stuck.proc.pid]
        for _ in range(MAX_FAILED_STARTS):
            assert stack.watch() is None
            pids.append(stuck.proc.pid)
            stuck.crashes.clear()  # as if a minute passed: starts that fail in a row end the stack all the same
        assert stack.watch() == "worker"
        assert len(set(pids)) == len(pids) and not any(alive(pid) for pid in pids[:-1])
        assert capsys.readouterr().err.count("the worker was not healthy within 0 s of its start; starting it "
                                             "again") == MAX_FAILED_STARTS
        assert well.healthy and well.crashes == [] and alive(well.proc.pid)
    finally:
        stack.stop()
        server.stop(None)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not alive(pids[-1]) and not alive(well.proc.pid)


def test_a_child_that_keeps_crashing_after_getting_healthy_ends_the_stack_within_a_minute():
    """Crashes after a healthy start are not failed starts: the per-minute count ends the stack."""
    from pagedserve.launcher import MAX_RESTARTS_PER_MINUTE, Child, Stack, build_parser

    serve = build_parser()
    stack = Stack(serve.parse_args([]), serve)
    stack.program = [sys.executable, "-c", "import sys; sys.exit(3)"]  # then the child's subcommand: ignored
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}  # stop() ignores them
    try:
        child = stack._spawn(Child("worker", "worker", [], {}, ("grpc", f"unix:{stack.socket_dir}/none.sock")))
        for _ in range(MAX_RESTARTS_PER_MINUTE):
            child.healthy = True  # as if it had served before it crashed
            child.proc.wait(timeout=60)
            assert stack.watch() is None and child.failed_starts == 0
        child.healthy = True
        child.proc.wait(timeout=60)
        assert stack.watch() == "worker"
    finally:
        stack.stop()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_data_parallel_backends_serve_and_a_crashed_worker_is_started_again(llama_dir, tmp_path):
    proc, port = start_serve(llama_dir, tmp_path, "--data-parallel-size", "2", num_children=5)
    children = children_of(proc.pid)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    try:
        from tests import patient_http as httpx

        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        up = [line for line in http_get(f"{base}/metrics")[1].splitlines()
              if line.startswith("pagedserve_scheduler_up{")]
        assert len(up) == 2 and all(line.endswith(" 1.0") for line in up), up
        workers = [p for p in children if " worker " in command_of(p)]
        assert len(workers) == 2
        for worker in workers:  # each takes its share of the cores, not all of them
            threads = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
            assert f"OMP_NUM_THREADS={max(1, (os.cpu_count() or 1) // 2)}".encode() in threads
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + START_LIMIT_S
        while len(children_of(proc.pid)) < 5 or workers[0] in children_of(proc.pid):
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        assert "starting it again" in (tmp_path / "serve.log").read_text()
        statuses = []
        while len(statuses) < 10 or statuses[-10:] != [200] * 10:  # the other backend serves meanwhile
            assert time.monotonic() < deadline, statuses
            statuses.append(httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code)
        assert set(statuses) <= {200, 503}, statuses
        while '"event": "scheduler serving"' not in (tmp_path / "serve.log").read_text():  # on the new worker
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_gone(children + children_of(proc.pid), 30) == []
    finally:
        for pid in [proc.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_tensor_parallel_group_serves_and_a_crashed_rank_restarts_its_group(llama_dir, tmp_path):
    """Two ranks hold the model between them: the scheduler drives both, the tokens are the single
    worker's, and when one rank dies the other cannot go on alone: the launcher starts both again,
    meeting afresh, and the scheduler serves on them."""
    from pagedserve import LLM, SamplingParams

    expected = LLM(str(llama_dir)).generate({"prompt_token_ids": [5, 6, 7]},
                                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    proc, port = start_serve(llama_dir, tmp_path, "--tensor-parallel-size", "2", num_children=4)
    children = children_of(proc.pid)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0}
    try:
        from tests import patient_http as httpx

        def text() -> tuple[int, str | None]:
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            return reply.status_code, reply.json()["choices"][0]["text"] if reply.status_code == 200 else None

        assert text() == (200, expected[0].outputs[0].text)
        ranks = sorted((p for p in children if "--tensor-parallel-rank" in command_of(p)), key=command_of)
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        deadline = time.monotonic() + START_LIMIT_S
        while any(alive(p) for p in ranks) or "with the rest of worker" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.2)  # rank 0 leaves too (or is stopped): the group starts again as one
        while (status := text())[0] != 200:
            assert time.monotonic() < deadline and status[0] == 503, status
            time.sleep(0.5)
        assert status == (200, expected[0].outputs[0].text)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert wait_gone(children + children_of(proc.pid), 30) == []
    finally:
        for pid in [proc.pid, *children, *children_of(proc.pid)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_data_and_tensor_parallel_sizes_are_checked():
    from pagedserve.launcher import build_parser, worker_envs

    with pytest.raises(ValueError, match="data-parallel-size must be >= 1"):
        worker_envs(build_parser().parse_args(["--data-parallel-size", "0"]))
    with pytest.raises(ValueError, match="tensor-parallel-size must be >= 1"):
        worker_envs(build_parser().parse_args(["--tensor-parallel-size", "0"]))
    with pytest.raises(ValueError, match="leave device 'auto'"):
        worker_envs(build_parser().parse_args(["--data-parallel-size", "2", "--device", "cuda:1"]))
    assert worker_envs(build_parser().parse_args([])) == [{}]
    # Ranks and backends alike get equal shares of the cores.
    shares = worker_envs(build_parser().parse_args(["-dp", "2", "-tp", "2", "--device", "cpu"]))
    assert len(shares) == 4 and len({tuple(e.items()) for e in shares}) == 1


def test_disaggregation_flags_are_checked_before_any_child_starts():
    from pagedserve.launcher import build_parser, flags_error, worker_cpus, worker_envs

    serve = build_parser()
    assert "--decode-workers" in flags_error(serve.parse_args(["--prefill-workers", "1"]))
    assert "--tensor-parallel-size 1" in flags_error(serve.parse_args(["--prefill-workers", "1", "--decode-workers",
                                                                       "1", "-tp", "2"]))
    args = serve.parse_args(["--prefill-workers", "1", "--decode-workers", "1", "--device", "cpu"])
    assert flags_error(args) is None
    assert len(worker_envs(args)) == 2 == len(worker_cpus(args))
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:  # each worker on its own cores, none shared
        first, second = worker_cpus(args)
        assert first and second and not set(first) & set(second) and set(first) | set(second) <= set(cores)


def test_the_scheduler_takes_prefill_and_decode_workers_together_or_not_at_all(capfd):
    from services.scheduler.server import main

    for argv in (["--prefill-worker", "a:1"], ["--decode-worker", "a:1"],
                 ["--prefill-worker", "a:1", "--decode-worker", "b:1", "--worker", "c:1"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 1
        assert "--prefill-worker and --decode-worker" in capfd.readouterr().err
