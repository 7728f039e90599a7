"""Building blocks shared by the models: RMSNorm (Llama's and Gemma's), rotary embedding, the gated
activations (SiLU- and GELU-and-mul).

Each one reproduces the arithmetic of the Hugging Face implementation (which
dtype each step runs in, in which order), because the model's outputs are
checked against transformers token for token. On the CPU each runs as one fused
C++ kernel (cpu_layers.py) when those are built; elsewhere, in PyTorch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models import cpu_layers


# float16 stays in PyTorch: the kernels convert it in software (GCC does not vectorize F16C
# conversions), which is slower than torch's own float16 kernels; bfloat16 converts cheaply.
_FUSED_DTYPES = (torch.float32, torch.bfloat16)


def _fused_on_cpu(x: torch.Tensor) -> bool:
    """Whether the fused C++ kernels take ``x``: a CPU tensor of a dtype they are fast for, kernels built,
    and no gradient wanted (they have no backward)."""
    return (x.device.type == "cpu" and x.dtype in _FUSED_DTYPES and not torch.is_grad_enabled()
            and cpu_layers.available())


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, cast back before the weight (as HF Llama)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_on_cpu(x) and self.weight.dtype == x.dtype:
            # One pass over x instead of six elementwise kernels and their temporaries.
            return cpu_layers.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``; on the CPU the sum is written into ``residual``."""
        if (_fused_on_cpu(x) and self.weight.dtype == x.dtype and residual.dtype == x.dtype
                and x.is_contiguous() and residual.is_contiguous()):
            # The residual add and the norm in one pass (the sum is the same float add either way).
            return cpu_layers.fused_add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual


