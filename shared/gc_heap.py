"""Keep the garbage collector off what a service builds at start-up.

A service's start-up objects (tokenizer, model, libraries, protobuf descriptors) live as long as
the process, yet every full collection walks all of them again; per token the gateway allocates
enough to trigger collections often. Freezing them after start-up (as vLLM does for its server
and engine) moves them out of the collector's reach: the gateway's CPU per streamed token fell by
~12 % here (benchmarks/gateway_overhead.py). Objects made later are collected as usual.

At shutdown they are handed back (``unfreeze_startup_objects``): the interpreter's final collection
skips frozen objects, and extension modules built on nanobind (Triton's, which torch imports) then
print every object of theirs still alive as a leak, some thirty lines per exit.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_objects() -> None:
    """Collect once, then exempt everything alive now from future collections."""
    gc.collect()
    gc.freeze()


def unfreeze_startup_objects() -> None:
    """Undo ``freeze_startup_objects`` before the process exits, so its objects are freed as usual."""
    gc.unfreeze()


@contextlib.contextmanager
def heap_frozen_while_running() -> Iterator[None]:
    """Exempt what is alive on entry from collections until the block ends (offline ``LLM.generate``: the full
    collections of a bench run walked the model, tokenizer and libraries again, ~1 % of its time). Garbage made
    meanwhile is collected as usual; whatever was frozen on entry and died is collected after. Where something
    froze objects already (a service's start-up), nothing changes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
