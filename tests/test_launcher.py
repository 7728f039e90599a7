"""`pagedserve serve`: three processes up and healthy, and always all gone after a stop or a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.services_harness import free_port, http_get

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


def start_serve(model_dir: Path, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", "--model", str(model_dir), "--port", str(port),
                             "--grpc-port", str(free_port()), "--kv-cache-memory-bytes", str(8 << 20)],
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if http_get(f"http://127.0.0.1:{port}/health", 2)[0] == 200 and len(children_of(proc.pid)) == 3:
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
