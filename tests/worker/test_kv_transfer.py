"""Moving KV blocks between workers (kv_transfer.py): what ReadBlocks streams from one worker's pools is
written into another's, block for block, in every pool and dtype; a pull that fails leaves exactly its own
blocks unfilled; and a real gRPC ReadBlocks serves a worker's blocks."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from services.worker import kv_transfer
from services.worker.kv_transfer import KVPuller, read_blocks, write_blocks
from shared.grpc_errors import grpc_errors
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc
from shared.step_protocol import KVPull, StepPlan

SHAPE = (3, 2, 10, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


def random_pool(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(SHAPE, generator=generator)
    return pool.to(dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    """A destination pool full of NaN (0xFF bytes), so a block not written shows."""
    pool = torch.empty_like(like)
    pool.view(torch.uint8).fill_(0xFF)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 20])
def test_blocks_read_from_one_worker_are_written_into_another(dtype, chunk_bytes, monkeypatch):
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", chunk_bytes)  # one block per message, a few, all at once
    sources = [random_pool(dtype, 1), random_pool(dtype, 2)]  # the model's pool and a draft model's
    destinations = [poisoned(pool) for pool in sources]
    moves = [(7, 0), (2, 9), (2, 3), (0, 5)]  # any order; a source block may go to two places
    pull = KVPull("prefill", moves)
    write_blocks(destinations, pull, list(read_blocks(sources, [src for src, _ in moves])))
    for source, destination in zip(sources, destinations):
        raw_src, raw_dst = source.view(torch.uint8), destination.view(torch.uint8)
        for src, dst in moves:
            assert torch.equal(raw_dst[:, :, dst], raw_src[:, :, src])
        untouched = [b for b in range(SHAPE[2]) if b not in {dst for _, dst in moves}]
        assert (raw_dst[:, :, untouched] == 0xFF).all()


def test_blocks_of_another_shape_or_outside_the_pool_are_refused():
    source = random_pool(torch.float32, 3)
    with pytest.raises(ValueError, match="outside"):
        list(read_blocks([source], [10]))
    other = torch.zeros(3, 2, 10, 4, 2, 4)  # half the head size: another model
    with pytest.raises(ValueError, match="differ in size"):
        write_blocks([other], KVPull("prefill", [(1, 1)]), list(read_blocks([source], [1])))
    with pytest.raises(ValueError, match="fewer blocks"):
        write_blocks([source.clone()], KVPull("prefill", [(1, 1), (2, 2)]), list(read_blocks([source], [1])))


class BlockServer(wire_grpc.WorkerServicer):
    def __init__(self, pools):
        self.pools = pools

    def ReadBlocks(self, request, context):
        with grpc_errors(context):
            yield from read_blocks(self.pools, list(request.block_ids))


def test_a_pull_reads_over_grpc_and_a_failed_one_leaves_only_its_blocks_unfilled(tmp_path):
    source = random_pool(torch.float32, 4)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    wire_grpc.add_WorkerServicer_to_server(BlockServer([source]), server)
    address = f"unix:{tmp_path}/prefill.sock"
    server.add_insecure_port(address)
    server.start()
    puller = KVPuller()
    try:
        destination = poisoned(source)
        good, bad = KVPull(address, [(1, 2), (4, 6)]), KVPull(address, [(99, 7)])  # block 99: no such block
        unreachable = KVPull(f"unix:{tmp_path}/nobody.sock", [(3, 8)])
        plan = StepPlan(step_id=5, pulls=[good, bad, unreachable])
        puller.prefetch(plan)  # as the plan arrives; the step writes them
        assert puller.pull(plan, [destination]) == {7, 8}
        assert torch.equal(destination[:, :, 2], source[:, :, 1]) and torch.equal(destination[:, :, 6], source[:, :, 4])
        assert destination[:, :, [7, 8]].isnan().all()
    finally:
        puller.close()
        server.stop(None)
