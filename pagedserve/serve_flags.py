"""`pagedserve serve`'s flags: every option of the worker (the engine's), the gateway and the scheduler,
as each service declares them (shared/config.py, services/*/options.py), grouped by service, so that an
option added to a service is served here with no change; and each child's command line from them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.gateway.options import gateway_options
from services.scheduler.options import scheduler_options
from services.worker.options import worker_options
from shared.option_env import apply_env_defaults
from shared.option_flags import ArgumentParser, add_options
from shared.options import Option, command_line, option, options_of
from shared.tracing import TracingOptions

# Where each child listens and whom it talks to: chosen by the launcher, not by the user.
SET_BY_LAUNCHER = frozenset({"listen", "worker", "scheduler", "tensor_parallel_rank", "distributed_init_method",
                             "prefill_worker", "decode_worker"})

GROUPS = {
    "worker": "engine (every worker; the scheduler takes its limits too)",
    "gateway": "gateway",
    "scheduler": "scheduler",
}
# Options every child takes alike: one flag, listed in a group of its own rather than in the engine's.
EVERY_SERVICE = ("every service (gateway, scheduler and workers)", options_of(TracingOptions))


@dataclass(frozen=True)
class LauncherOptions:
    data_parallel_size: int = option(1, "schedulers, each with a worker (a GPU of its own, or a share of the CPU "
                                        "cores), behind the one gateway", short="-dp")
    prefill_workers: int = option(0, "prefill/decode disaggregation: workers that compute prompts, per scheduler "
                                     "(with --decode-workers; each a GPU of its own, or a share of the CPU cores)")
    decode_workers: int = option(0, "prefill/decode disaggregation: workers that decode, per scheduler, pulling "
                                    "each sequence's KV from the prefill worker that computed its prompt")
    startup_timeout: float = option(300.0, "seconds a child may take to become healthy (at start, and after a "
                                           "crash); one that takes longer is stopped and counts as a crash")


def service_options() -> dict[str, tuple[Option, ...]]:
    """Each child's options, in the order their groups are listed."""
    return {"worker": worker_options(), "gateway": gateway_options(), "scheduler": scheduler_options()}


class ServeParser(ArgumentParser):
    """The launcher's parser; it knows which of its flags each child takes."""

    def __init__(self, description: str):
        super().__init__(prog="pagedserve serve", description=description, usage="%(prog)s [flags]",
                         epilog="Every flag may also be set in the environment: --max-num-seqs 8 as "
                                "PAGEDSERVE_MAX_NUM_SEQS=8 (a flag given wins).")
        self.services = service_options()
        self.declared: dict[str, Option] = {}  # flag name -> the option it is: the first service's of that name
        self.owner: dict[str, str] = {}  # flag name -> that service
        title, shared = EVERY_SERVICE
        for o in shared:  # taken before the services' groups, which then leave them out
            self.declared[o.name], self.owner[o.name] = o, "every service"
        for service, options in self.services.items():
            self._add_group(service, options)
        add_options(self.add_argument_group(title), shared)
        add_options(self.add_argument_group("launcher"), options_of(LauncherOptions))
        apply_env_defaults(self)

    def _add_group(self, service: str, options: tuple[Option, ...]) -> None:
        """The service's options not here yet. An option several services take (the engine's) is one flag;
        a different option of a name already taken (the scheduler's --drain-timeout beside the gateway's)
        is left to its service's default, and the group says so."""
        shadowed = [o for o in options if o.name in self.declared and o.name not in SET_BY_LAUNCHER
                    and self.declared[o.name] != o]
        title = GROUPS[service]
        if shadowed:
            owners = sorted({self.owner[o.name] for o in shadowed})
            title += (f" ({' and '.join(o.flag for o in shadowed)} above are the {' and '.join(owners)}'s: the "
                      f"{service} keeps its own)")
        new = [o for o in options if o.name not in self.declared and o.name not in SET_BY_LAUNCHER]
        for o in new:
            self.declared[o.name], self.owner[o.name] = o, service
        add_options(self.add_argument_group(title), new)

    def options_for(self, service: str) -> list[Option]:
        """The service's options that serve passes on its command line: those whose flag here is that same
        option, but secrets (those reach the gateway in its environment: see launcher.gateway_secrets)."""
        return [o for o in self.services[service] if self.declared.get(o.name) == o and not o.secret]

    def argv_for(self, service: str, args: argparse.Namespace) -> list[str]:
        """The command line that gives the service's options the values in args."""
        return command_line(self.options_for(service), args)
