"""KV-cache data movement: new K/V into their slots (Triton), block copies (Triton), swaps (torch).

Pool layout (services/worker/kv_cache.py): one tensor ``[layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``; per layer the K and V views ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Within a block the elements of one (layer, K|V) are contiguous, which is what lets the
block copy kernel move a block as one flat run of elements.

The wrappers check what the kernels assume (dtype, device, shapes, contiguity of the innermost
dimensions) and pass every stride explicitly, so a view of the pool works as well as the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
COPY_CHUNK = 1024  # elements one program moves per loop iteration of the block copy

BlockPairs = Sequence[tuple[int, int]] | torch.Tensor


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# --- cache write ------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim] new keys
    v_ptr,  # [num_tokens, num_kv_heads, head_dim] new values
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] key pool of one layer
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] value pool of one layer
    slot_mapping_ptr,  # [num_tokens] int64: block * block_size + offset; < 0 means padding
    num_slots,  # num_blocks * block_size: slots past it are dropped rather than written out of bounds
    stride_kt, stride_kh,  # new keys: token, head (head_dim stride is 1)
    stride_vt, stride_vh,  # new values: token, head
    stride_cb, stride_cs, stride_ch,  # pools (K and V share strides): block, slot, head
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS (tile shapes are powers of two)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
):
    # One program per token: all its heads at once, one [heads, head_dim] tile each for K and V.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, DIM_PAD)
    # Padding tokens (slot < 0) are masked out instead of returning early: one code path, no branch.
    # The slot is broadcast to the tile first (the interpreter rejects scalar & tile masks).
    slots = slot + tl.zeros([HEADS_PAD, DIM_PAD], tl.int64)
    ok = (slots >= 0) & (slots < num_slots)
    mask = ok & (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    safe_slot = tl.where(ok, slots, 0)
    dst = (safe_slot // BLOCK_SIZE) * stride_cb + (safe_slot % BLOCK_SIZE) * stride_cs \
        + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _check_layer_pools(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _require(k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                                 f"got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                                             f"{tuple(k_cache.shape)}")
    _require(v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides "
                                                   "(two views of one pool)")
    _require(k_cache.stride(-1) == 1, "the pools' last dimension (head_dim) must be contiguous")
    _require(k_cache.dtype in SUPPORTED_DTYPES, f"pool dtype {k_cache.dtype} is not one of {SUPPORTED_DTYPES}")
    _require(v_cache.dtype == k_cache.dtype and v_cache.device == k_cache.device,
             "k_cache and v_cache must share dtype and device")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots; slots < 0 are skipped.

    Same argument order as ``torch_ref.write_kv``. Slots past the pool's end are dropped too (a
    bounds check on the host would need a device sync every layer).
    """
    _check_layer_pools(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for name, x in (("k", k), ("v", v)):
        _require(x.dim() == 3 and x.shape[1:] == (num_kv_heads, head_dim),
                 f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}")
        _require(x.stride(-1) == 1, f"{name}'s last dimension must be contiguous")
        _require(x.dtype == k_cache.dtype, f"{name} dtype {x.dtype} != pool dtype {k_cache.dtype}")
        _require(x.device == k_cache.device, f"{name} is on {x.device}, the pool on {k_cache.device}")
    _require(k.shape[0] == v.shape[0] == slot_mapping.shape[0],
             f"k, v and slot_mapping disagree on the token count: {k.shape[0]}, {v.shape[0]}, "
             f"{slot_mapping.shape[0]}")
    _require(slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64,
             f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _require(slot_mapping.device == k_cache.device, "slot_mapping must be on the pool's device")
    if k.shape[0] == 0:
        return
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, num_blocks * block_size,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim))


# --- block copy (copy-on-write) -----------------------------------------------------------------------


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,  # [layers, 2, num_blocks, block_size, num_kv_heads, head_dim] the whole pool
    pairs_ptr,  # [num_pairs, 2] int64: (src block, dst block), row-major contiguous
    stride_layer, stride_kv, stride_block,  # pool strides; a block's BLOCK_NUMEL elements are contiguous
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,
):
    # Grid: (pair, layer, K|V). Each program moves one block of one layer's K or V.
    pair = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    kv = tl.program_id(2).to(tl.int64)
    src = tl.load(pairs_ptr + 2 * pair)
    dst = tl.load(pairs_ptr + 2 * pair + 1)
    base = pool_ptr + layer * stride_layer + kv * stride_kv
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        values = tl.load(base + src * stride_block + offs, mask=mask)
        tl.store(base + dst * stride_block + offs, values, mask=mask)


