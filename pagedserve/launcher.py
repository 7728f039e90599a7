"""`pagedserve serve`: gateway, scheduler and one worker on this machine (or, with
--data-parallel-size N, N scheduler + worker pairs behind the gateway; with --tensor-parallel-size M,
M workers per scheduler, holding the model between them; with --prefill-workers P --decode-workers D,
P workers computing prompts and D workers decoding, per scheduler), as processes talking gRPC over Unix
sockets; waits until all are healthy, starts again a child that crashes (a tensor-parallel group
all together), and on Ctrl-C or SIGTERM drains and stops them in order (gateway, then schedulers,
then workers)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pagedserve.preflight import lora_modules_error, model_error, port_taken_error, resolve_hub_ids
from pagedserve.serve_flags import ServeParser
from services.gateway.options import gateway_options
from services.gateway.server import arguments_error as gateway_arguments_error
from services.scheduler.local_workers import free_tcp_port, process_cpus, process_environments, terminate_with_parent
from shared.config import EngineConfig
from shared.healthcheck import grpc_healthy, http_healthy
from shared.options import refusal


def build_parser() -> ServeParser:
    return ServeParser(__doc__)


def worker_argv(parser: ServeParser, args: argparse.Namespace, address: str) -> list[str]:
    """Every engine option, the scheduler's limits too: the worker sizes activations, its KV pool and its
    CUDA graphs for the largest batch the scheduler may send."""
    return ["--listen", address] + parser.argv_for("worker", args)


def gateway_secrets(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's secrets (API keys, and a key store URL, which may hold a password) go to it in its
    environment, as its variables: a command line is readable by anyone on the machine (ps)."""
    secrets = {}
    for option in gateway_options():
        if not option.secret or not (value := getattr(args, option.name)):
            continue
        if option.kind is list:  # the variable holds them comma-separated
            if any("," in item for item in value):
                raise ValueError(f"an {option.flag} may not contain a comma")
            value = ",".join(value)
        secrets[option.env] = value
    return secrets


# A child that crashes is started again (the scheduler rebuilds its engine on a restarted worker,
# the gateway reconnects to a restarted scheduler), unless it crashed this often within a minute, or
# failed this many starts in a row (one that hangs at start fails once per --startup-timeout, never
# four times a minute). One that is not healthy within --startup-timeout of its start counts as a crash.
MAX_RESTARTS_PER_MINUTE = 3
MAX_FAILED_STARTS = 3


STOP_ORDER = ("gateway", "scheduler", "worker")  # front to back: stop intake, drain, release
STOP_WAIT_S = 40.0  # what each child gets to stop after SIGTERM before it is killed


@dataclass
class Child:
    """One process of the stack: what to run again should it crash, and how to tell it is up."""
    label: str  # "worker", or "worker 1" with several backends, "worker 1 rank 0" with tensor parallelism
    command: str  # the pagedserve subcommand
    argv: list[str]
    env: dict[str, str]
    health: tuple[str, str]  # as shared.healthcheck takes it: ("grpc", address) or ("http", url)
    proc: subprocess.Popen | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times
    failed_starts: int = 0  # failures in a row, each before it was healthy
    group: str | None = None  # a tensor-parallel group: its ranks stop and start together
    started: float = 0.0  # monotonic time of its latest start
    healthy: bool = False  # has been healthy since its latest start
    scheduler_flag: str = "--worker"  # a worker: how its scheduler is told of it (a prefill or decode worker's own)
    cpus: list[int] | None = None  # the cores it is pinned to (workers sharing a CPU machine); None: not pinned

    def is_healthy(self) -> bool:
        kind, where = self.health
        return grpc_healthy(where) if kind == "grpc" else http_healthy(where)


def local_url(host: str, port: int, path: str) -> str:
    """A URL to reach, from this machine, a server listening on host (a wildcard address included)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}{path}"


def is_disaggregated(args: argparse.Namespace) -> bool:
    return bool(args.prefill_workers or args.decode_workers)


def workers_per_backend(args: argparse.Namespace) -> int:
    return args.prefill_workers + args.decode_workers if is_disaggregated(args) else args.tensor_parallel_size


def worker_envs(args: argparse.Namespace) -> list[dict[str, str]]:
    """Per worker (backend by backend, rank by rank, or prefill workers then decode workers), what keeps them
    apart: a GPU each, or an equal share of the CPU cores."""
    for flag in ("data_parallel_size", "tensor_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if is_disaggregated(args):
        if args.prefill_workers < 1 or args.decode_workers < 1:
            raise ValueError("prefill/decode disaggregation needs --prefill-workers and --decode-workers, each >= 1")
        if args.tensor_parallel_size > 1:
            raise ValueError("prefill/decode disaggregation runs one worker per stage: leave --tensor-parallel-size 1")
    return process_environments(args.data_parallel_size * workers_per_backend(args), args.device)


def worker_cpus(args: argparse.Namespace) -> list[list[int] | None]:
    """Per worker, in worker_envs' order, the cores it is pinned to (workers sharing a CPU machine)."""
    return process_cpus(args.data_parallel_size * workers_per_backend(args), args.device)


