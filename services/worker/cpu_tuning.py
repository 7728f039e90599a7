"""Process settings that make CPU inference faster; applied by the worker when it runs on a CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from pathlib import Path

import torch

# glibc mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


def keep_large_allocations_in_heap() -> bool:
    """Serve activations up to 32 MiB from the heap and keep freed memory for reuse.

    By default glibc maps every allocation above 128 KiB afresh and unmaps it on free, so each
    layer's activations page-fault in new zeroed pages: measured here, a fifth of a prefill step.
    (vLLM's CPU backend preloads tcmalloc for the same reason.) Returns False where the C library
    is not glibc; nothing changes then.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


MADV_HUGEPAGE = 14  # asm-generic/mman-common.h
HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back ``tensor``'s (2 MiB-aligned interior) memory with transparent huge pages.

    For the KV pools: decode attention reads blocks scattered over gigabytes, and with 4 KiB pages
    nearly every block costs a TLB miss (measured here: the CPU decode kernel ~15 % faster with huge
    pages). Call it before the memory is first touched. False where madvise is unavailable or refused
    (THP disabled); nothing changes then.
    """
    start = (tensor.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def has_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's (and torch's fused attention's) bfloat16 products use."""
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (the C++ kernels, built for it with -march=native, then use its 32 registers)."""
    return getattr(torch.cpu, "_is_avx512_supported", lambda: False)()


@functools.cache
def l2_cache_bytes(cache_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """One core's L2 cache in bytes (CPU 0's, as Linux reports it); None where it does not say."""
    for index in sorted(cache_dir.glob("index*")):
        try:
            if (index / "level").read_text().strip() == "2":
                return cache_size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
    return None


def cache_size_bytes(text: str) -> int:
    """sysfs's cache size (``512K``, ``1024K``, ``2M``) in bytes."""
    text = text.strip().upper()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if unit > 1 else text) * unit


def runs_emulated(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether matrix multiplies in ``dtype`` on ``device`` lack the CPU's own instructions for it (oneDNN's
    test: bfloat16 needs AVX512-BF16 or AMX, float16 AVX512-FP16 or AMX-FP16). They then run converted a few
    values at a time: the bench model decoded 76 tokens/s in bfloat16 against 465 in float32 on a Zen 3."""
    if device.type != "cpu":
        return False
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False
