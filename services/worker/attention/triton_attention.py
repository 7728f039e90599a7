"""Paged attention in Triton: one kernel for a mixed batch of prefill chunks and decodes.

Every sequence's context is its cached tokens followed by its new tokens, and all of it is read from
the paged pool: the backend first stores the new K/V with the cache-write kernel, so the attention
kernel needs no second source for them. A query token at position ``p`` sees keys ``0..p`` (causal
within the new tokens, everything before them), or with a sliding window (``SLIDING``) keys
``p - window + 1..p``: a tile's loop starts at the first key its first query sees. With ``SOFTCAP``
each score ``s`` becomes ``cap * tanh(s / cap)`` before the softmax (Gemma 2; spec.py).

Work split. A program owns (a tile of up to BLOCK_Q query tokens of one sequence) x (one KV head)
x (one split of the context). Its BLOCK_M = BLOCK_Q * GROUP_PAD rows are every (query token, query
head of that KV head's group) pair, so each K/V tile is loaded once for the whole group (grouped-query
attention costs no extra memory traffic). Keys are walked BLOCK_N at a time; each key's physical block
comes from the block table, so blocks may sit anywhere in the pool, in any order.

Softmax is online (running max and sum, rescaling the accumulator), in float32 and base 2: scores are
pre-multiplied by scale * log2(e) so each step is one exp2. Inputs may be float32, bfloat16 or float16;
accumulation is always float32 and float32 matmuls use IEEE precision (no TF32), so results match the
PyTorch reference closely enough for greedy decoding to agree token for token.

Split-K: a decode over a long context with few sequences would occupy a handful of programs while the
GPU has a hundred-odd SMs. Then the context is cut into NUM_SPLITS ranges, each program writes its
partial (normalised output, log-sum-exp) and a small reduce kernel merges them. A heuristic chooses;
``split_k=True/False`` forces either path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.attention.kv_quant import FP8_KV_DTYPES, KVScales, quantize_kv
from services.worker.attention.metadata import AttentionMetadata
from services.worker.attention.spec import AttentionSpec
from services.worker.attention.triton_cache_ops import _check_layer_pools, require, write_kv

QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

LOG2E = 1.4426950408889634
MIN_DOT = 16  # tl.dot needs every tile dimension >= 16
# Tile shapes and warps are where ptxas spills (next to) nothing on sm_80, sm_90 and sm_100
# (benchmarks/triton_compile.py). 64 rows is also what Hopper's wgmma needs per warpgroup.
# 128-row tiles ran prefill 5-18% faster on an H200 but spill hundreds of bytes on sm_80 and sm_90
# with 4 warps, and gain less with 8 (RESULTS.md, tune_prefill): 64 rows stay.
PREFILL_ROWS = 64  # rows (query token x head) per prefill tile, 16-bit inputs
# float32 dots run on CUDA cores (IEEE, no tensor cores): every thread keeps its own copies of operand
# rows, so the tiles are smaller and the warps more; 64-row tiles on 4 warps spilled kilobytes.
FMA_ROWS = 16  # rows per float32 tile, head_dim >= 128 (twice that below)
WIDE_WARPS = 8  # float32 tiles, and 16-bit tiles whose accumulator is larger than 64 x 128
DEFAULT_STAGES = 3  # Triton's own default; see LaunchPlan.num_stages
MAX_BLOCK_N = 64  # keys per inner-loop step, at most
KV_TILE_BYTES = 32 << 10  # one K tile + one V tile; with their pipeline buffers they must fit in shared memory
# A decode tile has 16 rows, so twice the keys per step costs few registers and halves the loop's trips:
# on an H200, 128 keys (bf16, head size 128) beat 64 by 15-18% at 4k and 32k keys (RESULTS.md, tune).
# Its buffers need more shared memory than GPUs below the A100's 164 KiB have.
DECODE_MAX_BLOCK_N = 128
DECODE_KV_TILE_BYTES = 64 << 10
DECODE_MIN_SHARED_MEMORY = 160 << 10
# A split shorter than this costs more in the reduce than it gains: one 128-key step. On an H200 a lone
# decode over 512 keys took 9.2 us whole, 6.6 us in four splits (RESULTS.md, tune).
SPLIT_MIN_KEYS = 128
SPLIT_MAX = 64
SPLIT_TARGET_WAVES = 2  # aim for about this many programs per SM when splitting
CPU_SM_COUNT = 8  # stands in for the SM count under the interpreter


# --- kernels --------------------------------------------------------------------------------------


@triton.jit
def _matmul(a, b, USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """a [M, K] @ b [K, N] in float32; tl.dot needs K >= 16, smaller head dims use a broadcast sum.

    DOT_FP32 upcasts the operands first: the interpreter's tl.dot mishandles bfloat16 (it multiplies
    the raw 16-bit patterns), so interpreted bfloat16 runs take this path; GPUs use the native dot.
    """
    if USE_DOT:
        if DOT_FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif IEEE_DOT:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)


@triton.jit
def _key_offsets(
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq, stride_bt, k_pos, k_ok, kv_head,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offset of each key position in the pool, through the sequence's block table."""
    block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
    # int64: block * stride_cb overflows int32 once the pool passes 2**31 elements.
    return block.to(tl.int64) * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def _attend(
    q,  # [BLOCK_M, HEAD_DIM] the query tile
    q_pos,  # [BLOCK_M] each row's position in its sequence (where its window ends)
    q_last,  # [BLOCK_M] the last key position each row may see: its own, or with KEY_LIMIT its limit
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq, stride_bt, kv_head, stride_cb, stride_cs, stride_ch,
    lo, hi,  # the key positions [lo, hi) this program covers
    scale_log2,  # what q . k is multiplied by: scale * log2(e), or with SOFTCAP scale / cap
    softcap_log2,  # SOFTCAP only: cap * log2(e)
    window,  # SLIDING only: keys seen per query, itself included
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    USE_DOT: tl.constexpr, IEEE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, FP8_KV: tl.constexpr,
):
    """Online softmax over keys [lo, hi): the unnormalised output, the running max and the sum."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    dims = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        offs = _key_offsets(block_tables_ptr, seq, stride_bt, k_pos, k_ok, kv_head,
                            stride_cb, stride_cs, stride_ch, BLOCK_SIZE)
        # K is loaded transposed, [HEAD_DIM, BLOCK_N], so the scores are a plain q @ k.
        k = tl.load(k_cache_ptr + offs[None, :] + dims[:, None], mask=k_ok[None, :], other=0.0)
        if FP8_KV:  # codes upcast exactly; K's scale is in scale_log2
            k = k.to(q.dtype)
        s = _matmul(q, k, USE_DOT, IEEE_DOT, DOT_FP32) * scale_log2
        if SOFTCAP:
            # tanh(x) = 1 - 2 / (e^2x + 1): exact at both ends (no libdevice call, so the interpreter runs it).
            s = (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634)) + 1.0)) * softcap_log2
        seen = k_ok[None, :] & (k_pos[None, :] <= q_last[:, None])
        if SLIDING:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0)
        if FP8_KV:  # V's scale multiplies the output
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + _matmul(p.to(v.dtype), v, USE_DOT, IEEE_DOT, DOT_FP32)
        m = m_new
    return acc, m, l


# Arguments that change from batch to batch are kept out of Triton's specialisation (on divisibility by
# 16, on == 1, on pointer alignment), so a new block-table width or tile count or split count does not
# compile a new binary in the middle of serving. None of them feeds a vectorised access.
@triton.jit(do_not_specialize=["stride_lt", "stride_lh", "stride_bt", "window"],
            do_not_specialize_on_alignment=["tile_seq_ptr", "tile_q0_ptr"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] q's dtype; with SPLIT: [num_tokens, num_heads, splits, head_dim] f32
    lse_ptr,  # SPLIT only: [num_tokens, num_heads, splits] float32, base-2 log-sum-exp of each split
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32: context length after this step
    query_start_ptr,  # [num_seqs + 1] int32
    key_limits_ptr,  # KEY_LIMIT only: [num_tokens] int32, the last key position each token sees
    tile_seq_ptr,  # [num_tiles] int32: the sequence of each query tile
    tile_q0_ptr,  # [num_tiles] int32: the tile's first query index within its sequence
    scale_log2,  # softmax scale * log2(e); with SOFTCAP scale / cap (an FP8 cache's K scale included)
    softcap_log2,  # SOFTCAP only: cap * log2(e)
    window,  # SLIDING only: keys seen per query, itself included
    v_scale,  # FP8_KV only: what the output is multiplied by (the cache's V scale)
    stride_qt, stride_qh,
    stride_ot, stride_oh, stride_os,  # stride_os: the split dimension (SPLIT only)
    stride_lt, stride_lh,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_M: tl.constexpr,  # BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_DOT: tl.constexpr,  # head_dim >= 16: tensor-core dot; else a broadcast sum
    IEEE_DOT: tl.constexpr,  # float32 inputs: full-precision dot, not TF32
    DOT_FP32: tl.constexpr,  # upcast dot operands (interpreted bfloat16 only)
    SLIDING: tl.constexpr,  # a sliding-window layer
    SOFTCAP: tl.constexpr,  # scores soft-capped
    FP8_KV: tl.constexpr,  # the pools hold FP8 codes (kv_quant.py)
    KEY_LIMIT: tl.constexpr,  # some tokens see keys past their own position (an image attending both ways)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    q_pos = ctx - q_len + q_idx
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)

    if KEY_LIMIT:  # (a step with such tokens: their sequences' whole contexts are looped over, masked)
        q_last = tl.load(key_limits_ptr + token, mask=row_ok, other=0)
        kv_end = ctx
    else:
        q_last = q_pos
        # No key after the tile's last query matters: it stops the loop early for prefill tiles.
        kv_end = ctx - q_len + tl.minimum(q0 + BLOCK_M // GROUP_PAD, q_len)
    # Nor any key before the first one the tile's first query sees (rounded down to 16: aligned loads).
    if SLIDING:
        kv_begin = tl.maximum(ctx - q_len + q0 - window + 1, 0) // 16 * 16
    else:
        kv_begin = 0
    if SPLIT:
        # Each sequence spreads its own keys over the splits, in whole 16-key steps (aligned loads). A
        # plan made for the longest context so keeps every split busy on shorter ones, and stays valid
        # whatever the lengths: a CUDA graph replays it with new ones.
        keys_per_split = tl.cdiv(tl.cdiv(ctx - kv_begin, tl.num_programs(2)), 16) * 16
        lo = kv_begin + split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, kv_end)
    else:
        lo = kv_begin
        hi = kv_end
    acc, m, l = _attend(q, q_pos, q_last, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, stride_bt, kv_head,
                        stride_cb, stride_cs, stride_ch, lo, hi, scale_log2, softcap_log2, window,
                        BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, USE_DOT, IEEE_DOT, DOT_FP32, SLIDING, SOFTCAP,
                        FP8_KV)

    # Rows that saw no key (only in an empty split) have l == 0: output 0, log-sum-exp -inf.
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if FP8_KV:
        out = out * v_scale
    out_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    if SPLIT:
        tl.store(out_ptr + out_offs + split * stride_os, out, mask=row_ok[:, None])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_splits", "stride_lt", "stride_lh"])  # as for the kernel above
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] q's dtype
    part_ptr,  # [num_tokens, num_heads, splits, head_dim] float32, contiguous
    lse_ptr,  # [num_tokens, num_heads, splits] float32, contiguous
    num_splits,
    stride_ot, stride_oh,
    stride_pt, stride_ph,
    stride_lt, stride_lh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per (token, head): weight each split's normalised output by its share of the sum.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    ok = splits < num_splits
    lse = tl.load(lse_ptr + token * stride_lt + head * stride_lh + splits, mask=ok, other=float("-inf"))
    # Every row sees its own key, in one split or another, so the max is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    dims = tl.arange(0, HEAD_DIM)
    part = tl.load(part_ptr + token * stride_pt + head * stride_ph + splits[:, None] * HEAD_DIM + dims[None, :],
                   mask=ok[:, None], other=0.0)
    out = tl.sum(weights[:, None] * part, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


# --- launch planning ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchPlan:
    """How one batch maps onto programs; the same for every layer of a step."""
    block_q: int  # query tokens per tile
    group_pad: int
    block_n: int
    num_warps: int
    # Software-pipeline depth. The block-table read feeds every K/V address and takes a stage of its
    # own: at 3 (Triton's default) decode tiles get one K/V buffer, at 5 two (benchmarks/triton_compile.py).
    num_stages: int
    split: bool  # split-K: partials per split, then the reduce kernel (even with one split when forced)
    num_splits: int  # each sequence's context is cut into this many ranges (the kernel sizes them per sequence)
    tiles: torch.Tensor  # [2, num_tiles] int32 on the device: the tile's sequence, its first query index

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.shape[1])


def check_head_dim(head_dim: int) -> None:
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton attention kernels need a power-of-two head size (64, 128, ...), "
                         f"got head_dim={head_dim}; use attention_backend='torch' for this model")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


def choose_num_splits(num_programs: int, max_seq_len: int, max_query_len: int, sm_count: int) -> int:
    """Split the context only for decode batches too small to fill the GPU, and only long contexts."""
    if max_query_len > 1 or num_programs >= sm_count:
        return 1
    by_length = max_seq_len // SPLIT_MIN_KEYS
    by_occupancy = _cdiv(SPLIT_TARGET_WAVES * sm_count, num_programs)
    return max(1, min(by_length, by_occupancy, SPLIT_MAX))


def _query_tiles(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    seqs: list[int] = []
    firsts: list[int] = []
    for seq, query_len in enumerate(query_lens):
        for first in range(0, query_len, block_q):
            seqs.append(seq)
            firsts.append(first)
    return seqs, firsts


def _rows_per_tile(head_dim: int, fma_dot: bool) -> int:
    """FMA dots hold operand rows per thread besides the float32 accumulator: fewer rows when wide."""
    if fma_dot:
        return FMA_ROWS if head_dim >= 128 else 2 * FMA_ROWS
    return PREFILL_ROWS


def _num_warps(block_m: int, head_dim: int, fma_dot: bool) -> int:
    """More threads where 4 warps' registers would not hold the tile; 4 is Triton's default."""
    return WIDE_WARPS if fma_dot or block_m * head_dim > PREFILL_ROWS * 128 else 4


def _shared_memory(device: torch.device) -> int:
    """Shared memory one program may opt into; the interpreter has no limit (it stands in for a large GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return DECODE_MIN_SHARED_MEMORY


def _keys_per_step(decode_only: bool, head_dim: int, element_size: int, device: torch.device) -> int:
    """A K tile and a V tile of at most the byte budget together, so the pipelined copies fit in shared memory."""
    if decode_only and _shared_memory(device) >= DECODE_MIN_SHARED_MEMORY:
        most, budget = DECODE_MAX_BLOCK_N, DECODE_KV_TILE_BYTES
    else:
        most, budget = MAX_BLOCK_N, KV_TILE_BYTES
    return max(MIN_DOT, min(most, budget // (2 * head_dim * element_size)))


def _tile_sizes(meta: AttentionMetadata, group: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> tuple[int, int, int]:
    """(query tokens per tile, GROUP_PAD, keys per loop step)."""
    group_pad = triton.next_power_of_2(group)
    element_size = dtype.itemsize
    rows = _rows_per_tile(head_dim, fma_dot=dtype == torch.float32)
    min_q = max(1, MIN_DOT // group_pad)  # enough query tokens for BLOCK_M >= 16
    block_q = max(min_q, min(max(1, rows // group_pad), triton.next_power_of_2(meta.max_query_len)))
    block_n = _keys_per_step(meta.max_query_len == 1, head_dim, element_size, device)
    return block_q, group_pad, block_n


def _split_count(meta: AttentionMetadata, max_keys: int, num_programs: int, device: torch.device,
                 split_k: bool | None, num_splits: int | None) -> int:
    if split_k is False:
        return 1
    if num_splits is not None:
        require(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")
        return num_splits
    if split_k:
        return max(2, min(SPLIT_MAX, max_keys // SPLIT_MIN_KEYS))
    return choose_num_splits(num_programs, max_keys, meta.max_query_len, _sm_count(device))


def make_launch_plan(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, split_k: bool | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     num_stages: int | None = None, window: int | None = None,
                     block_q: int | None = None) -> LaunchPlan:
    """Tile sizes, the query tiles and the split count; split_k forces split-K on or off (None: heuristic).

    ``num_splits``, ``block_n``, ``num_stages`` and ``block_q`` pin what the heuristics would choose
    (tests, tuning). ``window``: the most keys a decode sees in any layer the plan serves (None: its
    whole context).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    default_q, group_pad, default_n = _tile_sizes(meta, num_heads // num_kv_heads, head_dim, q.dtype, q.device)
    block_n = block_n or default_n
    require(block_n >= MIN_DOT and block_n & (block_n - 1) == 0,
             f"block_n must be a power of two >= 16, got {block_n}")
    block_q = block_q or default_q
    require(block_q & (block_q - 1) == 0 and block_q * group_pad >= MIN_DOT,
             f"block_q must be a power of two with block_q * {group_pad} query heads >= 16 rows, got {block_q}")
    seqs, firsts = _query_tiles(meta.query_lens_cpu, block_q)
    # A window's keys may start mid-way through a 16-key step (the kernel rounds down): 15 more at most.
    max_keys = meta.max_seq_len if window is None else min(meta.max_seq_len, window + MIN_DOT - 1)
    splits = _split_count(meta, max_keys, len(seqs) * num_kv_heads, q.device, split_k, num_splits)
    # Splits start on a multiple of 16 keys (aligned loads); the count is what that rounding leaves for
    # the most keys (fewer leave later splits empty where they have under 16 keys each).
    keys_per_split = _cdiv(_cdiv(max_keys, splits), MIN_DOT) * MIN_DOT
    split = bool(split_k) or splits > 1
    splits = _cdiv(max_keys, keys_per_split) if split else 1
    tiles = torch.tensor([seqs, firsts], dtype=torch.int32).to(q.device, non_blocking=True)
    num_warps = _num_warps(block_q * group_pad, head_dim, fma_dot=q.dtype == torch.float32)
    require(num_stages is None or num_stages >= 1, f"num_stages must be >= 1, got {num_stages}")
    return LaunchPlan(block_q=block_q, group_pad=group_pad, block_n=block_n, num_warps=num_warps,
                      num_stages=num_stages or DEFAULT_STAGES, split=split, num_splits=splits, tiles=tiles)


# --- the wrapper ----------------------------------------------------------------------------------


def _check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, out: torch.Tensor | None) -> None:
    _check_layer_pools(k_cache, v_cache)
    require(q.dim() == 3, f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    check_head_dim(head_dim)
    num_kv_heads = k_cache.shape[2]
    require(k_cache.shape[3] == head_dim, f"q head_dim {head_dim} != pool head_dim {k_cache.shape[3]}")
    require(num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    require(q.stride(-1) == 1, "q's last dimension (head_dim) must be contiguous")
    require(q.dtype == k_cache.dtype or k_cache.dtype in FP8_KV_DTYPES,
             f"q dtype {q.dtype} != pool dtype {k_cache.dtype} (nor is the pool FP8)")
    require(q.device == k_cache.device, f"q is on {q.device}, the pool on {k_cache.device}")
    require(q.dtype in QUERY_DTYPES, f"dtype {q.dtype} is not one of {QUERY_DTYPES}")
    require(q.shape[0] == sum(meta.query_lens_cpu),
             f"q has {q.shape[0]} tokens, the metadata schedules {sum(meta.query_lens_cpu)}")
    for name, t, dtype in (("block_tables", meta.block_tables, torch.int32), ("seq_lens", meta.seq_lens, torch.int32),
                           ("query_start_loc", meta.query_start_loc, torch.int32)):
        require(t.dtype == dtype, f"meta.{name} must be {dtype}, got {t.dtype}")
        require(t.device == q.device, f"meta.{name} is on {t.device}, q on {q.device}")
        require(t.stride(-1) == 1, f"meta.{name}'s last dimension must be contiguous")
    require(meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == meta.num_seqs,
             f"meta.block_tables must be [num_seqs, max_blocks], got {tuple(meta.block_tables.shape)}")
    require(meta.query_start_loc.shape == (meta.num_seqs + 1,), "meta.query_start_loc must be [num_seqs + 1]")
    if meta.key_limits is not None:
        limits = meta.key_limits
        require(limits.dtype == torch.int32 and limits.device == q.device and limits.shape == (q.shape[0],)
                and limits.stride(0) == 1, "meta.key_limits must be a contiguous int32 [num_tokens] beside q")
    if out is not None:
        require(out.shape == q.shape and out.dtype == q.dtype and out.device == q.device,
                 "out must match q in shape, dtype and device")
        require(out.stride(-1) == 1, "out's last dimension must be contiguous")


def _kernel_flags(q: torch.Tensor, k_cache: torch.Tensor, plan: LaunchPlan, window: int | None,
                  softcap: float | None, key_limits: bool) -> dict:
    head_dim = q.shape[2]
    return dict(GROUP=q.shape[1] // k_cache.shape[2], GROUP_PAD=plan.group_pad, BLOCK_M=plan.block_q * plan.group_pad,
                SLIDING=window is not None, SOFTCAP=softcap is not None, FP8_KV=k_cache.dtype in FP8_KV_DTYPES,
                KEY_LIMIT=key_limits,
                BLOCK_N=plan.block_n, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, USE_DOT=head_dim >= MIN_DOT,
                # IEEE for float32: TF32 would drift from the reference (16-bit inputs are exact anyway).
                IEEE_DOT=q.dtype == torch.float32,
                DOT_FP32=q.dtype == torch.bfloat16 and interpreter_enabled(),
                num_warps=plan.num_warps, num_stages=plan.num_stages)  # launch options, not constexprs


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, *, window: int | None = None, softcap: float | None = None,
                    out: torch.Tensor | None = None, split_k: bool | None = None,
                    num_splits: int | None = None, block_n: int | None = None, num_stages: int | None = None,
                    plan: LaunchPlan | None = None, check: bool = True,
                    kv_scales: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
    """Attention of every new token over its sequence's paged context; ``q`` is ``[T, H, D]``.

    ``window``: each query sees only the last ``window`` positions up to its own; ``softcap``: scores
    become ``softcap * tanh(score / softcap)`` (spec.py); ``kv_scales``: an FP8 cache's K and V scales
    (kv_quant.py).

    The new tokens' K/V must already be in the pool (``write_kv``). ``split_k`` forces split-K on
    (True) or off (False); None lets the heuristic choose. ``num_splits``, ``block_n`` and ``num_stages``
    pin the split count, the key tile and the pipeline depth (tests, tuning). ``check=False`` skips the
    host-side validation (tens of microseconds): the backend validates each step's first layer only.
    Returns ``out``.
    """
    if check:
        _check_attention_inputs(q, k_cache, v_cache, meta, out)
        require(window is None or window >= 1, f"window must be >= 1, got {window}")
        require(softcap is None or softcap > 0, f"softcap must be > 0, got {softcap}")
    if plan is None:
        plan = make_launch_plan(meta, q, k_cache, split_k, num_splits, block_n, num_stages, window)
    out = torch.empty_like(q) if out is None else out
    if q.shape[0] == 0:
        return out
    num_tokens, num_heads, head_dim = q.shape
    grid = (plan.num_tiles, k_cache.shape[2], plan.num_splits)
    scale = scale * kv_scales[0]
    scales = (scale * LOG2E, 0.0) if softcap is None else (scale / softcap, softcap * LOG2E)
    limits = meta.key_limits if meta.key_limits is not None else meta.seq_lens  # (unread without KEY_LIMIT)
    common = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, limits, plan.tiles[0],
              plan.tiles[1], *scales, window or 0, kv_scales[1], q.stride(0), q.stride(1))
    pool_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0))
    flags = _kernel_flags(q, k_cache, plan, window, softcap, meta.key_limits is not None)
    if not plan.split:
        _paged_attention_kernel[grid](out, out, *common, out.stride(0), out.stride(1), 0, 0, 0, *pool_strides,
                                      SPLIT=False, **flags)
        return out
    part = torch.empty(num_tokens, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_tokens, num_heads, plan.num_splits, dtype=torch.float32, device=q.device)
    _paged_attention_kernel[grid](part, lse, *common, part.stride(0), part.stride(1), part.stride(2),
                                  lse.stride(0), lse.stride(1), *pool_strides, SPLIT=True, **flags)
    _reduce_splits_kernel[(num_tokens, num_heads)](
        out, part, lse, plan.num_splits, out.stride(0), out.stride(1), part.stride(0), part.stride(1),
        lse.stride(0), lse.stride(1), SPLITS_PAD=triton.next_power_of_2(plan.num_splits), HEAD_DIM=head_dim)
    return out


# --- the backend ----------------------------------------------------------------------------------


class TritonAttentionBackend:
    """Writes new K/V into the paged pool and attends over it, with the Triton kernels."""

    name = "triton"
    supports_cuda_graphs = True  # every length is read from device tensors, and plan_for keeps a step's plan

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], spec: AttentionSpec,
                 split_k: bool | None = None, kv_scales: KVScales | None = None):
        self.kv_caches = kv_caches  # per layer: (K pool, V pool)
        self.spec = spec
        self.kv_scales = kv_scales or KVScales.ones(len(kv_caches))  # an FP8 cache's (kv_quant.py)
        pool = kv_caches[0][0]
        if pool.dtype == torch.float8_e4m3fn and pool.is_cuda and torch.cuda.get_device_capability(pool.device) < (8, 9):
            raise ValueError("kv_cache_dtype fp8 / fp8_e4m3 needs compute capability 8.9 or later on the Triton "
                             "backend (Triton has no e4m3 before it); fp8_e5m2 runs from 8.0")
        self.split_k = split_k  # None: the heuristic chooses; True/False force split-K on/off
        check_head_dim(kv_caches[0][0].shape[-1])
        # One plan serves every layer of a step: sized for the most keys any layer sees.
        windows = [spec.window(layer) for layer in range(len(kv_caches))]
        self._plan_window = None if None in windows or not windows else max(windows)
        self._plan_for: AttentionMetadata | None = None
        self._plan: LaunchPlan | None = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        # Every layer of a step gets the same metadata object and same-shaped tensors: plan and
        # validate on the first, then launch only (host time per layer matters at small batches).
        new_step = self._plan_for is not meta
        scales = self.kv_scales.of_step(layer, k, v)
        if k_cache.dtype in FP8_KV_DTYPES:  # quantized by torch, so every backend stores the same codes
            k, v = quantize_kv(k, scales[0], k_cache.dtype), quantize_kv(v, scales[1], v_cache.dtype)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping, check=new_step)
        if new_step:
            self._plan = make_launch_plan(meta, q, k_cache, self.split_k, window=self._plan_window)
            self._plan_for = meta  # held here, so the `is` test cannot match a recycled id
        return paged_attention(q, k_cache, v_cache, meta, self.spec.scale, window=self.spec.window(layer),
                               softcap=self.spec.logit_softcap, plan=self._plan, check=new_step, kv_scales=scales)

    def plan_for(self, meta: AttentionMetadata) -> LaunchPlan | None:
        """The plan steps over ``meta`` launch with, once a forward pass over it has run (None before).

        A CUDA graph captured over ``meta`` reads this plan's tile tensor: its owner keeps the plan alive.
        """
        return self._plan if self._plan_for is meta else None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = ["TritonAttentionBackend", "paged_attention", "make_launch_plan", "choose_num_splits", "check_head_dim",
           "LaunchPlan", "write_kv", "interpreter_enabled"]
