"""The scheduler's options (`pagedserve scheduler`, the scheduler group of `pagedserve serve`), declared
once: their flags and PAGEDSERVE_* variables derive from here (shared/options.py). Its limits are the
engine's (shared/config.py): the worker must be given the same ones."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import EngineConfig
from shared.options import Option, option, options_of, read_by
from shared.tracing import TracingOptions


@dataclass(frozen=True)
class SchedulerOptions:
    listen: str = option("127.0.0.1:50051", "address to serve the scheduler API on")
    worker: list[str] | None = option(None, "worker address, host:port (default: 127.0.0.1:50061); repeated: the "
                                            "ranks of a tensor-parallel group, in order")
    # Prefill/decode disaggregation: given, the scheduler drives these workers instead of --worker's group.
    prefill_worker: list[str] | None = option(None, "a prefill worker's address (prefill/decode disaggregation: "
                                                    "prompts are computed there); repeated: several")
    decode_worker: list[str] | None = option(None, "a decode worker's address (with --prefill-worker: sequences "
                                                   "decode there, pulling their KV from the prefill worker); "
                                                   "repeated: several")
    async_scheduling: bool = option(True, "plan each step while the worker computes the one before")
    connect_timeout: float = option(60.0, "seconds to wait at start for the worker to answer")
    max_streams: int = option(1024, "concurrent gateway streams")
    drain_timeout: float = option(30.0, "seconds to let requests finish on stop")


def scheduler_options() -> tuple[Option, ...]:
    """Every option `pagedserve scheduler` takes: its own, the engine's limits, and tracing."""
    return options_of(SchedulerOptions) + read_by(EngineConfig, "scheduler") + options_of(TracingOptions)
