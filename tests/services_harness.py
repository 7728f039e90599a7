"""Start worker, scheduler and gateway as real processes on loopback, and always tear them down."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


_HANDED_OUT: set[int] = set()


def free_port(span: int = 1) -> int:
    """A free loopback port below the kernel's ephemeral range, never the same one twice (``span``: that
    many consecutive ones, the first returned).

    A port from bind(("", 0)) is ephemeral: between this check and the service's own bind, any
    outgoing connection (a client retrying a service that is not up yet) may take it as its local
    port, and the service then fails to start. Each pytest-xdist process draws from a share of the
    range of its own: the set of ports handed out is per process.
    """
    low = _ephemeral_range_start()
    start = max(1024, low - 12000)
    share = (low - start) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    start += share * int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(start, start + share - span + 1)
        ports = range(port, port + span)
        if any(p in _HANDED_OUT for p in ports) or not all(_bindable(p) for p in ports):
            continue
        _HANDED_OUT.update(ports)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as reply:
            status, raw = reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


# Limits that only bound a hung process, far above what a healthy run takes even beside other work on
# the same cores (a flaky test costs more than a slow failure): a service's start (seconds when idle),
# and a script a test runs to its end (under pytest's own per-test timeout, pyproject.toml).
START_LIMIT_S = 300.0
RUN_LIMIT_S = 480.0
POLL_S = 0.25


def wait_until_ready(ready: Callable[[], bool], procs: dict[str, subprocess.Popen], log_dir: Path, what: str,
                     timeout_s: float = START_LIMIT_S) -> None:
    """Returns once ``ready()`` says so (a check that fails to connect counts as not yet); fails at once,
    with its log's tail (``log_dir/<name>.log``), when one of ``procs`` exits first, and with every log's
    tail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}:\n"
                                   + log_tail(log_dir, name))
        try:
            if ready():
                return
        except OSError:
            pass  # not listening yet, or too busy to answer in time
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}:\n"
                               + "\n".join(log_tail(log_dir, name) for name in procs))
        time.sleep(POLL_S)


def grpc_serving(address: str) -> bool:
    """Whether the gRPC service at ``address`` says SERVING (a fresh channel: no reconnect backoff)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status \
                == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def log_tail(log_dir: Path, name: str, lines: int = 30) -> str:
    try:
        text = (log_dir / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        text = ["(no log)"]
    return f"--- {name} ---\n" + "\n".join(text[-lines:])


class Stack:
    """worker -> scheduler -> gateway; `with Stack(...) as stack:` or start()/stop()."""

    def __init__(self, model_dir: Path, log_dir: Path, worker_args: tuple[str, ...] = (),
                 gateway_args: tuple[str, ...] = (), scheduler_args: tuple[str, ...] = ()):
        self.model_dir, self.log_dir = Path(model_dir), Path(log_dir)
        self.worker_port, self.scheduler_port = free_port(), free_port()
        self.http_port, self.grpc_port = free_port(), free_port()
        self.worker_args, self.gateway_args, self.scheduler_args = worker_args, gateway_args, scheduler_args
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def model_name(self) -> str:
        """The id the gateway serves the model under (its directory's name)."""
        return self.model_dir.name

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler_port}"

    def _spawn(self, name: str, *args: str, command: str | None = None) -> None:
        """``pagedserve <command>`` (the name's, unless given) as service ``name``, its log in <name>.log."""
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        log = open(self.log_dir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "pagedserve", command or name, *args], cwd=REPO,
                                            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()  # the child holds its own copy

    def start(self, timeout_s: float = START_LIMIT_S, headers: dict[str, str] | None = None) -> "Stack":
        """headers: what a request needs to be served (an API key), for the readiness check."""
        # All three at once: the scheduler waits for its worker, the gateway learns the model lazily.
        self.start_worker()
        self.start_scheduler()
        self._spawn("gateway", "--port", str(self.http_port), "--grpc-port", str(self.grpc_port),
                    "--scheduler", self.scheduler_address, *self.gateway_args)
        return self._started(lambda: http_get(f"{self.base_url}/health", 5)[0] == 200 and
                             http_get(f"{self.base_url}/v1/models", 30, headers)[0] == 200,
                             "the stack to become healthy", timeout_s)

    def start_backend(self, timeout_s: float = START_LIMIT_S) -> "Stack":
        """Only the worker and the scheduler (for another stack's gateway to use); returns once the
        scheduler serves."""
        self.start_worker()
        self.start_scheduler()
        return self._started(lambda: grpc_serving(self.scheduler_address), "the scheduler to serve", timeout_s)

    def _started(self, ready: Callable[[], bool], what: str, timeout_s: float) -> "Stack":
        try:
            wait_until_ready(ready, self.procs, self.log_dir, what, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def start_worker(self) -> None:
        """The worker (again, after kill("worker"): on the same address)."""
        self._spawn("worker", "--model", str(self.model_dir), "--listen", f"127.0.0.1:{self.worker_port}",
                    *self.worker_args)

    def start_scheduler(self) -> None:
        """The scheduler (again, after kill("scheduler"): on the same address)."""
        self._spawn("scheduler", "--worker", f"127.0.0.1:{self.worker_port}", "--listen", self.scheduler_address,
                    *self.scheduler_args)

    def log_tail(self, name: str, lines: int = 30) -> str:
        return log_tail(self.log_dir, name, lines)

    def kill(self, name: str) -> None:
        """Kill one service abruptly (a crash, not a shutdown)."""
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self, timeout_s: float = 15.0) -> dict[str, int | None]:
        """SIGTERM front to back, then SIGKILL whatever is left; the exit codes by service."""
        for name in ("gateway", "scheduler", "worker", *self.procs):  # (then any other worker)
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return {name: proc.returncode for name, proc in self.procs.items()}

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
