"""Every expert's matmuls over its tokens in one Triton launch per projection (GPUs).

A layer's (token, slot) pairs are grouped by expert and each expert's group is padded to a multiple of
``BLOCK_M`` (``align_by_expert``), so that a tile of rows never mixes experts: program ``m`` reads its
expert id and multiplies its rows by that expert's weight, streamed in ``BLOCK_K`` slices. Two launches
make a layer: gate/up for every pair (rows read from the token's input), then down (rows read from the
pair's activation), scaled by the pair's routing weight; each token's ``top_k`` rows are then summed.
This is the grouped-GEMM design of vLLM's fused_moe, which reads each chosen expert's weights once
per tile of its tokens instead of launching two matmuls per expert. Each token's k rows are weighted
and summed in float32 and rounded once, where transformers rounds every expert's output to the
activations' dtype and adds them one by one: in 16-bit dtypes the two agree to rounding, not bit
for bit (in float32, to about 1e-6).

Nothing here waits on the GPU: every shape is a bound known on the host (at most
``pairs + E * (BLOCK_M - 1)`` padded rows), so a decode step with experts can be captured in a CUDA
graph. Padding rows point at pair ``num_pairs``, which no load or store touches; tiles past the last
expert's group see expert id ``E`` and return at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.attention.triton_attention import interpreter_enabled
from services.worker.block_moves import require

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_N, BLOCK_K = 64, 32
NUM_WARPS = 4
# Grouping by a one-hot running count needs no sort (cheap and capture-safe at decode sizes); beyond
# this many pair x expert entries its [pairs, E] table costs more than a stable sort.
ONE_HOT_LIMIT = 1 << 20


# num_pairs changes with every batch: a binary of its own for the counts divisible by 16 would compile
# in the middle of serving.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_matmul_kernel(
    a_ptr,  # [rows, K] inputs: tokens (ROWS_ARE_TOKENS) or pairs
    w_ptr,  # [E, N, K] each expert's weight, y = a @ w[e].T
    c_ptr,  # [num_pairs, N] output, one row per (token, slot) pair
    pairs_ptr,  # [padded] int32: pair index per row, grouped by expert; num_pairs marks padding
    block_experts_ptr,  # [padded // BLOCK_M] int32: each tile's expert; num_experts past the last group
    weights_ptr,  # [num_pairs] float32: routing weight per pair (read only with MUL_WEIGHTS)
    num_pairs, num_experts, top_k, N, K,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    ROWS_ARE_TOKENS: tl.constexpr,  # row of a = pair // top_k (the gate/up pass) instead of the pair
    MUL_WEIGHTS: tl.constexpr,  # scale each row by its routing weight (the down pass)
    IEEE_DOT: tl.constexpr,  # float32 inputs: full-precision dot, not TF32
    DOT_FP32: tl.constexpr,  # upcast the operands (the interpreter's dot mishandles bfloat16)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile_m, tile_n = pid // n_tiles, pid % n_tiles
    expert = tl.load(block_experts_ptr + tile_m).to(tl.int64)
    if expert >= num_experts:
        return
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pairs_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    rows = pairs // top_k if ROWS_ARE_TOKENS else pairs
    rows = tl.where(valid, rows, 0)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + rows[:, None] * stride_am
    w_base = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(a_base + k[None, :] * stride_ak, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if DOT_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        elif IEEE_DOT:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0)[:, None]
    c = c_ptr + tl.where(valid, pairs, 0)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: small when each expert gets few pairs (decode), so padding stays small (16, 32 or 64:
    compile_variants warms exactly these)."""
    per_expert = -(-num_pairs // num_experts)
    return min(64, max(16, triton.next_power_of_2(per_expert)))


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pairs [padded] int32, block_experts [padded // block_m] int32)`` for expert ids ``[T, k]``.

    ``pairs`` lists the pair indices (``t * k + j``) grouped by expert, ascending within a group, each
    group padded with ``T * k`` to a multiple of ``block_m``; ``block_experts`` gives each tile's expert,
    ``num_experts`` for the tiles after the last group. Device ops only, no host sync.
    """
    flat = ids.flatten().long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    group_starts = padded_ends - padded_counts
    rank = _rank_within_expert(flat, counts, num_experts)
    padded = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((padded,), num_pairs, dtype=torch.int32, device=device)
    pairs.scatter_(0, group_starts[flat] + rank, torch.arange(num_pairs, dtype=torch.int32, device=device))
    tile_starts = torch.arange(0, padded, block_m, dtype=torch.int64, device=device)
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True).to(torch.int32)
    return pairs, block_experts


def _rank_within_expert(flat: torch.Tensor, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each pair, how many earlier pairs chose the same expert."""
    if flat.numel() * num_experts <= ONE_HOT_LIMIT:
        # Not F.one_hot: on CUDA it checks the ids' range, a sync that a graph capture refuses.
        one_hot = (flat[:, None] == torch.arange(num_experts, device=flat.device)).long()
        return (one_hot.cumsum(0) * one_hot).sum(1) - 1
    order = flat.argsort(stable=True)
    rank = torch.empty_like(flat)
    first = counts.cumsum(0) - counts  # where each expert's pairs begin in the sorted order
    rank[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
    return rank


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token: ``x [T, H]``, ``w13 [E, 2I, H]``
    (gate rows, then up rows), ``w2 [E, H, I]``, ``weights`` and ``ids [T, k]``; returns ``[T, H]`` in x's dtype.
    ``block_m``: rows per tile (default: ``block_m_for`` the batch)."""
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    require(x.dtype in SUPPORTED_DTYPES, f"fused experts run in {SUPPORTED_DTYPES}, not {x.dtype}")
    require(w13.dtype == x.dtype and w2.dtype == x.dtype, "the experts' weights must be in the inputs' dtype")
    require(x.dim() == 2 and x.shape[1] == hidden, f"x must be [tokens, {hidden}], got {tuple(x.shape)}")
    require(tuple(w2.shape) == (num_experts, hidden, inter),
            f"w2 must be [{num_experts}, {hidden}, {inter}], got {tuple(w2.shape)}")
    require(ids.shape == weights.shape and ids.dim() == 2 and ids.shape[0] == x.shape[0],
            "ids and weights must both be [tokens, top_k]")
    require(x.device == w13.device == w2.device == ids.device, "all inputs must be on one device")
    tokens, top_k = ids.shape
    num_pairs = tokens * top_k
    block_m = block_m or block_m_for(num_pairs, num_experts)
    pairs, block_experts = align_by_expert(ids, num_experts, block_m)
    flat_weights = weights.flatten().float()
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    grouped_matmul(x, w13, gate_up, pairs, block_experts, flat_weights, top_k, block_m, rows_are_tokens=True)
    gate, up = gate_up.chunk(2, dim=-1)
    activation = F.silu(gate) * up
    # float32 rows: each token's k rows are summed before the one rounding to x's dtype.
    down = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    grouped_matmul(activation, w2, down, pairs, block_experts, flat_weights, top_k, block_m, rows_are_tokens=False)
    return down.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def compile_variants(w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> int:
    """Launch every tile height once on a dummy token, so serving never waits on a compile; returns how many."""
    x = torch.zeros(1, w13.shape[2], dtype=w13.dtype, device=w13.device)
    ids = torch.arange(top_k, device=w13.device)[None, :] % w13.shape[0]
    weights = torch.full(ids.shape, 1.0 / top_k, device=w13.device)
    heights = (16, 32, 64)
    for block_m in heights:
        fused_experts(x, w13, w2, weights, ids, block_m)
    return len(heights)


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, pairs: torch.Tensor,
                   block_experts: torch.Tensor, flat_weights: torch.Tensor, top_k: int, block_m: int,
                   rows_are_tokens: bool) -> None:
    """``c[p] = a[row(p)] @ w[expert(p)].T`` for every pair ``p`` (times its weight unless ``rows_are_tokens``),
    where ``row(p)`` is ``p // top_k`` if ``rows_are_tokens`` else ``p``; ``pairs`` and ``block_experts``
    come from ``align_by_expert`` with the same ``block_m``. Any strides."""
    num_experts, n, k = w.shape
    require(a.shape[1] == k and c.shape[1] == n, f"a [rows, {k}] and c [pairs, {n}] for w {tuple(w.shape)}")
    require(pairs.dtype == torch.int32 and block_experts.dtype == torch.int32, "pairs and block_experts are int32")
    require(pairs.numel() == block_experts.numel() * block_m, "pairs must fill block_experts' tiles exactly")
    require(flat_weights.dtype == torch.float32 and flat_weights.numel() == c.shape[0],
            "flat_weights must be float32, one per pair")
    grid = (block_experts.numel() * triton.cdiv(n, BLOCK_N),)
    _grouped_matmul_kernel[grid](
        a, w, c, pairs, block_experts, flat_weights,
        c.shape[0], num_experts, top_k, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        ROWS_ARE_TOKENS=rows_are_tokens, MUL_WEIGHTS=not rows_are_tokens,
        IEEE_DOT=a.dtype == torch.float32, DOT_FP32=a.dtype == torch.bfloat16 and interpreter_enabled(),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
