"""`pagedserve serve`: its processes up and healthy, a crashed one started again, and always all gone
after a stop or a crash of the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services_harness import START_LIMIT_S, free_port, http_get

REPO = Path(__file__).resolve().parents[1]


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
    # The worker sizes activations, its KV pool and its CUDA graphs for the scheduler's limits: a worker
    # that kept the defaults while the scheduler ran 512 sequences would under-count its memory.
    from pagedserve.cli import engine_options
    from pagedserve.launcher import build_parser, worker_argv
    from services.worker import server as worker_server

    args = build_parser().parse_args(["--max-num-seqs", "7", "--max-num-batched-tokens", "300", "--enforce-eager",
                                      "--no-enable-chunked-prefill", "--block-size", "8", "--max-model-len", "300"])
    argv = worker_argv(args, "unix:/tmp/w.sock")
    worker_args = worker_server.build_parser().parse_args(argv)
    assert worker_args.listen == "unix:/tmp/w.sock"
    assert engine_options(worker_args) == engine_options(args)
    assert (worker_args.max_num_seqs, worker_args.enforce_eager, worker_args.enable_chunked_prefill) == (7, True, False)


def test_the_gateway_gets_its_options():
    from pagedserve.launcher import GATEWAY_FLAGS, build_parser, flags
    from services.gateway import server as gateway_server

    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-resumes", "1"])
    gateway_args = gateway_server.build_parser().parse_args(flags(args, GATEWAY_FLAGS))
    assert (gateway_args.enable_auto_tool_choice, gateway_args.tool_call_parser, gateway_args.max_resumes) == \
        (True, "hermes", 1)
    assert not gateway_server.build_parser().parse_args(flags(build_parser().parse_args([]), GATEWAY_FLAGS)) \
        .enable_auto_tool_choice


def command_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_data_parallel_backends_serve_and_a_crashed_worker_is_started_again(llama_dir, tmp_path):
    proc, port = start_serve(llama_dir, tmp_path, "--data-parallel-size", "2", num_children=5)
    children = children_of(proc.pid)
    base = f"http://127.0.0.1:{port}"
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    try:
        import httpx2 as httpx

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
        import httpx2 as httpx

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
