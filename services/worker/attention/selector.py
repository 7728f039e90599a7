"""Which attention backend a worker uses: "auto", "torch", "cpu" or "triton"."""

from __future__ import annotations

import importlib.util
import os

import structlog
import torch

from shared.config import ATTENTION_BACKENDS as BACKENDS

log = structlog.get_logger(__name__)



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
    """The backend class for ``name`` on ``device``.

    "auto" picks Triton on CUDA devices, the C++ kernels on CPUs (built on first use; the
    pure-PyTorch backend where they cannot be built), torch elsewhere.
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        name = _auto_backend(device)
    if name == "torch":
        from services.worker.attention.torch_ref import TorchAttentionBackend
        return TorchAttentionBackend
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on CPUs, not on {device.type!r}")
        from services.worker.attention.cpu_attention import CpuAttentionBackend
        return CpuAttentionBackend
    reason = triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention_backend='triton' cannot run here: {reason}; use 'torch' or 'auto'")
    from services.worker.attention.triton_attention import TritonAttentionBackend
    return TritonAttentionBackend


def _auto_backend(device: torch.device) -> str:
    if device.type == "cuda" and triton_unavailable_reason(device) is None:
        return "triton"
    if device.type == "cpu":
        from services.worker.attention.cpu_kernels import cpu_kernels_unavailable_reason

        reason = cpu_kernels_unavailable_reason()
        if reason is None:
            return "cpu"
        log.warning("cpu_kernels_unavailable", reason=reason, fallback="torch")
    return "torch"
