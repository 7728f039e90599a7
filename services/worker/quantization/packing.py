"""Integers packed into int32 words, as the quantized checkpoint formats store them.

Every format here packs little-endian: the value at position i of a run sits at bits ``(i % per_word) *
bits`` of word ``i // per_word`` (GPTQ, compressed-tensors' pack-quantized: for 4 and 8 bits its dense
packing is the same), except AWQ, which interleaves the eight nibbles of a word (AWQ_ORDER).
"""

from __future__ import annotations

import torch

# AWQ's GEMM kernels want column ``AWQ_ORDER[i]`` of each run of eight in nibble i of the word.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACKED_BITS = (4, 8)  # bit widths a word holds a whole number of


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned values ``[..]`` (int32) from words packed along ``dim`` (0 or 1) of a 2-D int32 tensor: that
    dimension grows ``32 // bits`` times."""
    if bits not in PACKED_BITS:
        raise ValueError(f"{bits}-bit packing is not supported; supported: {PACKED_BITS}")
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed weights must be a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    words = packed if dim == 1 else packed.t()
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    values = values.reshape(words.shape[0], -1)
    return values if dim == 1 else values.t()


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's nibbles ``[rows, cols / 8]`` int32 -> ``[rows, cols]`` in column order."""
    nibbles = unpack_int32(packed, 4, 1).view(packed.shape[0], -1, 8)
    natural = [AWQ_ORDER.index(column) for column in range(8)]
    return nibbles[:, :, natural].reshape(packed.shape[0], -1)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit ``codes [rows, cols]`` (cols a multiple of 32 / bits) -> ``[rows, cols * bits / 32]``
    int32, code j of each word's run at bits ``bits * j``: the layout wna16_gemm.py reads (and compressed-tensors
    stores)."""
    per_word = 32 // bits
    rows, cols = codes.shape
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (codes.to(torch.int64).view(rows, cols // per_word, per_word) << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed
