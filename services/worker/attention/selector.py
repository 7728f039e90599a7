"""Which attention backend a worker uses: "auto", "torch" or "triton"."""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device``; None when they can."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            return ("the device is a CPU and TRITON_INTERPRET=1 is not set (the Triton interpreter is slow and "
                    "meant for tests; set it before anything imports triton)")
        return None
    return f"Triton kernels run on CUDA devices (or a CPU under TRITON_INTERPRET=1), not on {device.type!r}"


def select_attention_backend(name: str, device: torch.device) -> type:
    """The backend class for ``name`` on ``device``; "auto" picks Triton on CUDA devices, torch elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "torch"
    if name == "torch":
        from services.worker.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention_backend='triton' cannot run here: {reason}; use 'torch' or 'auto'")
    from services.worker.attention.triton_attention import TritonAttentionBackend
    return TritonAttentionBackend
