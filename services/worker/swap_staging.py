"""Swaps between a GPU's KV pool and the host pool, through a reused page-locked staging buffer.

A copy between the device and pageable memory blocks the host while the driver stages it through
small pinned chunks of its own, and a fresh pageable tensor per swap first faults in every page. From
page-locked memory the copy is one DMA at the link's speed, and host to device does not block the
host. The host pool itself stays pageable: a swap's blocks are scattered over it, so the host side
gathers them into the buffer (swap in) or scatters them out of it (swap out) either way.

The buffer grows (doubling) up to ``max_bytes``; a larger swap goes in pieces of whole blocks, so the
page-locked memory stays bounded (about twice ``max_bytes`` with what torch's host allocator keeps of
the smaller buffers it replaced). Before the buffer is rewritten, the last host-to-device copy out of
it must be done, which an event marks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.worker.block_moves import BlockPairs, as_bytes, checked_swap_pairs, pair_indices

STAGING_MAX_BYTES = 256 << 20


class SwapStaging:
    def __init__(self, pin: bool, max_bytes: int = STAGING_MAX_BYTES):
        self.pin = pin  # False: plain memory (a CPU-only build cannot pin; the logic is the same)
        self.max_bytes = max_bytes
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._in_flight: torch.cuda.Event | None = None

    def swap_out(self, device_pool: torch.Tensor, host_pool: torch.Tensor, pairs: BlockPairs) -> None:
        """Device blocks to host blocks: a gather on the device, one copy into the buffer (waited for,
        as the host reads it next), a scatter into the host pool."""
        pairs = checked_swap_pairs(device_pool, host_pool, pairs)
        device_pool, host_pool = as_bytes(device_pool), as_bytes(host_pool)
        for piece in self._pieces(pairs, device_pool):
            src_idx, dst_idx = pair_indices(piece, device_pool.device, host_pool.device)
            staged = self._take(device_pool, len(piece))
            staged.copy_(device_pool.index_select(2, src_idx))
            host_pool.index_copy_(2, dst_idx, staged)

    def swap_in(self, host_pool: torch.Tensor, device_pool: torch.Tensor, pairs: BlockPairs) -> None:
        """Host blocks to device blocks: a gather into the buffer, an asynchronous copy to the device,
        a scatter there (queued behind the copy on the same stream)."""
        pairs = checked_swap_pairs(host_pool, device_pool, pairs)
        host_pool, device_pool = as_bytes(host_pool), as_bytes(device_pool)
        for piece in self._pieces(pairs, host_pool):
            src_idx, dst_idx = pair_indices(piece, host_pool.device, device_pool.device)
            staged = self._take(host_pool, len(piece))
            torch.index_select(host_pool, 2, src_idx, out=staged)
            moved = staged.to(device_pool.device, non_blocking=True)
            self._mark_read_by(device_pool.device)
            device_pool.index_copy_(2, dst_idx, moved)

    def _pieces(self, pairs: list[tuple[int, int]], pool: torch.Tensor) -> Iterator[list[tuple[int, int]]]:
        per_piece = max(1, self.max_bytes // _block_bytes(pool))
        for first in range(0, len(pairs), per_piece):
            yield pairs[first:first + per_piece]

    def _take(self, pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` of ``pool``'s blocks' worth of buffer, once nothing reads the buffer any more."""
        if self._in_flight is not None:
            self._in_flight.synchronize()
            self._in_flight = None
        nbytes = num_blocks * _block_bytes(pool)
        if self._buffer.numel() < nbytes:
            size = max(nbytes, min(2 * self._buffer.numel(), self.max_bytes))
            self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        shape = pool.shape[:2] + (num_blocks,) + pool.shape[3:]  # [layers, 2, num_blocks, block_size, heads, dim]
        return self._buffer[:nbytes].view(pool.dtype).view(shape)

    def _mark_read_by(self, device: torch.device) -> None:
        """A copy out of the buffer was queued on ``device``'s current stream."""
        if device.type == "cuda":
            self._in_flight = torch.cuda.Event()
            self._in_flight.record(torch.cuda.current_stream(device))


def _block_bytes(pool: torch.Tensor) -> int:
    """One block of a whole pool: every layer, K and V."""
    return pool[:, :, 0].numel() * pool.element_size()
