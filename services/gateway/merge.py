"""The deltas of a request's runs (one per prompt) as one stream, in the order they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.deltas import SeqDelta
from services.gateway.run import Run


def merge(runs: list[Run]) -> AsyncIterator[SeqDelta]:
    """The deltas of several runs as they come (each carries its run's position); a single run is
    iterated directly, without a task or a queue in between."""
    if len(runs) == 1:
        return runs[0].__aiter__()
    return _merged(runs)


async def _merged(runs: list[Run]) -> AsyncIterator[SeqDelta]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run) -> None:
        try:
            async for delta in run:
                await queue.put(delta)
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(run)) for run in runs]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if item is None:
                pending -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:  # a client that went away: each run's finally aborts it at the scheduler
            task.cancel()
