"""KV-cache data movement: new K/V into their slots (Triton), block copies (Triton), swaps (torch).

Pool layout (services/worker/kv_cache.py): one tensor ``[layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]``; per layer the K and V views ``[num_blocks, block_size, num_kv_heads,
head_dim]``. Within a block the elements of one (layer, K|V) are contiguous, which is what lets the
block copy kernel move a block as one flat run of elements.

The wrappers check what the kernels assume (dtype, device, shapes, contiguity of the innermost
dimensions) and pass every stride explicitly, so a view of the pool works as well as the pool.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from services.worker.block_moves import (  # noqa: F401  (swap_blocks, whole_pool: re-exported)
    SUPPORTED_DTYPES, BlockPairs, as_bytes, check_pairs, check_whole_pool, pairs_list, require, swap_blocks,
    whole_pool)

COPY_CHUNK = 1024  # elements one program moves per loop iteration of the block copy


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
    require(k_cache.dim() == 4, f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                                 f"got shape {tuple(k_cache.shape)}")
    require(v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                                             f"{tuple(k_cache.shape)}")
    require(v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides "
                                                   "(two views of one pool)")
    require(k_cache.stride(-1) == 1, "the pools' last dimension (head_dim) must be contiguous")
    require(k_cache.dtype in SUPPORTED_DTYPES, f"pool dtype {k_cache.dtype} is not one of {SUPPORTED_DTYPES}")
    require(v_cache.dtype == k_cache.dtype and v_cache.device == k_cache.device,
             "k_cache and v_cache must share dtype and device")


def _check_write_inputs(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    _check_layer_pools(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2:]
    for name, x in (("k", k), ("v", v)):
        require(x.dim() == 3 and x.shape[1:] == (num_kv_heads, head_dim),
                 f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}")
        require(x.stride(-1) == 1, f"{name}'s last dimension must be contiguous")
        require(x.dtype == k_cache.dtype, f"{name} dtype {x.dtype} != pool dtype {k_cache.dtype}")
        require(x.device == k_cache.device, f"{name} is on {x.device}, the pool on {k_cache.device}")
    require(k.shape[0] == v.shape[0] == slot_mapping.shape[0],
             f"k, v and slot_mapping disagree on the token count: {k.shape[0]}, {v.shape[0]}, "
             f"{slot_mapping.shape[0]}")
    require(slot_mapping.dim() == 1 and slot_mapping.dtype == torch.int64,
             f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    require(slot_mapping.device == k_cache.device, "slot_mapping must be on the pool's device")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, check: bool = True) -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots; slots < 0 are skipped.

    Same argument order as ``torch_ref.write_kv``. Slots past the pool's end are dropped too (a
    bounds check on the host would need a device sync every layer). ``check=False`` skips the
    host-side validation, for callers that validated the same shapes already this step.
    """
    if check:
        _check_write_inputs(k_cache, v_cache, k, v, slot_mapping)
    if k.shape[0] == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
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


def copy_blocks(pool: torch.Tensor, pairs: BlockPairs) -> None:
    """Copy block ``src`` to block ``dst`` for every pair, in every layer, K and V, in one launch.

    The pairs run in parallel, so no destination may also be a source (the order would matter);
    that is checked, as are the block ids, on the host: pass the plan's Python list.
    """
    check_whole_pool(pool)
    pairs = pairs_list(pairs)
    num_blocks = pool.shape[2]
    check_pairs(pairs, num_blocks, num_blocks)
    require(not {src for src, _ in pairs} & {dst for _, dst in pairs},
             "a block is both a source and a destination: copies run in parallel, so split them into two calls")
    if not pairs:
        return
    layers, _, _, block_size, heads, dim = pool.shape
    pairs_t = torch.tensor(pairs, dtype=torch.int64).to(pool.device, non_blocking=True)
    pool = as_bytes(pool)
    _copy_blocks_kernel[(len(pairs), layers, 2)](
        pool, pairs_t, pool.stride(0), pool.stride(1), pool.stride(2),
        BLOCK_NUMEL=block_size * heads * dim, CHUNK=COPY_CHUNK)
