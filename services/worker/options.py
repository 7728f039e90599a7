"""The worker's options (`pagedserve worker`), declared once: every engine option (shared/config.py),
and where this worker listens and meets its tensor-parallel peers."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import EngineConfig
from shared.options import Option, option, options_of
from shared.tracing import TracingOptions


@dataclass(frozen=True)
class WorkerOptions:
    listen: str = option("127.0.0.1:50061", "address to serve the worker API on")
    tensor_parallel_rank: int = option(0, "this worker's rank among the --tensor-parallel-size workers sharing "
                                          "the model")
    distributed_init_method: str | None = option(None, "where the tensor-parallel ranks meet, the same for all: "
                                                       "tcp://host:port (rank 0 listens there)")


def worker_options() -> tuple[Option, ...]:
    """Every option `pagedserve worker` takes: all the engine's, then its own, and tracing."""
    return options_of(EngineConfig) + options_of(WorkerOptions) + options_of(TracingOptions)
