"""`pagedserve serve`: gateway, scheduler and one worker on this machine (or, with
--data-parallel-size N, N scheduler + worker pairs behind the gateway; with --tensor-parallel-size M,
M workers per scheduler, holding the model between them), as processes talking gRPC over Unix
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
import urllib.request
from dataclasses import dataclass, field

from pagedserve.cli import ENGINE_KEYS, add_engine_args, apply_env_defaults
from services.gateway.lora_modules import parse_lora_modules
from services.gateway.reasoning_parsers import REASONING_PARSERS, reasoning_flag_error
from services.gateway.tool_parsers import TOOL_CALL_PARSERS, flag_error
from services.scheduler.local_workers import (free_tcp_port, process_environments, terminate_with_parent,
                                              wait_grpc_serving)
from shared.lora import read_adapter_config

SCHEDULER_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                   "preemption_mode", "async_scheduling")
GATEWAY_FLAGS = ("host", "port", "grpc_port", "served_model_name", "tokenizer", "max_resumes", "resume_timeout",
                 "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "lora_modules",
                 "allow_runtime_lora_updating", "trust_request_chat_template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="HTTP (OpenAI API) host")
    parser.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="public gRPC API port")
    parser.add_argument("--served-model-name", nargs="+", action="extend", default=None,
                        help="model ids clients use (see pagedserve gateway --help)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key every request must carry (see pagedserve gateway --help); repeatable")
    parser.add_argument("--api-key-store", default=None, help="Redis URL of the keys made with 'pagedserve api-keys'")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="the scheduler plans each step while the worker computes the one before")
    parser.add_argument("--max-resumes", type=int, default=None,
                        help="times the gateway resumes a request whose worker or scheduler crashed (default 3; "
                             "0: such requests fail with 503)")
    parser.add_argument("--resume-timeout", type=float, default=None,
                        help="seconds a resumption waits for the restarted process (default 30)")
    parser.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                        help="answer tool_choice 'auto': the model's calls are read with --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS), default=None,
                        help="the model's tool-call format (see pagedserve gateway --help)")
    parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                        help="the model's reasoning format (see pagedserve gateway --help)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                        help="LoRA adapters served beside the model, each as name=path (see pagedserve gateway "
                             "--help); turns on --enable-lora")
    parser.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=None,
                        help="a chat request may bring its own chat_template (see pagedserve gateway --help)")
    parser.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction, default=None,
                        help="adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter); turns on "
                             "--enable-lora")
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
        if value is None or value == "":  # an empty variable (compose's default) is no value, not an empty one
            continue
        if isinstance(value, bool):  # every boolean flag here is a --x / --no-x pair
            out.append(flag if value else "--no-" + flag[2:])
            continue
        if isinstance(value, list):  # a repeatable flag
            out += [part for item in value for part in (flag, item)]
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
    label: str  # "worker", or "worker 1" with several backends, "worker 1 rank 0" with tensor parallelism
    command: str  # the pagedserve subcommand
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    crashes: list[float] = field(default_factory=list)  # monotonic times
    group: str | None = None  # a tensor-parallel group: its ranks stop and start together


def worker_envs(args: argparse.Namespace) -> list[dict[str, str]]:
    """Per worker (backend by backend, rank by rank), what keeps them apart: a GPU each, or an equal share
    of the CPU cores."""
    for flag in ("data_parallel_size", "tensor_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return process_environments(args.data_parallel_size * args.tensor_parallel_size, args.device)


class Stack:
    """The processes (one gateway; a scheduler and a worker per backend); always stopped, in order,
    whatever happens."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.socket_dir = tempfile.mkdtemp(prefix="pagedserve-")
        self.children: dict[str, Child] = {}

    def start(self) -> None:
        """Every worker starts at once (loading weights is most of a start); the schedulers and the
        gateway once all serve. The gateway waits for its schedulers by itself, so it starts with them."""
        args = self.args
        envs = worker_envs(args)
        tp = args.tensor_parallel_size
        backends = [self._spawn_workers("worker" + self._suffix(i), i, envs[i * tp:(i + 1) * tp])
                    for i in range(args.data_parallel_size)]
        for ranks in backends:
            for label, address in ranks:
                self._wait_grpc_healthy(label, address)
        schedulers = []
        for i, ranks in enumerate(backends):
            scheduler = f"unix:{self.socket_dir}/scheduler{i}.sock"
            workers = [flag for _, address in ranks for flag in ("--worker", address)]
            self._spawn(Child("scheduler" + self._suffix(i), "scheduler",
                              ["--listen", scheduler, *workers] + flags(args, SCHEDULER_FLAGS), {}))
            schedulers.append(scheduler)
        self._spawn(Child("gateway", "gateway", [flag for address in schedulers for flag in ("--scheduler", address)]
                          + flags(args, GATEWAY_FLAGS), gateway_secrets(args)))
        for i, scheduler in enumerate(schedulers):
            self._wait_grpc_healthy("scheduler" + self._suffix(i), scheduler)
        self._wait_http_healthy("gateway", f"http://{args.host}:{args.port}/health")

    def _suffix(self, backend: int) -> str:
        return f" {backend}" if self.args.data_parallel_size > 1 else ""

    def _spawn_workers(self, label: str, backend: int, envs: list[dict[str, str]]) -> list[tuple[str, str]]:
        """A backend's worker, or its tensor-parallel group (meeting at a TCP port of its own): each
        rank's label and address, in rank order."""
        if len(envs) == 1:
            address = f"unix:{self.socket_dir}/worker{backend}.sock"
            self._spawn(Child(label, "worker", worker_argv(self.args, address), envs[0]))
            return [(label, address)]
        meeting = f"tcp://127.0.0.1:{free_tcp_port()}"
        ranks = []
        for rank, env in enumerate(envs):
            address = f"unix:{self.socket_dir}/worker{backend}-rank{rank}.sock"
            argv = worker_argv(self.args, address) + ["--tensor-parallel-rank", str(rank),
                                                      "--distributed-init-method", meeting]
            self._spawn(Child(f"{label} rank {rank}", "worker", argv, env, group=label))
            ranks.append((f"{label} rank {rank}", address))
        return ranks

    def _restart_group(self, group: str) -> None:
        """A tensor-parallel group's ranks cannot go on without one of them: all start again, meeting
        at a new port."""
        members = [c for c in self.children.values() if c.group == group]
        for child in members:
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in members:
            try:
                child.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        meeting = f"tcp://127.0.0.1:{free_tcp_port()}"
        for child in members:
            child.argv[child.argv.index("--distributed-init-method") + 1] = meeting
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        cmd = [sys.executable, "-m", "pagedserve", child.command, *child.argv]
        # A session of its own: Ctrl-C reaches only the launcher, which stops the children in order.
        # Should the launcher itself die (SIGKILL), the kernel sends the children SIGTERM: no orphans.
        # A flag passed here is not read again from the environment: a list flag (--served-model-name,
        # --lora-modules) would take the variable's values and then the flag's.
        passed = {"PAGEDSERVE_" + arg[2:].replace("-", "_").upper() for arg in child.argv if arg.startswith("--")}
        env = {**{k: v for k, v in os.environ.items() if k not in passed}, "PYTHONUNBUFFERED": "1", **child.env}
        child.proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=terminate_with_parent)
        self.children[child.label] = child

    def _check_alive(self, name: str) -> None:
        code = self.children[name].proc.poll()
        if code is not None:
            raise RuntimeError(f"the {name} exited with code {code} while starting; see its log above")

    def _deadline(self) -> float:
        return time.monotonic() + self.args.startup_timeout

    def _wait_grpc_healthy(self, name: str, address: str) -> None:
        if not wait_grpc_serving(address, self._deadline(), lambda: self._check_alive(name)):
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
                print(f"pagedserve: the {child.label} exited with code {code}; starting it again"
                      + (f" with the rest of {child.group}" if child.group else ""), file=sys.stderr, flush=True)
                if child.group:
                    self._restart_group(child.group)
                else:
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


def lora_modules_error(entries: list[str], max_lora_rank: int) -> str | None:
    """What is wrong with the adapters (every process here sees their directories: read them now)."""
    try:
        for module in parse_lora_modules(entries):
            lora = module.lora
            rank = read_adapter_config(lora.path).rank
            if rank > max_lora_rank:
                return f"LoRA adapter {lora.name!r} has rank {rank}, above --max-lora-rank {max_lora_rank}"
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (error := flag_error(args.enable_auto_tool_choice, args.tool_call_parser)) is not None:  # before any child
        parser.error(error)
    if (error := reasoning_flag_error(args.reasoning_parser)) is not None:
        parser.error(error)
    if args.lora_modules or args.allow_runtime_lora_updating:
        args.enable_lora = True
    if args.lora_modules:
        if (error := lora_modules_error(args.lora_modules, args.max_lora_rank)) is not None:
            parser.error(error)
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