def _check_whole_pool(pool: torch.Tensor, name: str = "pool") -> None:
    _require(pool.dim() == 6, f"{name} must be the whole pool [layers, 2, num_blocks, block_size, num_kv_heads, "
                              f"head_dim], got shape {tuple(pool.shape)}")
    _require(pool.shape[1] == 2, f"{name}'s second dimension must be 2 (K, V), got {pool.shape[1]}")
    _, _, _, block_size, heads, dim = pool.shape
    # The kernel moves a block as one flat run, so the innermost three dimensions must be packed.
    _require(pool.stride(5) == 1 and pool.stride(4) == dim and pool.stride(3) == heads * dim,
             f"{name}'s [block_size, num_kv_heads, head_dim] dimensions must be contiguous, strides "
             f"{pool.stride()}")
    _require(pool.dtype in SUPPORTED_DTYPES, f"{name} dtype {pool.dtype} is not one of {SUPPORTED_DTYPES}")


def _pairs_list(pairs: BlockPairs) -> list[tuple[int, int]]:
    if isinstance(pairs, torch.Tensor):
        _require(pairs.dim() == 2 and pairs.shape[1] == 2, f"pairs must be [num_pairs, 2], got {tuple(pairs.shape)}")
        pairs = pairs.tolist()
    return [(int(src), int(dst)) for src, dst in pairs]


def _check_pairs(pairs: list[tuple[int, int]], num_src_blocks: int, num_dst_blocks: int) -> None:
    for src, dst in pairs:
        _require(0 <= src < num_src_blocks, f"source block {src} is outside [0, {num_src_blocks})")
        _require(0 <= dst < num_dst_blocks, f"destination block {dst} is outside [0, {num_dst_blocks})")
    dsts = [dst for _, dst in pairs]
    _require(len(set(dsts)) == len(dsts), "a destination block appears twice: the result would depend on order")


def copy_blocks(pool: torch.Tensor, pairs: BlockPairs) -> None:
    """Copy block ``src`` to block ``dst`` for every pair, in every layer, K and V, in one launch.

    The pairs run in parallel, so no destination may also be a source (the order would matter);
    that is checked, as are the block ids, on the host: pass the plan's Python list.
    """
    _check_whole_pool(pool)
    pairs = _pairs_list(pairs)
    num_blocks = pool.shape[2]
    _check_pairs(pairs, num_blocks, num_blocks)
    _require(not {src for src, _ in pairs} & {dst for _, dst in pairs},
             "a block is both a source and a destination: copies run in parallel, so split them into two calls")
    if not pairs:
        return
    layers, _, _, block_size, heads, dim = pool.shape
    pairs_t = torch.tensor(pairs, dtype=torch.int64).to(pool.device, non_blocking=True)
    _copy_blocks_kernel[(len(pairs), layers, 2)](
        pool, pairs_t, pool.stride(0), pool.stride(1), pool.stride(2),
        BLOCK_NUMEL=block_size * heads * dim, CHUNK=COPY_CHUNK)


# --- swap (device <-> host) -----------------------------------------------------------------------------


def swap_blocks(src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: BlockPairs) -> None:
    """Copy block ``src`` of ``src_pool`` to block ``dst`` of ``dst_pool``, all layers, K and V.

    The pools are whole pools (``[layers, 2, num_blocks, ...]``) of the same per-block shape and dtype,
    usually one on the device and one in (ideally pinned) host memory. Plain torch indexing: one
    gather on the source device, one transfer, one scatter on the destination, whatever the number of
    layers. A Triton kernel cannot read pageable host memory, and the transfer dominates anyway.
    """
    _check_whole_pool(src_pool, "src_pool")
    _check_whole_pool(dst_pool, "dst_pool")
    _require(src_pool.shape[:2] == dst_pool.shape[:2] and src_pool.shape[3:] == dst_pool.shape[3:],
             f"pools differ in per-block shape: {tuple(src_pool.shape)} vs {tuple(dst_pool.shape)}")
    _require(src_pool.dtype == dst_pool.dtype, f"pools differ in dtype: {src_pool.dtype} vs {dst_pool.dtype}")
    pairs = _pairs_list(pairs)
    _check_pairs(pairs, src_pool.shape[2], dst_pool.shape[2])
    if not pairs:
        return
    src_idx = torch.tensor([src for src, _ in pairs], dtype=torch.int64).to(src_pool.device)
    dst_idx = torch.tensor([dst for _, dst in pairs], dtype=torch.int64).to(dst_pool.device)
    moved = src_pool.index_select(2, src_idx)  # [layers, 2, num_pairs, block_size, heads, dim]
    # Host to device may overlap with the host; device to host must finish before the host scatters.
    moved = moved.to(dst_pool.device, non_blocking=dst_pool.device.type == "cuda")
    dst_pool.index_copy_(2, dst_idx, moved)


def whole_pool(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The ``[layers, 2, blocks, ...]`` tensor behind allocate_kv_pools' per-layer (K, V) views."""
    base = kv_caches[0][0]._base
    _require(base is not None and base.dim() == 6 and base.shape[0] == len(kv_caches),
             "kv_caches are not views of one [layers, 2, blocks, ...] pool tensor")
    _require(all(k._base is base and v._base is base for k, v in kv_caches),
             "the per-layer views do not share one pool tensor")
    return base
