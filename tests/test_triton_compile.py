"""The Triton kernels compile for real GPUs: sm_80 (A100) and sm_90 (H100/H200), without one.

The interpreter tests check what the kernels compute; only lowering them shows whether they compile,
fit in shared memory, keep their tiles in registers and pipeline their K/V loads. This runs
benchmarks/triton_compile.py (compile-only, through the real wrappers) and reads its report.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.services_harness import REPO

KERNELS = {"_paged_attention_kernel", "_reduce_splits_kernel", "_write_kv_kernel", "_copy_blocks_kernel"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton_compile")
    script = str(REPO / "benchmarks" / "triton_compile.py")
    # Both architectures at once: each compile is single-threaded.
    runs = {arch: subprocess.Popen([sys.executable, script, "--quick", "--arch", str(arch), "--out",
                                    str(out / f"sm{arch}.json")], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for arch in (80, 90)}
    results = {}
    for arch, run in runs.items():
        try:
            output, _ = run.communicate(timeout=400)
        finally:
            run.kill()
        results[arch] = (run.returncode, output, json.loads((out / f"sm{arch}.json").read_text()))
    return results


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_compiles_without_spills_and_attention_is_pipelined(reports, arch):
    returncode, output, report = reports[arch]
    assert returncode == 0, output[-6000:]
    variants = report["variants"]
    assert {v["kernel"] for v in variants} == KERNELS
    assert all(v["ok"] and v["registers"] is not None for v in variants), output[-6000:]
    attention = [v for v in variants if v["kernel"] == "_paged_attention_kernel"]
    assert all(v["async_copies"] > 0 for v in attention)
    # float32 runs its dots on CUDA cores; these tiles spilled kilobytes before FMA_ROWS / WIDE_WARPS.
    fp32 = [v for v in attention if "float32" in v["case"]]
    assert fp32 and all(v["spill_bytes"] <= 64 for v in fp32) and {v["dot"] for v in fp32} == {"fma"}


def test_sm90_prefill_tiles_use_warpgroup_mma(reports):
    # Hopper's tensor cores are reached through wgmma; a 16-bit prefill tile that fell back to mma.sync
    # (fewer than 64 rows, as D256 tiles had) runs at a fraction of the speed.
    _, _, report = reports[90]
    prefill = [v for v in report["variants"] if v["kernel"] == "_paged_attention_kernel" and " mixed " in v["case"]
               and "bfloat16" in v["case"]]
    assert {v["case"].split("/")[2] for v in prefill} == {"D128", "D256"}
    assert all(v["dot"] == "wgmma" for v in prefill)
