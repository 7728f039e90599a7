"""`pagedserve serve`'s flags: every flag of the worker, the gateway and the scheduler, taken from their
own parsers (help, default, type and choices as they declare them), so that a flag added to a service
is served here with no change; and each child's command line from them."""

from __future__ import annotations

import argparse
import copy

from pagedserve.cli import ArgumentParser, apply_env_defaults

# Where each child listens and whom it talks to: chosen by the launcher, not by the user.
SET_BY_LAUNCHER = frozenset({"listen", "worker", "scheduler", "tensor_parallel_rank", "distributed_init_method"})
# Secrets reach the gateway in its environment: a command line is readable by anyone on the machine (ps).
PASSED_IN_ENVIRONMENT = frozenset({"api_key", "api_key_store"})

GROUPS = {
    "worker": "engine (every worker; the scheduler takes its limits too)",
    "gateway": "gateway",
    "scheduler": "scheduler (--connect-timeout and --drain-timeout above are the gateway's: the scheduler keeps "
                 "its own)",
}


def service_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each child's own parser, in the order their flags are listed (imported here: they are light)."""
    from services.gateway import server as gateway
    from services.scheduler import server as scheduler
    from services.worker import server as worker

    return {"worker": worker.build_parser(), "gateway": gateway.build_parser(), "scheduler": scheduler.build_parser()}


class ServeParser(ArgumentParser):
    """The launcher's parser; it knows which of its flags each child takes."""

    def __init__(self, description: str):
        super().__init__(prog="pagedserve serve", description=description, usage="%(prog)s [flags]",
                         epilog="Every flag may also be set in the environment: --max-num-seqs 8 as "
                                "PAGEDSERVE_MAX_NUM_SEQS=8 (a flag given wins).")
        self.owner: dict[str, str] = {}  # dest -> the first service that declared it
        self.forwarded: dict[str, list[argparse.Action]] = {}
        for service, parser in service_parsers().items():
            self.forwarded[service] = self._adopt(service, parser)
        launcher = self.add_argument_group("launcher")
        launcher.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                              help="schedulers, each with a worker (a GPU of its own, or a share of the CPU cores), "
                                   "behind the one gateway")
        launcher.add_argument("--startup-timeout", type=float, default=300.0,
                              help="seconds a child may take to become healthy (at start, and after a crash); "
                                   "one that takes longer is stopped and counts as a crash")
        apply_env_defaults(self)

    def _adopt(self, service: str, source: argparse.ArgumentParser) -> list[argparse.Action]:
        """Add the source's flags that are not here yet; return those this service is to be given. A flag that
        several services declare is the first one's: the engine's reach every service that has them (one
        configuration), while the gateway's and the scheduler's timeouts of the same name mean different things."""
        group = self.add_argument_group(GROUPS[service])
        forwarded = []
        for action in source._actions:  # argparse has no public way to list a parser's flags
            if not action.option_strings or action.dest in ("help", *SET_BY_LAUNCHER):
                continue
            if action.dest not in self.owner:
                self.owner[action.dest] = service
                group._add_action(copy.copy(action))  # a copy: our defaults (from the environment) are ours
            if self.owner[action.dest] in (service, "worker") and action.dest not in PASSED_IN_ENVIRONMENT:
                forwarded.append(self._action(action.dest))
        return forwarded

    def _action(self, dest: str) -> argparse.Action:
        return next(action for action in self._actions if action.dest == dest)

    def argv_for(self, service: str, args: argparse.Namespace) -> list[str]:
        """The command line that gives the service's flags the values in args."""
        return [part for action in self.forwarded[service] for part in flag_argv(action, getattr(args, action.dest))]


def flag_argv(action: argparse.Action, value) -> list[str]:
    """The words that set this flag to value on a child's command line ([]: none needed, or None: leave it
    to the child's default)."""
    flag = next(option for option in action.option_strings if option.startswith("--"))
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true / store_false: given or not
        return [flag] if value == action.const else []
    if isinstance(value, list):  # a repeatable flag, or one that takes several values
        return [part for item in value for part in (flag, str(item))]
    return [flag, str(value)]
