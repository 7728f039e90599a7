"""The worker's CPU memory settings: the allocator threshold (glibc) and huge-page advice for the KV pools."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from services.worker.cpu_tuning import advise_huge_pages, keep_large_allocations_in_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_mallopt_is_accepted_on_glibc():
    assert keep_large_allocations_in_heap() is True


def test_huge_page_advice_needs_a_whole_aligned_huge_page():
    assert advise_huge_pages(torch.empty(1024)) is False  # 4 KiB: no 2 MiB page inside it


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="transparent huge pages are not available")
def test_huge_page_advice_on_a_large_tensor():
    tensor = torch.empty(3 << 20)  # 12 MiB: at least five aligned huge pages inside
    assert advise_huge_pages(tensor) is True
    tensor.fill_(1.5)  # still ordinary memory
    assert float(tensor.sum()) == 1.5 * tensor.numel()


@pytest.mark.parametrize("dtype, probe", [(torch.bfloat16, "_is_mkldnn_bf16_supported"),
                                          (torch.float16, "_is_mkldnn_fp16_supported")])
@pytest.mark.parametrize("native", [True, False])
def test_half_precision_without_cpu_instructions_warns(dtype, probe, native, monkeypatch):
    from structlog.testing import capture_logs

    from services.worker.worker_startup import warn_if_emulated

    monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: native)
    with capture_logs() as logs:
        assert warn_if_emulated(dtype, torch.device("cpu")) is (not native)
        assert warn_if_emulated(torch.float32, torch.device("cpu")) is False
        assert warn_if_emulated(dtype, torch.device("meta")) is False  # (a GPU's dtype is its own affair)
    warned = [entry for entry in logs if entry["event"] == "dtype_emulated_on_this_cpu"]
    assert len(warned) == (0 if native else 1)
    if warned:
        assert warned[0]["log_level"] == "warning" and "--dtype float32" in warned[0]["hint"]
