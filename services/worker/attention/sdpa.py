"""Scaled dot-product attention for the PyTorch backends, with what SDPA cannot do: soft-capped scores.

Without a cap this is torch's ``scaled_dot_product_attention`` (its fused CPU kernel). With one (Gemma 2)
the same arithmetic is spelt out: float32 scores, ``cap * tanh(s / cap)``, the additive mask, a float32
softmax, as transformers' eager attention does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float,
           mask: torch.Tensor | None = None, is_causal: bool = False, softcap: float | None = None,
           enable_gqa: bool = False) -> torch.Tensor:
    """``query [..., Hq, L, D]`` over ``keys``/``values [..., Hkv, S, D]``; ``mask`` additive, broadcastable
    to ``[..., Hq, L, S]``; ``is_causal``: query i sees keys 0..i (L == S); ``enable_gqa``: Hq is a multiple
    of Hkv, each KV head serving Hq / Hkv consecutive query heads."""
    if softcap is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=is_causal,
                                              scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and query.shape[-3] != keys.shape[-3]:
        group = query.shape[-3] // keys.shape[-3]
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        length = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1),
                                    float("-inf"))
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values.float()).to(query.dtype)
