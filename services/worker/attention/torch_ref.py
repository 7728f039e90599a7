"""Paged attention in plain PyTorch: the readable reference and the CPU backend.

``paged_attention_reference`` is the oracle: one sequence at a time, float32
softmax, an explicit causal mask. ``TorchAttentionBackend`` computes the same
thing faster (decodes batched through SDPA) and is checked against it.

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``
for K and the same for V; token ``t`` of a sequence lives in block
``block_table[t // block_size]`` at offset ``t % block_size``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.worker.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their slots."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` cached tokens, ``[context_len, heads, dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:context_len]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of every new token over its sequence's cached context; ``q`` is ``[T, H, D]``."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, (query_len, context_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        start = starts[i]
        query = q[start:start + query_len].float()
        keys = gather_context(k_cache, meta.block_tables[i], context_len).float()
        values = gather_context(v_cache, meta.block_tables[i], context_len).float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        # New token t sits at position context_len - query_len + t and sees keys up to it.
        query_pos = torch.arange(context_len - query_len, context_len).unsqueeze(1)
        key_pos = torch.arange(context_len).unsqueeze(0)
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
    return out


class TorchAttentionBackend:
    """Writes new K/V into the paged pool and attends over it, with PyTorch ops."""

    name = "torch"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.kv_caches = kv_caches  # per layer: (K pool, V pool)
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if meta.is_decode_only:
            return self._decode(q, k_cache, v_cache, meta)
        return self._mixed(q, k_cache, v_cache, meta)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence: gather every context padded to the longest, mask the padding."""
        block_size = k_cache.shape[1]
        num_blocks = -(-meta.max_seq_len // block_size)
        table = meta.block_tables[:, :num_blocks].long()
        num_seqs, num_heads = q.shape[0], q.shape[1]
        keys = k_cache[table].flatten(1, 2).transpose(1, 2)  # [S, Hkv, L, D]
        values = v_cache[table].flatten(1, 2).transpose(1, 2)
        positions = torch.arange(keys.shape[2]).unsqueeze(0)
        mask = (positions < meta.seq_lens.unsqueeze(1)).view(num_seqs, 1, 1, -1)
        out = F.scaled_dot_product_attention(q.view(num_seqs, num_heads, 1, -1), keys, values,
                                             attn_mask=mask, scale=self.scale,
                                             enable_gqa=num_heads != k_cache.shape[2])
        return out.view_as(q)

    def _mixed(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """Sequence by sequence: a prefill chunk attends to its cached prefix plus itself, causally."""
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        enable_gqa = q.shape[1] != k_cache.shape[2]
        for i, (query_len, context_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            start = starts[i]
            keys = gather_context(k_cache, meta.block_tables[i], context_len).transpose(0, 1)
            values = gather_context(v_cache, meta.block_tables[i], context_len).transpose(0, 1)
            query = q[start:start + query_len].transpose(0, 1)
            mask = None
            if query_len > 1:
                query_pos = torch.arange(context_len - query_len, context_len).unsqueeze(1)
                mask = torch.arange(context_len).unsqueeze(0) <= query_pos
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                      scale=self.scale, enable_gqa=enable_gqa)
            out[start:start + query_len] = attended.transpose(0, 1)
        return out