class Stack:
    """The processes (one gateway; a scheduler and a worker per backend); always stopped, in order,
    whatever happens."""

    def __init__(self, args: argparse.Namespace, parser: ServeParser):
        self.args = args
        self.parser = parser
        self.program = [sys.executable, "-m", "pagedserve"]  # then a child's subcommand and flags
        self.socket_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.children: dict[str, Child] = {}

    def start(self) -> None:
        """Every worker starts at once (loading weights is most of a start); the schedulers and the
        gateway once all serve. The gateway waits for its schedulers by itself, so it starts with them."""
        args = self.args
        envs, cpus = worker_envs(args), worker_cpus(args)
        per = workers_per_backend(args)
        spawn = self._spawn_stages if is_disaggregated(args) else self._spawn_workers
        backends = [spawn("worker" + self._suffix(i), i, envs[i * per:(i + 1) * per], cpus[i * per:(i + 1) * per])
                    for i in range(args.data_parallel_size)]
        for ranks in backends:
            for child in ranks:
                self._wait_healthy(child)
        schedulers = []
        for i, ranks in enumerate(backends):
            address = f"unix:{self.socket_dir}/scheduler{i}.sock"
            workers = [flag for child in ranks for flag in (child.scheduler_flag, child.health[1])]
            schedulers.append(self._spawn(Child("scheduler" + self._suffix(i), "scheduler",
                                                ["--listen", address, *workers] + self.parser.argv_for("scheduler", args),
                                                {}, ("grpc", address))))
        gateway = self._spawn(Child("gateway", "gateway",
                                    [flag for s in schedulers for flag in ("--scheduler", s.health[1])]
                                    + self.parser.argv_for("gateway", args), gateway_secrets(args),
                                    ("http", local_url(args.host, args.port, "/health"))))
        for child in [*schedulers, gateway]:
            self._wait_healthy(child)

    def _suffix(self, backend: int) -> str:
        return f" {backend}" if self.args.data_parallel_size > 1 else ""

    def _spawn_workers(self, label: str, backend: int, envs: list[dict[str, str]],
                       cpus: list[list[int] | None]) -> list[Child]:
        """A backend's worker, or its tensor-parallel group (meeting at a TCP port of its own), in rank order."""
        if len(envs) == 1:
            address = f"unix:{self.socket_dir}/worker{backend}.sock"
            return [self._spawn(Child(label, "worker", worker_argv(self.parser, self.args, address), envs[0],
                                      ("grpc", address), cpus=cpus[0]))]
        meeting = f"tcp://127.0.0.1:{free_tcp_port()}"
        ranks = []
        for rank, env in enumerate(envs):
            address = f"unix:{self.socket_dir}/worker{backend}-rank{rank}.sock"
            argv = worker_argv(self.parser, self.args, address) + ["--tensor-parallel-rank", str(rank),
                                                                   "--distributed-init-method", meeting]
            ranks.append(self._spawn(Child(f"{label} rank {rank}", "worker", argv, env, ("grpc", address),
                                           group=label, cpus=cpus[rank])))
        return ranks

    def _spawn_stages(self, label: str, backend: int, envs: list[dict[str, str]],
                      cpus: list[list[int] | None]) -> list[Child]:
        """A backend's prefill workers, then its decode workers. Each restarts alone; meanwhile its scheduler's
        engine has failed, and rebuilds on all of them once they answer (the gateway resumes the requests)."""
        children = []
        for i, env in enumerate(envs):
            role, number = ("prefill", i) if i < self.args.prefill_workers else ("decode", i - self.args.prefill_workers)
            address = f"unix:{self.socket_dir}/worker{backend}-{role}{number}.sock"
            children.append(self._spawn(Child(f"{label} ({role} {number})", "worker",
                                              worker_argv(self.parser, self.args, address), env, ("grpc", address),
                                              scheduler_flag=f"--{role}-worker", cpus=cpus[i])))
        return children

    def _restart(self, child: Child) -> None:
        """A child starts again; a tensor-parallel group's ranks cannot go on without one of them: all start
        again, meeting at a new port."""
        members = [c for c in self.children.values() if c.group == child.group] if child.group else [child]
        for member in members:
            if member.proc.poll() is None:
                member.proc.terminate()
        for member in members:
            try:
                member.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                member.proc.kill()
                member.proc.wait()
        meeting = f"tcp://127.0.0.1:{free_tcp_port()}"
        for member in members:
            if member.group:
                member.argv[member.argv.index("--distributed-init-method") + 1] = meeting
            self._spawn(member)

    def _spawn(self, child: Child) -> Child:
        cmd = [*self.program, child.command, *child.argv]
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children in order.
        # Should the launcher itself die (SIGKILL), the kernel sends the children SIGTERM: no orphans.
        # The child reads the PAGEDSERVE_* variables too, but a flag passed here wins over its variable
        # (a list flag's values replace the variable's: shared/option_flags.py).
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
        cpus = child.cpus

        def before_exec() -> None:
            terminate_with_parent()
            if cpus:  # its threads stay on its own cores
                os.sched_setaffinity(0, cpus)

        child.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=before_exec)
        child.started, child.healthy = time.monotonic(), False
        self.children[child.label] = child
        return child

    def _wait_healthy(self, child: Child) -> None:
        deadline = time.monotonic() + self.args.startup_timeout
        while time.monotonic() < deadline:
            code = child.proc.poll()
            if code is not None:
                raise RuntimeError(f"the {child.label} exited with code {code} while starting; see its log above")
            if child.is_healthy():
                child.healthy = True
                return
            time.sleep(0.2)
        raise TimeoutError(f"the {child.label} was not healthy within {self.args.startup_timeout:g} s")

    def wait(self) -> str:
        """Block until a signal arrives or a child crash-loops (its name then)."""
        while (label := self.watch()) is None:
            time.sleep(0.5)
        return label

    def watch(self) -> str | None:
        """One look at every child: one that failed is started again, unless it keeps failing (its label
        then)."""
        for child in list(self.children.values()):
            failure = self._failure(child)
            if failure is None:
                continue
            now = time.monotonic()
            child.crashes = [t for t in child.crashes if now - t < 60] + [now]
            child.failed_starts = 0 if child.healthy else child.failed_starts + 1
            if len(child.crashes) > MAX_RESTARTS_PER_MINUTE or child.failed_starts > MAX_FAILED_STARTS:
                return child.label
            print(f"pagedserve: the {child.label} {failure}; starting it again"
                  + (f" with the rest of {child.group}" if child.group else ""), file=sys.stderr, flush=True)
            self._restart(child)
        return None

    def _failure(self, child: Child) -> str | None:
        """How the child failed: it exited, or it has not been healthy within --startup-timeout of its start
        (a worker stuck loading would otherwise keep the stack at 503 for good). None: it is fine."""
        code = child.proc.poll()
        if code is not None:
            return f"exited with code {code}"
        if not child.healthy and child.is_healthy():
            child.healthy = True
        if child.healthy or time.monotonic() - child.started <= self.args.startup_timeout:
            return None
        return f"was not healthy within {self.args.startup_timeout:g} s of its start"

    def stop(self) -> None:
        # A second Ctrl-C must not cut the ordered shutdown short and leave children behind.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for command in STOP_ORDER:
            procs = [c.proc for c in self.children.values() if c.command == command and c.proc.poll() is None]
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for leftover in os.listdir(self.socket_dir):
            os.unlink(os.path.join(self.socket_dir, leftover))
        os.rmdir(self.socket_dir)


def flags_error(args: argparse.Namespace) -> str | None:
    """What a child would refuse in its flags (None: nothing), found before any child starts."""
    if (error := gateway_arguments_error(args)) is not None:
        return error
    if (error := refusal(EngineConfig, args)) is not None:
        return error
    try:
        worker_envs(args)
    except ValueError as exc:
        return str(exc)
    if args.lora_modules:
        return lora_modules_error(args.lora_modules, args.max_lora_rank)
    return None


def machine_error(args: argparse.Namespace) -> str | None:
    """What on this machine would stop a child (None: nothing found): the model directory, a port in use."""
    if args.port == args.grpc_port:
        return f"--port and --grpc-port are both {args.port}"
    return (model_error(args) or port_taken_error(args.host, args.port, "--port (HTTP)")
            or port_taken_error(args.host, args.grpc_port, "--grpc-port"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.lora_modules or args.allow_runtime_lora_updating:
        args.enable_lora = True
    if (error := flags_error(args)) is not None:
        parser.error(error)
    if (error := resolve_hub_ids(args) or machine_error(args)) is not None:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 1
    stack = Stack(args, parser)

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
        print(f"pagedserve: the {dead} keeps failing ({MAX_RESTARTS_PER_MINUTE + 1} times within a minute, or "
              f"{MAX_FAILED_STARTS + 1} starts in a row); shutting down", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pagedserve: stopping (draining requests)", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
