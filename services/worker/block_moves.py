"""Block moves in plain torch: swaps between device and host pools, and copies within a pool.

Pools are whole pools ``[layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; one
indexing operation moves a block in every layer, K and V. The Triton block copy
(attention/triton_cache_ops.py) is the fast path on GPUs; this module needs no Triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # an FP8 KV cache: moved as bytes


def as_bytes(pool: torch.Tensor) -> torch.Tensor:
    """An FP8 pool as uint8 (indexing and copying need no float arithmetic); any other pool as it is."""
    return pool.view(torch.uint8) if pool.dtype in _FP8 else pool

BlockPairs = Sequence[tuple[int, int]] | torch.Tensor


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_whole_pool(pool: torch.Tensor, name: str = "pool") -> None:
    require(pool.dim() == 6, f"{name} must be the whole pool [layers, 2, num_blocks, block_size, num_kv_heads, "
                              f"head_dim], got shape {tuple(pool.shape)}")
    require(pool.shape[1] == 2, f"{name}'s second dimension must be 2 (K, V), got {pool.shape[1]}")
    _, _, _, block_size, heads, dim = pool.shape
    # The kernel moves a block as one flat run, so the innermost three dimensions must be packed.
    require(pool.stride(5) == 1 and pool.stride(4) == dim and pool.stride(3) == heads * dim,
             f"{name}'s [block_size, num_kv_heads, head_dim] dimensions must be contiguous, strides "
             f"{pool.stride()}")
    require(pool.dtype in SUPPORTED_DTYPES, f"{name} dtype {pool.dtype} is not one of {SUPPORTED_DTYPES}")


def pairs_list(pairs: BlockPairs) -> list[tuple[int, int]]:
    if isinstance(pairs, torch.Tensor):
        require(pairs.dim() == 2 and pairs.shape[1] == 2, f"pairs must be [num_pairs, 2], got {tuple(pairs.shape)}")
        pairs = pairs.tolist()
    return [(int(src), int(dst)) for src, dst in pairs]


def check_pairs(pairs: list[tuple[int, int]], num_src_blocks: int, num_dst_blocks: int) -> None:
    for src, dst in pairs:
        require(0 <= src < num_src_blocks, f"source block {src} is outside [0, {num_src_blocks})")
        require(0 <= dst < num_dst_blocks, f"destination block {dst} is outside [0, {num_dst_blocks})")
    dsts = [dst for _, dst in pairs]
    require(len(set(dsts)) == len(dsts), "a destination block appears twice: the result would depend on order")


def pair_indices(pairs: list[tuple[int, int]], src_device: torch.device, dst_device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sources and the destinations as int64 index tensors, each on its pool's device."""
    src_idx = torch.tensor([src for src, _ in pairs], dtype=torch.int64).to(src_device)
    dst_idx = torch.tensor([dst for _, dst in pairs], dtype=torch.int64).to(dst_device)
    return src_idx, dst_idx


def copy_blocks_torch(pool: torch.Tensor, pairs: BlockPairs) -> None:
    """Copy block ``src`` to ``dst`` for every pair, all layers. Gathers every source before writing,
    so a block may be both a source and a destination."""
    check_whole_pool(pool)
    pairs = pairs_list(pairs)
    check_pairs(pairs, pool.shape[2], pool.shape[2])
    if not pairs:
        return
    src_idx, dst_idx = pair_indices(pairs, pool.device, pool.device)
    pool = as_bytes(pool)
    pool.index_copy_(2, dst_idx, pool.index_select(2, src_idx))


def checked_swap_pairs(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: BlockPairs) -> list[tuple[int, int]]:
    """The pairs as a list, once both pools and every pair are valid for a swap between them."""
    check_whole_pool(src_pool, "src_pool")
    check_whole_pool(dst_pool, "dst_pool")
    require(src_pool.shape[:2] == dst_pool.shape[:2] and src_pool.shape[3:] == dst_pool.shape[3:],
             f"pools differ in per-block shape: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}")
    require(src_pool.dtype == dst_pool.dtype, f"pools differ in dtype: {src_pool.dtype} vs {dst_pool.dtype}")
    pairs = pairs_list(pairs)
    check_pairs(pairs, src_pool.shape[2], dst_pool.shape[2])
    return pairs


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: BlockPairs) -> None:
    """Copy block ``src`` of ``src_pool`` to block ``dst`` of ``dst_pool``, all layers, K and V.

    The pools are whole pools (``[layers, 2, num_blocks, ...]``) of the same per-block shape and dtype,
    usually one on the device and one in host memory. Plain torch indexing: one gather on the source
    device, one transfer, one scatter on the destination, whatever the number of layers. A Triton kernel
    cannot read pageable host memory, and the transfer dominates anyway. With a GPU the worker swaps
    through a page-locked buffer instead (swap_staging.py).
    """
    pairs = checked_swap_pairs(src_pool, dst_pool, pairs)
    if not pairs:
        return
    src_idx, dst_idx = pair_indices(pairs, src_pool.device, dst_pool.device)
    src_pool, dst_pool = as_bytes(src_pool), as_bytes(dst_pool)
    moved = src_pool.index_select(2, src_idx)  # [layers, 2, num_pairs, block_size, heads, dim]
    # Host to device may overlap with the host; device to host must finish before the host scatters.
    moved = moved.to(dst_pool.device, non_blocking=dst_pool.device.type == "cuda")
    dst_pool.index_copy_(2, dst_idx, moved)


def whole_pool(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The ``[layers, 2, blocks, ...]`` tensor behind allocate_kv_pools' per-layer (K, V) views."""
    base = kv_caches[0][0]._base
    require(base is not None and base.dim() == 6 and base.shape[0] == len(kv_caches),
             "kv_caches are not views of one [layers, 2, blocks, ...] pool tensor")
    require(all(k._base is base and v._base is base for k, v in kv_caches),
             "the per-layer views do not share one pool tensor")
    return base
