"""`pagedserve serve`: gateway, scheduler and one worker on this machine (or, with
--data-parallel-size N, N scheduler + worker pairs behind the gateway), as processes talking gRPC
over Unix sockets; waits until all are healthy, starts again a child that crashes, and on Ctrl-C
or SIGTERM drains and stops them in order (gateway, then schedulers, then workers)."""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.cli import ENGINE_KEYS, add_engine_args, apply_env_defaults

SCHEDULER_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                   "preemption_mode", "async_scheduling")
GATEWAY_FLAGS = ("host", "port", "grpc_port", "served_model_name", "tokenizer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP (OpenAI API) host")
    parser.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="public gRPC API port")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key every request must carry (see pagedserve gateway --help); repeatable")
    parser.add_argument("--api-key-store", default=None, help="Redis URL of the keys made with 'pagedserve api-keys'")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="the scheduler plans each step while the worker computes the one before")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="schedulers, each with a worker (a GPU of its own, or a share of the CPU cores), "
                             "behind the one gateway")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")
    apply_env_defaults(parser)
    return parser


def flags(args: argparse.Namespace, names) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):  # every boolean flag here is a --x / --no-x pair
            out.append(flag if value else "--no-" + flag[2:])
            continue
        out += [flag, str(value)]
    return out


def worker_argv(args: argparse.Namespace, address: str) -> list[str]:
    """Every engine option, the scheduler's limits too: the worker sizes activations, its KV pool and its
    CUDA graphs for the largest batch the scheduler may send."""
    return ["--listen", address] + flags(args, ENGINE_KEYS)


def gateway_secrets(args: argparse.Namespace) -> dict[str, str]:
    """API keys (and a key store URL, which may hold a password) go to the gateway in its environment:
    a command line is readable by anyone on the machine (ps)."""
    secrets = {}
    if args.api_key:
        if any("," in key for key in args.api_key):
            raise ValueError("an --api-key may not contain a comma")
        secrets["PAGEDSERVE_API_KEY"] = ",".join(args.api_key)
    if args.api_key_store:
        secrets["PAGEDSERVE_API_KEY_STORE"] = args.api_key_store
    return secrets


# A child that crashes is started again (the scheduler rebuilds its engine on a restarted worker,
# the gateway reconnects to a restarted scheduler), unless it crashed this often within a minute.
MAX_RESTARTS_PER_MINUTE = 3


@dataclass
class Child:
    """One process of the stack: what to run again should it crash."""
    label: str  # "worker", or "worker 1" with several backends
    command: str  # the pagedserve subcommand
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times


def backend_envs(args: argparse.Namespace) -> list[dict[str, str]]:
    """Per worker, what keeps data-parallel workers apart: a GPU each, or a share of the CPU cores."""
    n = args.data_parallel_size
    if n < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {n}")
    if n == 1:
        return [{}]
    if args.device not in ("auto", "cpu"):
        raise ValueError("with --data-parallel-size > 1 leave --device auto (each worker gets a GPU of its own) "
                         "or cpu")
    import torch

    gpus = torch.cuda.device_count() if args.device == "auto" else 0
    if gpus:
        if gpus < n:
            raise ValueError(f"--data-parallel-size {n} needs {n} GPUs; this machine shows {gpus}")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpus)]
        return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(n)]
    threads = max(1, (os.cpu_count() or 1) // n)  # else every worker takes every core
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(n)]


class Stack:
    """The processes (one gateway; a scheduler and a worker per backend); always stopped, in order,
    whatever happens."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.socket_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.children: dict[str, Child] = {}

    def start(self) -> None:
        args = self.args
        envs = backend_envs(args)
        schedulers = []
        for i, env in enumerate(envs):
            suffix = f" {i}" if len(envs) > 1 else ""
            worker = f"unix:{self.socket_dir}/worker{i}.sock"
            scheduler = f"unix:{self.socket_dir}/scheduler{i}.sock"
            self._spawn(Child("worker" + suffix, "worker", worker_argv(args, worker), env))
            self._wait_grpc_healthy("worker" + suffix, worker)
            self._spawn(Child("scheduler" + suffix, "scheduler",
                              ["--listen", scheduler, "--worker", worker] + flags(args, SCHEDULER_FLAGS), {}))
            self._wait_grpc_healthy("scheduler" + suffix, scheduler)
            schedulers += ["--scheduler", scheduler]
        self._spawn(Child("gateway", "gateway", schedulers + flags(args, GATEWAY_FLAGS), gateway_secrets(args)))
        self._wait_http_healthy("gateway", f"http://{args.host}:{args.port}/health")

    def _spawn(self, child: Child) -> None:
        cmd = [sys.executable, "-m", "pagedserve", child.command, *child.argv]
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children in order.
        # Should the launcher itself die (SIGKILL), the kernel sends the children SIGTERM: no orphans.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        child.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_terminate_with_parent)
        self.children[child.label] = child

    def _check_alive(self, name: str) -> None:
        code = self.children[name].proc.poll()
        if code is not None:
            raise RuntimeError(f"the {name} exited with code {code} while starting; see its log above")

    def _deadline(self) -> float:
        return time.monotonic() + self.args.startup_timeout

    def _wait_grpc_healthy(self, name: str, address: str) -> None:
        deadline = self._deadline()
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(name)
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"the {name} was not healthy within {self.args.startup_timeout:.0f} s")

    def _wait_http_healthy(self, name: str, url: str) -> None:
        deadline = self._deadline()
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the {name} was not healthy within {self.args.startup_timeout:.0f} s")

    def wait(self) -> str:
        """Block until a signal arrives or a child crash-loops (its name then); a child that crashes
        now and then is started again."""
        while True:
            for child in self.children.values():
                code = child.proc.poll()
                if code is None:
                    continue
                now = time.monotonic()
                child.crashes = [t for t in child.crashes if now - t < 60] + [now]
                if len(child.crashes) > MAX_RESTARTS_PER_MINUTE:
                    return child.label
                print(f"pagedserve: the {child.label} exited with code {code}; starting it again",
                      file=sys.stderr, flush=True)
                self._spawn(child)
            time.sleep(0.5)

    def stop(self) -> None:
        # A second Ctrl-C must not cut the ordered shutdown short and leave children behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for command in ("gateway", "scheduler", "worker"):  # front to back: stop intake, drain, release
            procs = [c.proc for c in self.children.values() if c.command == command and c.proc.poll() is None]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=40)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for leftover in os.listdir(self.socket_dir):
            os.unlink(os.path.join(self.socket_dir, leftover))
        os.rmdir(self.socket_dir)


def _terminate_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the launcher goes away."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: orderly stop() still covers the normal paths
        pass


PR_SET_PDEATHSIG = 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stack = Stack(args)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Installed explicitly: a launcher started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
        print(f"pagedserve is serving {args.model or 'the built-in default model'}:\n"
              f"  OpenAI API  http://{args.host}:{args.port}/v1\n"
              f"  gRPC API    {args.host}:{args.grpc_port}\n"
              f"  metrics     http://{args.host}:{args.port}/metrics\n"
              "Ctrl-C to stop.", flush=True)
        dead = stack.wait()
        print(f"pagedserve: the {dead} keeps crashing ({MAX_RESTARTS_PER_MINUTE + 1} times within a minute); "
              "shutting down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedserve: stopping (draining requests)", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
