"""The worker's CPU memory settings: the allocator threshold (glibc) and huge-page advice for the KV pools."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from services.worker.cpu_tuning import advise_huge_pages, cache_size_bytes, keep_large_allocations_in_heap, l2_cache_bytes


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


@pytest.mark.parametrize("text, size", [("512K\n", 512 << 10), ("1024K", 1 << 20), ("2M", 2 << 20), ("65536", 65536)])
def test_cache_sizes_as_sysfs_writes_them(text, size):
    assert cache_size_bytes(text) == size


def test_the_l2_is_the_level_2_entry_of_sysfs(tmp_path):
    for index, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K"),
                                                 (3, "Unified", "32768K")]):
        entry = tmp_path / f"index{index}"
        entry.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (entry / name).write_text(f"{value}\n")
    assert l2_cache_bytes.__wrapped__(tmp_path) == 1 << 20
    assert l2_cache_bytes.__wrapped__(tmp_path / "absent") is None
