"""The worker's allocator setting takes effect where the C library is glibc."""

from __future__ import annotations

import platform

import pytest

from services.worker.cpu_tuning import keep_large_allocations_in_heap


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_mallopt_is_accepted_on_glibc():
    assert keep_large_allocations_in_heap() is True
