"""Scaled dot-product attention for the PyTorch backends, with what SDPA cannot do: soft-capped scores.

Without a cap this is torch's ``scaled_dot_product_attention`` (its fused CPU kernel). With one (Gemma 2)
the same arithmetic is spelt out: float32 scores, ``cap * tanh(s / cap)``, the additive mask, a float32
softmax, as transformers' eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# The capped path's float32 scores for one slice of queries stay under this many elements (a long prefill
# would otherwise hold heads x queries x keys of them, and the expanded K/V, at once).
SCORES_ELEMENTS = 8 << 20


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float,
           mask: torch.Tensor | None = None, is_causal: bool = False, softcap: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor:
    """``query [..., Hq, L, D]`` over ``keys``/``values [..., Hkv, S, D]``; ``mask`` additive, broadcastable
    to ``[..., Hq, L, S]``; ``is_causal``: query i sees keys 0..i (L == S); ``enable_gqa``: Hq is a multiple
    of Hkv, each KV head serving Hq / Hkv consecutive query heads."""
    if is_causal and query.shape[-2] != keys.shape[-2]:
        raise ValueError(f"is_causal needs as many queries as keys, got {query.shape[-2]} and {keys.shape[-2]}")
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and query.shape[-3] != keys.shape[-3]:
        group = query.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    keys, values = keys.float(), values.float()
    num_queries, num_keys = query.shape[-2], keys.shape[-2]
    step = max(1, SCORES_ELEMENTS // max(1, query[..., 0, 0].numel() * num_keys))
    out = torch.empty_like(query)
    for start in range(0, num_queries, step):
        end = min(start + step, num_queries)
        scores = torch.matmul(query[..., start:end, :].float(), keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if is_causal:  # query i sees keys up to i
            rows = torch.arange(start, end, device=scores.device).unsqueeze(1)
            scores = scores.masked_fill(torch.arange(num_keys, device=scores.device) > rows, float("-inf"))
        if mask is not None:
            scores = scores + (mask if mask.shape[-2] == 1 else mask[..., start:end, :])
        out[..., start:end, :] = torch.matmul(torch.softmax(scores, dim=-1), values).to(query.dtype)
    return out
