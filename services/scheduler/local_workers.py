"""Worker processes this process starts and stops: the offline API's tensor-parallel ranks.

Each rank of a tensor-parallel group is a process of its own (each joins torch.distributed), so
``LLM(tensor_parallel_size=N)`` starts N ``pagedserve worker`` processes on Unix sockets in a folder
of its own, drives them over gRPC as the scheduler service does, and stops them when the LLM is
closed or collected, or when this process exits (Linux sends them SIGTERM should it die). They run
in a session of their own, so a Ctrl-C meant for this process does not stop them, and they take
their configuration from the command line only (no PAGEDSERVE_* variables). Their logs go to files
in that folder; a rank that fails to start is reported with the end of its log.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.config import EngineConfig
from shared.grpc_channels import RECONNECT_OPTIONS
from shared.options import command_line, options_of


def process_environments(count: int, device: str) -> list[dict[str, str]]:
    """Per process of a group that shares the machine: a GPU each (CUDA_VISIBLE_DEVICES), or an equal
    share of the CPU cores (equal, so that tensor-parallel ranks compute alike)."""
    if count == 1:
        return [{}]
    if device not in ("auto", "cpu"):
        raise ValueError("with several workers on one machine leave device 'auto' (each gets a GPU of its own) "
                         "or 'cpu'")
    import torch

    gpus = torch.cuda.device_count() if device == "auto" else 0
    if gpus:
        if gpus < count:
            raise ValueError(f"{count} workers need {count} GPUs; this machine shows {gpus}")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
        return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(count)]
    threads = max(1, (os.cpu_count() or 1) // count)  # else every worker takes every core
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(count)]


def process_cpus(count: int, device: str) -> list[list[int] | None]:
    """Per process of a group that shares a CPU machine, the cores it is pinned to: an equal run each (so its
    threads stay on them and never preempt each other's); None: not pinned (one process, or GPUs)."""
    if count == 1 or device not in ("auto", "cpu"):
        return [None] * count
    import torch

    if device == "auto" and torch.cuda.device_count():
        return [None] * count
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    if share == 0:
        return [None] * count
    return [cores[i * share:(i + 1) * share] for i in range(count)]


def engine_flags(config: EngineConfig) -> list[str]:
    """The worker command line that gives a worker this config."""
    return command_line(options_of(EngineConfig), config)


def wait_grpc_serving(address: str, deadline: float, check_alive: Callable[[], None]) -> bool:
    """Whether the service at ``address`` says SERVING before ``deadline`` (monotonic); ``check_alive``
    raises when the process behind it has died meanwhile."""
    with grpc.insecure_channel(address, options=RECONNECT_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            check_alive()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


def terminate_with_parent() -> None:
    """In a child, before exec: ask Linux for SIGTERM when the parent goes away (no orphans)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the orderly paths still stop the children
        pass


PR_SET_PDEATHSIG = 1


def free_tcp_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalWorkerGroup:
    """The ranks of one tensor-parallel group, as child processes; ``addresses`` in rank order."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 300.0):
        size = config.tensor_parallel_size
        self.folder = Path(tempfile.mkdtemp(prefix="pagedserve-tp-"))
        self.addresses = [f"unix:{self.folder}/rank{rank}.sock" for rank in range(size)]
        self.procs: list[subprocess.Popen] = []
        meeting = f"tcp://127.0.0.1:{free_tcp_port()}"
        try:
            for rank, env in enumerate(process_environments(size, config.device)):
                argv = [sys.executable, "-m", "pagedserve", "worker", "--listen", self.addresses[rank],
                        "--tensor-parallel-rank", str(rank), "--distributed-init-method", meeting,
                        *engine_flags(config)]
                clean = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
                with open(self.folder / f"rank{rank}.log", "wb") as log:
                    self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                       env={**clean, "PYTHONUNBUFFERED": "1", **env},
                                                       start_new_session=True, preexec_fn=terminate_with_parent))
            self._wait_until_serving(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_until_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for rank, address in enumerate(self.addresses):
            def check_alive(rank=rank) -> None:
                if self.procs[rank].poll() is not None:
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {self.procs[rank].returncode} "
                                       f"while starting:\n{self.log_tail(rank)}")

            if not wait_grpc_serving(address, deadline, check_alive):
                raise TimeoutError(f"tensor-parallel rank {rank} did not serve within {timeout_s:.0f} s:\n"
                                   f"{self.log_tail(rank)}")

    def log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            return "\n".join((self.folder / f"rank{rank}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []
        shutil.rmtree(self.folder, ignore_errors=True)
