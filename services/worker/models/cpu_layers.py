"""Fused C++ CPU kernels for the models' elementwise layers (csrc/cpu_layers.cpp), with checked arguments.

PyTorch runs RMSNorm as six kernels, rotary as a dozen and SiLU-and-mul as two, each a full pass over
memory with its own temporary; these do one pass per row. They reproduce the per-element arithmetic
of the PyTorch code in layers.py (see the C++ source for the one last-bit difference, RMSNorm's sum).
``available()`` builds the kernels on first use (services/worker/attention/cpu_kernels.py).
Each wrapper checks its arguments (ValueError), formatting a message only when a check fails: they run in
every layer on every step.
"""

from __future__ import annotations

import torch

from services.worker.attention.cpu_kernels import LIBRARY, cpu_kernels_unavailable_reason

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    return cpu_kernels_unavailable_reason() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype)`` over the last dimension of ``x [..., N]``.

    x needs unit stride along N only; out (contiguous, fresh if None) is returned.
    """
    out = x.new_empty(x.shape) if out is None else out
    _check_norm(x, weight, out)
    _ops().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``residual += x`` in place, then returns ``rms_norm(residual)``; x and residual contiguous ``[..., N]``."""
    out = x.new_empty(x.shape) if out is None else out
    _check_norm(x, weight, out)
    if not (x.is_contiguous() and residual.is_contiguous()):
        raise ValueError("x and residual must be contiguous")
    if not (residual.shape == x.shape and residual.dtype == x.dtype and residual.device.type == "cpu"):
        raise ValueError(f"residual must be a CPU tensor shaped {tuple(x.shape)} of {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}")
    _ops().fused_add_rms_norm(out, x, residual, weight, eps)
    return out


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> None:
    """Rotates ``q [T, H, D]`` and ``k [T, Hkv, D]`` in place: ``x * cos[p] + rotate_half(x) * sin[p]``.

    positions int64 [T]; cos, sin contiguous [max_positions, D] of q's dtype; q, k need unit stride
    along D only. A position outside the table raises IndexError.
    """
    if not all(t.device.type == "cpu" for t in (positions, q, k, cos, sin)):
        raise ValueError("every tensor must be on the CPU")
    if q.dtype not in DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if not (k.dtype == q.dtype and cos.dtype == q.dtype and sin.dtype == q.dtype):
        raise ValueError(f"q, k, cos and sin must share one dtype, got {q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}")
    if not (q.dim() == 3 and k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2]):
        raise ValueError(f"q and k must be [T, H, D] and [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[2] % 2:
        raise ValueError(f"head_dim must be even, got {q.shape[2]}")
    if not (q.stride(2) == 1 and k.stride(2) == 1):
        raise ValueError("q and k need unit stride along head_dim")
    if not (positions.dtype == torch.int64 and positions.shape == (q.shape[0],) and positions.is_contiguous()):
        raise ValueError(f"positions must be contiguous int64 [{q.shape[0]}], "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    if not (cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == q.shape[2]
            and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos and sin must be contiguous [max_positions, {q.shape[2]}], "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    _ops().rotary_embedding(positions, q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2I] = [gate | up]`` (unit stride along 2I) -> out ``[T, I]``."""
    if gate_up.device.type != "cpu":
        raise ValueError("gate_up must be on the CPU")
    if gate_up.dtype not in DTYPES:
        raise ValueError(f"gate_up must be float32, bfloat16 or float16, got {gate_up.dtype}")
    if not (gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and gate_up.stride(1) == 1):
        raise ValueError(f"gate_up must be [T, 2 * I] with unit stride along its last dimension, "
                         f"got {tuple(gate_up.shape)}")
    shape = (gate_up.shape[0], gate_up.shape[1] // 2)
    out = gate_up.new_empty(shape) if out is None else out
    if not (out.shape == shape and out.dtype == gate_up.dtype and out.is_contiguous() and out.device.type == "cpu"):
        raise ValueError(f"out must be a contiguous CPU tensor {shape} of {gate_up.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    _ops().silu_and_mul(out, gate_up)
    return out


def quantize_rows_uint8(x: torch.Tensor, static_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, N]`` (unit stride along N) -> (uint8 codes ``[T, N]``, float32 scales ``[T, 1]``): each row's
    int8 codes (int8_linear.quantize_per_token, or by ``static_scale`` where given) plus 128, as oneDNN's int8
    matmul takes activations."""
    if not (static_scale is None or static_scale > 0):
        raise ValueError(f"static_scale must be positive, got {static_scale}")
    if x.device.type != "cpu":
        raise ValueError("x must be on the CPU")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not (x.dim() == 2 and x.stride(1) == 1):
        raise ValueError(f"x must be [T, N] with unit stride along N, got {tuple(x.shape)}")
    codes = torch.empty(x.shape, dtype=torch.uint8)
    scales = torch.empty(x.shape[0], 1, dtype=torch.float32)
    _ops().quantize_rows_uint8(codes, scales, x, static_scale or 0.0)
    return codes, scales


def int8_epilogue(acc: torch.Tensor, row_scales: torch.Tensor | None, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``(acc * row_scales + bias).to(dtype)`` in one pass: the int8 matmul's float32 product ``acc [T, N]``
    (contiguous), each token's scale ``[T, 1]`` (None: 1), ``bias [N]`` (taken in ``dtype``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if not (acc.dtype == torch.float32 and acc.dim() == 2 and acc.is_contiguous()):
        raise ValueError(f"acc must be contiguous float32 [T, N], got {acc.dtype} {tuple(acc.shape)}")
    if not (bias is None or bias.shape == acc.shape[1:]):
        raise ValueError(f"bias must be [{acc.shape[1]}]")
    out = torch.empty(acc.shape, dtype=dtype)  # never acc itself: the op's schema says they do not alias
    _ops().int8_epilogue(out, acc, row_scales, None if bias is None else bias.to(dtype).contiguous())
    return out


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """int64 ``[rows]``: each row's argmax of ``scores [rows, n]`` (unit stride along n), exactly as
    ``torch.argmax`` chooses (the first of equal largest values; the first NaN, where a row has one), read in
    the scores' own dtype: bfloat16 logits need no float32 copy."""
    if scores.device.type != "cpu":
        raise ValueError("scores must be on the CPU")
    if scores.dtype not in DTYPES:
        raise ValueError(f"scores must be float32, bfloat16 or float16, got {scores.dtype}")
    if not (scores.dim() == 2 and scores.shape[1] > 0 and scores.stride(1) == 1):
        raise ValueError(f"scores must be [rows, n] with n > 0 and unit stride along n, got {tuple(scores.shape)}")
    out = torch.empty(scores.shape[0], dtype=torch.int64)
    _ops().argmax_rows(out, scores)
    return out


PANEL_DTYPES = (torch.float32, torch.bfloat16)


def has_panel_linear(dtype: torch.dtype) -> bool:
    """Whether the kernels were built with panel_linear for ``dtype`` (float32: AVX-512 or AVX2; bfloat16:
    AVX512-BF16)."""
    return dtype in PANEL_DTYPES and available() and _ops().has_panel_linear(dtype)


def pack_panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (float32, or bfloat16 with ``in`` even) in panel_linear's panels
    (csrc/panel_linear.cpp)."""
    if not (weight.dim() == 2 and weight.dtype in PANEL_DTYPES and weight.device.type == "cpu"):
        raise ValueError(f"weight must be a 2-d float32 or bfloat16 CPU tensor, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if weight.dtype == torch.bfloat16 and weight.shape[1] % 2:
        raise ValueError(f"a bfloat16 weight's in_features must be even, got {weight.shape[1]}")
    return _ops().pack_panel_weight(weight)


def panel_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [T, in] @ W.T + bias`` -> ``[T, out_features]`` of x's dtype: x with unit stride along ``in``,
    ``packed`` pack_panel_weight(W) of x's dtype, ``bias`` float32 ``[out_features]`` or None."""
    if not (x.dim() == 2 and x.dtype in PANEL_DTYPES and x.device.type == "cpu" and x.stride(1) == 1):
        raise ValueError(f"x must be a float32 or bfloat16 CPU tensor [T, in] with unit stride along in, "
                         f"got {x.dtype} {tuple(x.shape)}")
    if not (packed.dim() == 4 and packed.dtype == x.dtype and packed.shape[1] * packed.shape[3] == x.shape[1]
            and (packed.shape[0] - 1) * packed.shape[2] < out_features <= packed.shape[0] * packed.shape[2]):
        raise ValueError(f"packed {packed.dtype} {tuple(packed.shape)} is no packed weight of {out_features} x "
                         f"{x.shape[1]} in {x.dtype}")
    if not (bias is None or (bias.dtype == torch.float32 and bias.shape == (out_features,) and bias.is_contiguous())):
        raise ValueError(f"bias must be contiguous float32 [{out_features}]")
    out = torch.empty(x.shape[0], out_features, dtype=x.dtype)
    _ops().panel_linear(out, x, packed, bias)
    return out


def _check_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    if not (x.device.type == "cpu" and weight.device.type == "cpu" and out.device.type == "cpu"):
        raise ValueError("every tensor must be on the CPU")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if not (weight.dtype == x.dtype and out.dtype == x.dtype):
        raise ValueError(f"x, weight and out must share one dtype, got {x.dtype}, {weight.dtype}, {out.dtype}")
    if not (x.dim() >= 1 and weight.shape == x.shape[-1:] and weight.is_contiguous()):
        raise ValueError(f"weight must be contiguous [{x.shape[-1] if x.dim() else '?'}], got {tuple(weight.shape)}")
    if x.stride(-1) != 1:
        raise ValueError("x needs unit stride along its last dimension")
    if not (out.shape == x.shape and out.is_contiguous()):
        raise ValueError(f"out must be contiguous {tuple(x.shape)}, got {tuple(out.shape)}")


def _ops():
    """The registered ops, built (or loaded from the cache) on first use."""
    reason = cpu_kernels_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the C++ CPU kernels are unavailable: {reason}")
    return getattr(torch.ops, LIBRARY)
