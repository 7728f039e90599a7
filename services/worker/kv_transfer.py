"""Prefill/decode disaggregation on the worker: serving its KV blocks to another worker (ReadBlocks), and
pulling another worker's blocks into its own pools (a plan's pulls).

A prefill worker's blocks are read on the gRPC thread that serves the call, beside its compute: the
scheduler holds them until the decode worker's step that pulls them has come back, so nothing writes them
meanwhile. A decode worker starts fetching a plan's pulls the moment the plan arrives (usually while the
step before it still runs), and writes them into its pools on the compute thread when that step starts.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import structlog
import torch

from services.worker.block_moves import as_bytes, check_whole_pool, require
from shared.grpc_channels import channel_options
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import KVPull, StepPlan

log = structlog.get_logger(__name__)

CHUNK_BYTES = 4 << 20  # per BlockData message: far below gRPC's limit
# (A pull's chunks are held in host memory from its fetch to its step: a plan's pulls are one step's prompts.)
FETCH_TIMEOUT_S = 60.0  # a pull not read by then fails (its sequences are recomputed)
CHANNEL_OPTIONS = channel_options(64 << 20)  # room for CHUNK_BYTES, or one block larger than that


def _bytes_per_block(pool: torch.Tensor) -> int:
    return pool[:, :, 0].numel() * pool.element_size()


def read_blocks(pools: list[torch.Tensor], block_ids: list[int]) -> Iterator[wire.BlockData]:
    """The blocks' KV in every pool, as ReadBlocks streams it (ValueError for an id outside a pool)."""
    for index, pool in enumerate(pools):
        check_whole_pool(pool)
        for block_id in block_ids:
            require(0 <= block_id < pool.shape[2], f"block {block_id} is outside [0, {pool.shape[2]})")
        step = max(1, CHUNK_BYTES // _bytes_per_block(pool))
        raw = as_bytes(pool)
        for first in range(0, len(block_ids), step):
            ids = block_ids[first:first + step]
            run = raw.index_select(2, torch.tensor(ids, dtype=torch.int64, device=pool.device)).cpu()
            yield wire.BlockData(pool=index, first=first, count=len(ids),
                                 data=run.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def write_blocks(pools: list[torch.Tensor], pull: KVPull, chunks: list[wire.BlockData]) -> None:
    """Write a pull's fetched chunks into this worker's blocks (ValueError if they do not match its pools)."""
    destinations = [dst for _, dst in pull.moves]
    covered = [0] * len(pools)
    for chunk in chunks:
        require(chunk.pool < len(pools), f"the source sent pool {chunk.pool}; this worker has {len(pools)}")
        pool = pools[chunk.pool]
        require(chunk.first + chunk.count <= len(destinations), "the source sent more blocks than were asked for")
        require(len(chunk.data) == chunk.count * _bytes_per_block(pool),
                "the source's blocks differ in size from this worker's: the two must run the same model and "
                "KV cache configuration")
        raw = as_bytes(pool)
        with warnings.catch_warnings():  # the message's bytes are read-only, and only read: no copy of them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            moved = torch.frombuffer(chunk.data, dtype=torch.uint8).view(raw.dtype)
        moved = moved.view(*raw.shape[:2], chunk.count, *raw.shape[3:]).to(pool.device)
        ids = torch.tensor(destinations[chunk.first:chunk.first + chunk.count], dtype=torch.int64, device=pool.device)
        raw.index_copy_(2, ids, moved)
        covered[chunk.pool] += chunk.count
    require(all(count == len(destinations) for count in covered), "the source sent fewer blocks than were asked for")


class KVPuller:
    """A decode worker's pulls: fetched from the sources' ReadBlocks in the background, written by the step."""

    def __init__(self):
        self._channels: dict[str, grpc.Channel] = {}
        # By the plan (its id, and the plan itself: a plan of an earlier scheduler's stream with the same step id
        # is never taken for it): one fetch per pull of the plan, in order.
        self._fetches: dict[int, tuple[StepPlan, list[Future]]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")

    def prefetch(self, plan: StepPlan) -> None:
        """Start fetching the plan's pulls (any thread; once per plan)."""
        if not plan.pulls:
            return
        with self._lock:
            if id(plan) not in self._fetches:
                self._fetches[id(plan)] = (plan, [self._pool.submit(self._fetch, pull) for pull in plan.pulls])

    def pull(self, plan: StepPlan, pools: list[torch.Tensor]) -> set[int]:
        """Write the plan's pulls into the pools (the compute thread, as the step starts); returns the blocks of
        the pulls that failed (unreachable source, a broken stream, blocks of another shape)."""
        self.prefetch(plan)
        with self._lock:
            _, fetches = self._fetches.pop(id(plan))
        unfilled: set[int] = set()
        for pull, fetch in zip(plan.pulls, fetches):
            try:
                write_blocks(pools, pull, fetch.result(timeout=FETCH_TIMEOUT_S))
            except (grpc.RpcError, ValueError, RuntimeError, TimeoutError, OSError) as error:
                detail = error.details() if isinstance(error, grpc.RpcError) else str(error)
                log.error("kv_pull_failed", source=pull.source, blocks=len(pull.moves), error=detail)
                unfilled.update(dst for _, dst in pull.moves)
        return unfilled

    def _fetch(self, pull: KVPull) -> list[wire.BlockData]:
        stub = wire_grpc.WorkerStub(self._channel(pull.source))
        request = wire.BlockRead(block_ids=[src for src, _ in pull.moves])
        return list(stub.ReadBlocks(request, timeout=FETCH_TIMEOUT_S))

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
            return channel

    def forget(self) -> None:
        """A new scheduler starts from nothing: fetches for the old one's plans, never run, are dropped."""
        with self._lock:
            self._fetches.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
