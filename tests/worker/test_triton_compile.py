"""The Triton kernels compile for real GPUs: sm_80 (A100) and sm_90 (H100/H200), without one.

The interpreter tests check what the kernels compute; only lowering them shows whether they compile,
fit in shared memory, keep their tiles in registers and pipeline their K/V loads. This runs
benchmarks/triton_compile.py (compile-only, through the real wrappers) and reads its report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.services_harness import REPO

# The fixture compiles for two GPUs at once; beside another test process that takes up to two minutes
# here, and several on a machine that other work shares. COMPILE_LIMIT_S only bounds a hung compile.
COMPILE_LIMIT_S = 840.0
pytestmark = pytest.mark.timeout(COMPILE_LIMIT_S + 60)

KERNELS = {"_paged_attention_kernel", "_reduce_splits_kernel", "_write_kv_kernel", "_copy_blocks_kernel",
           "_grouped_matmul_kernel", "_wna16_kernel", "_w8a8_kernel"}
ARCHS = (80, 90)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton_compile")
    script = str(REPO / "benchmarks" / "triton_compile.py")
    # Both architectures at once: each compile is single-threaded.
    runs = {arch: subprocess.Popen([sys.executable, script, "--quick", "--arch", str(arch), "--out",
                                    str(out / f"sm{arch}.json")], cwd=REPO, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True) for arch in ARCHS}
    results, deadline = {}, time.monotonic() + COMPILE_LIMIT_S
    try:
        for arch, run in runs.items():
            output, _ = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert run.returncode == 0, f"sm_{arch}:\n{output[-6000:]}"
            results[arch] = json.loads((out / f"sm{arch}.json").read_text())
    finally:
        for run in runs.values():
            run.kill()
    return results


def attention(report: dict, *words: str) -> list[dict]:
    """The attention binaries whose case or constexprs mention every word."""
    found = [v for v in report["variants"] if v["kernel"] == "_paged_attention_kernel"
             and all(w in f"{v['case']} {v['constexprs']}" for w in words)]
    assert found, f"no attention binary for {words}"
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_without_spills_and_attention_is_pipelined(reports, arch):
    report = reports[arch]
    variants = report["variants"]
    fp8_gemm = {"_w8a8_block_fp8_kernel"} if arch >= 89 else set()  # no FP8 dot before sm_89
    assert {v["kernel"] for v in variants} == KERNELS | fp8_gemm
    assert all(v["ok"] and v["registers"] is not None for v in variants)
    assert all(v["spill_bytes"] <= report["spill_tolerance"] for v in variants if "USE_DOT=True" in v["constexprs"])
    # K and V each in at least one shared-memory buffer, filled by asynchronous copies (not yet with an FP8
    # cache: see benchmarks/triton_compile.py).
    assert all(v["tile_copies"] >= 2 and v["tile_buffers"] >= 1
               for v in attention(report, "USE_DOT=True", "FP8_KV=False"))
    assert attention(report, "FP8_KV=True")  # an FP8 cache's binaries compile
    assert attention(report, "KEY_LIMIT=True")  # and Gemma 3's images attending both ways
    # float32 runs its dots on CUDA cores; these tiles spilled kilobytes before FMA_ROWS / WIDE_WARPS.
    assert {v["dot"] for v in attention(report, "float32")} == {"fma"}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_new_block_table_width_or_tile_count_compiles_nothing_new(reports, arch):
    # "odd-decode" differs from "decode" only in what changes between serving steps (block-table width
    # 251 against 256, forced splits 31 against 32, other contexts): a binary of its own would be a
    # compile stall in the middle of serving. (Split counts in another power of two bring reduce
    # kernels of their own, which the worker's warm-up compiles: the test below.)
    assert not [v for v in reports[arch]["variants"] if " odd-decode " in v["case"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_after_the_worker_warm_up_serving_steps_compile_nothing(reports, arch):
    # The worker's kernel warm-up on the built-in model, then random serving steps (decodes at any
    # context, one-sequence batches that split-K serves, prefill chunks): each compile there is a stall.
    # Limits that are not powers of two were missed once: the longest query and context round up.
    warm_ups = reports[arch]["warm_ups"]
    assert {(w["label"], w["dtype"]) for w in warm_ups} == {("built-in", "float32"), ("MHA, odd limits", "bfloat16")}
    assert all(w["warm_up_binaries"] >= 5 and w["compiled_while_serving"] == 0 for w in warm_ups)


def test_sm90_prefill_tiles_use_warpgroup_mma(reports):
    # Hopper's tensor cores are reached through wgmma; a 16-bit prefill tile that fell back to mma.sync
    # (fewer than 64 rows, as D256 tiles had) runs at a fraction of the speed.
    prefill = attention(reports[90], " mixed ", "bfloat16")
    assert {v["case"].split("/")[2] for v in prefill} == {"D128", "D256"}
    assert all(v["dot"] == "wgmma" for v in prefill)


@pytest.mark.parametrize("arch", ARCHS)
def test_five_stages_give_decode_two_kv_buffers(reports, arch):
    # gpu_kernels.py times this against the default (one buffer each for K and V at 3 stages).
    (deep,) = attention(reports[arch], "stages=5")
    default = attention(reports[arch], "H32/KV8/D128/B16 bfloat16 decode split=False")
    assert deep["tile_buffers"] == 2 and all(v["tile_buffers"] == 1 for v in default)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_experts_compile_at_every_tile_height_without_spills(reports, arch):
    report = reports[arch]
    experts = [v for v in report["variants"] if v["kernel"] == "_grouped_matmul_kernel"]
    # Both projections (gate/up from the tokens' rows, down scaled by the routing weights), 16/32/64 rows.
    assert {(v["case"].split()[-2], v["case"].split()[-1], "ROWS_ARE_TOKENS=True" in v["constexprs"])
            for v in experts} == {(d, f"rows={m}", t) for d in ("bfloat16", "float32") for m in (16, 32, 64)
                                  for t in (True, False)}
    assert all(v["spill_bytes"] <= report["spill_tolerance"] for v in experts)
    assert {v["dot"] for v in experts if "float32" in v["case"]} == {"fma"}  # IEEE, not TF32
    if arch == 90:
        assert all(v["dot"] == "wgmma" for v in experts if "bfloat16 rows=64" in v["case"])