class Float32ScaledRMSNorm(RMSNorm):
    """Scales in float32, then casts (Llama casts first, then scales): by ``weight`` (OLMo 2) or, with
    ``OFFSET`` 1, by ``1 + weight`` (Gemma).

    In float32 the two orders agree, so the fused CPU kernels take it with ``OFFSET + weight`` as their weight.
    """

    OFFSET = 0.0

    def _scale(self) -> torch.Tensor:
        return self.weight + self.OFFSET if self.OFFSET else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_on_cpu(x) and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return cpu_layers.rms_norm(x, self._scale(), self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (self.OFFSET + self.weight.float())).to(x.dtype)

    def forward_with_residual(self, x: torch.Tensor, residual: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        if (_fused_on_cpu(x) and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and residual.dtype == x.dtype and x.is_contiguous() and residual.is_contiguous()):
            return cpu_layers.fused_add_rms_norm(x, residual, self._scale(), self.eps), residual
        residual = residual + x
        return self(residual), residual


class GemmaRMSNorm(Float32ScaledRMSNorm):
    OFFSET = 1.0


NORM_STYLES = {"llama": RMSNorm, "gemma": GemmaRMSNorm, "olmo2": Float32ScaledRMSNorm}


def rms_norm_class(style: str) -> type[RMSNorm]:
    return NORM_STYLES[style]


class SplitRMSNorm(nn.Module):
    """OLMo 2's q/k norm: over a whole projection ``[T, heads * head_dim]`` (not per head), which tensor
    parallelism splits by heads: each rank's sum of squares is all-reduced, so every rank normalises by the
    whole projection's mean. (Ranks that hold the same KV heads add them alike: count and sum grow together.)"""

    def __init__(self, dim: int, eps: float, tp):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.tp = eps, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.tp.size > 1:
            squares = self.tp.all_reduce(squares)
        x32 = x32 * torch.rsqrt(squares / (x.shape[-1] * self.tp.size) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [..., 2 * I] projection: silu(gate) * up."""
    if _fused_on_cpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        # One pass instead of silu then mul, with no [T, I] temporary.
        return cpu_layers.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on a fused [..., 2 * I] projection: gelu(gate, tanh approximation) * up (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None, long_context: bool = False) -> torch.Tensor:
    """Inverse frequencies (float32) of ``dim`` rotary dimensions, with linear, Llama-3 or LongRoPE scaling
    applied like transformers (LongRoPE: its long factors with ``long_context``, else its short ones)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "longrope":
        factors = scaling["long_factor" if long_context else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, theta, scaling)
    raise ValueError(f"unsupported rope type {rope_type!r}")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the pretraining length are interpolated
    (divided by ``factor``), those turning more than beta_fast times kept, a linear ramp between."""
    original = scaling["original_max_position_embeddings"]

    def dimension_of(rotations: float) -> float:  # the dimension that turns this many times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling["beta_fast"]), dimension_of(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension's original frequency
    return inv_freq / scaling["factor"] * (1 - kept) + inv_freq * kept


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a cos/sin table for every position.

    The table is computed in float32 (like HF, which then casts cos/sin to the
    activation dtype) on first use, on the device and in the dtype of the
    queries; it is not a buffer, so building the model on the meta device and
    loading weights never has to touch it. With ``rotary_dim`` below the head size
    only each head's first ``rotary_dim`` dimensions rotate (partial rotary).

    LongRoPE's factor set is chosen once, for the longest context served (``max_model_len``): its long
    factors when that passes the pretraining length, as vLLM does. transformers switches per forward
    pass, by the longest position in it; the two agree for every sequence when the context stays within
    the pretraining length, and for sequences past it when it does not.

    M-RoPE (``mrope_section``, Qwen2-VL) gives a token three positions (time, height, width): positions
    ``[3, T]``, and each rotary pair takes its cos/sin from the component its section names. A step without
    image tokens passes ``[T]``, all three alike, which is plain RoPE.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None,
                 rotary_dim: int | None = None, max_model_len: int | None = None, in_float32: bool = False,
                 mrope_section: tuple[int, ...] | None = None):
        """``in_float32``: rotate in float32 and cast back (OLMo 2), rather than in the activations' dtype."""
        super().__init__()
        # Each dimension's section, twice over (each half of a head rotates by the same frequencies).
        self.mrope_split = list(mrope_section) * 2 if mrope_section is not None else None
        self.in_float32 = in_float32
        self.head_dim, self.max_positions = head_dim, max_positions
        self.rotary_dim = rotary_dim or head_dim
        self.theta, self.scaling = theta, scaling
        self.long_context = (scaling is not None and scaling["rope_type"] == "longrope"
                             and (max_model_len or max_positions) > scaling["original_max_position_embeddings"])
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.long_context).to(device)
        positions = torch.arange(self.max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # LongRoPE's and YaRN's cos/sin factor (transformers applies none for the other kinds).
        factor = self.scaling["attention_factor"] if self.scaling and "attention_factor" in self.scaling \
            and self.scaling["rope_type"] in ("longrope", "yarn") else 1.0
        self._cos, self._sin = (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q [T, H, D]`` and ``k [T, Hkv, D]`` by their tokens' positions ``[T]`` (M-RoPE: or ``[3, T]``).

        On the CPU (fused kernel) q and k are rotated in place and returned; elsewhere new tensors.
        """
        table_dtype = torch.float32 if self.in_float32 else q.dtype
        if self._cos is None or self._cos.device != q.device or self._cos.dtype != table_dtype:
            self._build(q.device, table_dtype)
        if table_dtype != q.dtype:  # float32 products, cast back (transformers' OLMo 2)
            q_rot, k_rot = self.forward(positions, q.float(), k.float())
            return q_rot.to(q.dtype), k_rot.to(k.dtype)
        if self.rotary_dim < self.head_dim:  # rotate the leading dimensions; the rest pass through
            q_lead, k_lead = q[..., :self.rotary_dim], k[..., :self.rotary_dim]
            q_rot, k_rot = self._rotate(positions, q_lead, k_lead)
            if q_rot is q_lead:  # rotated in place
                return q, k
            return (torch.cat((q_rot, q[..., self.rotary_dim:]), dim=-1),
                    torch.cat((k_rot, k[..., self.rotary_dim:]), dim=-1))
        return self._rotate(positions, q, k)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 2:
            cos, sin = self._sections(self._cos, positions), self._sections(self._sin, positions)
            return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        if _fused_on_cpu(q) and k.dtype == q.dtype and q.stride(-1) == 1 and k.stride(-1) == 1:
            # One in-place pass instead of gathers, cat, neg, four multiplies and two adds.
            cpu_layers.rotary_embedding(positions.long(), q, k, self._cos, self._sin)
            return q, k
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def _sections(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """M-RoPE's ``[T, 1, D]`` cos or sin: each dimension's from the position component of its section."""
        if self.mrope_split is None:
            raise ValueError("three positions per token, but this model's rotary embedding has no M-RoPE sections")
        parts = table[positions].split(self.mrope_split, dim=-1)  # each [3, T, its dimensions]
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1).unsqueeze(1)
