"""benchmarks/gpu_kernels.py, the one script a GPU session runs, runs through on this machine.

A device session has minutes, not hours: a section that breaks there costs its results. ``--cpu-smoke``
takes every code path at toy sizes under the Triton interpreter; this checks that each section ends
"ok", that its checks pass and that the report holds what RESULTS.md is filled from. Its timings mean
nothing and are not looked at.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from tests.services_harness import REPO, RUN_LIMIT_S

# The version from the package metadata: importing triton here, before the interpreter tests set
# TRITON_INTERPRET=1, would leave their kernels compiled for a GPU instead of interpreted.
try:
    TRITON_VERSION = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("triton is not installed", allow_module_level=True)
if tuple(int(part) for part in TRITON_VERSION.split(".")[:2]) < (3, 7):  # as tests/worker/test_triton_kernels.py
    pytest.skip(f"the Triton {TRITON_VERSION} interpreter cannot run the kernels", allow_module_level=True)

SCRIPT = str(REPO / "benchmarks" / "gpu_kernels.py")
ALL_SECTIONS = "check,decode,prefill,cache,engine,tune,tune_prefill,wna16,w8a8"


def run_script(tmp_path, *args: str) -> dict:
    out = tmp_path / "gpu_kernels.json"
    run = subprocess.run([sys.executable, SCRIPT, "--cpu-smoke", "--out", str(out), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_section_runs_and_checks_pass(tmp_path):
    # The script's own deadline skips what is left: generous, a busy machine must not skip a section.
    results = run_script(tmp_path, "--sections", ALL_SECTIONS, "--deadline", str(RUN_LIMIT_S - 60))
    sections = results["sections"]
    assert {name: s["status"] for name, s in sections.items()} == {name: "ok" for name in ALL_SECTIONS.split(",")}
    checks = sections["check"]["cases"]
    assert sections["check"]["all_ok"] and all(case["ok"] for case in checks)
    assert {(c["dtype"], c["split_k"]) for c in checks if "dtype" in c} == {
        (dtype, split) for dtype in ("float32", "bfloat16") for split in (False, True)}
    assert {c["op"] for c in checks if "op" in c} == {"write_kv", "copy_blocks", "swap_round_trip"}
    assert results["targets"]["greedy_ok"] and sections["engine"]["triton_compiles_after_warm_up"] == []
    assert sections["engine"]["windowed_greedy_ok"], sections["engine"]
    for row in sections["decode"]["cases"]:
        assert row["paged_graph_us"] > 0 and row["sdpa_graph_us"] > 0 and "speed_vs_sdpa_graph" in row
    assert isinstance(results["targets"]["decode_speed_met_graph"], bool)
    tune = sections["tune"]["cases"]
    assert [(case["batch"], case["ctx"]) for case in tune] == [(1, 520), (2, 32)]
    for case in tune:
        variants = case["variants"]
        assert variants[0]["default"] and all(v.get("ok") for v in variants), variants
        assert case["default_matches_reference"]
        assert case["best"] in variants
    split_counts = {v["num_splits"] for v in tune[0]["variants"]}
    assert len(split_counts) > 1, "the split case tries other split counts"
    assert {"write_kv", "copy_blocks", "swap"} <= set(sections["cache"])
    wna16 = sections["wna16"]
    assert wna16["all_ok"] and [(c["bits"], c["batch"]) for c in wna16["cases"]] == [(4, 1), (4, 4), (8, 1), (8, 4)]
    w8a8 = sections["w8a8"]
    schemes = ["int8", "fp8 per row", "fp8 block 128"]
    assert w8a8["all_ok"] and [(c["batch"], c["scheme"]) for c in w8a8["cases"]] == \
        [(batch, scheme) for batch in (1, 4) for scheme in schemes]
    assert isinstance(results["targets"]["bandwidth_met"], bool)
    prefill_tune = sections["tune_prefill"]["cases"]
    assert [case["label"] for case in prefill_tune] == ["causal 40", "24 after 16 + 2 decodes"]
    for case in prefill_tune:
        variants = case["variants"]
        assert variants[0]["default"] and len(variants) > 1 and all(v.get("ok") for v in variants), variants
        assert case["best"] in variants


def test_a_spent_deadline_skips_sections_but_writes_the_report(tmp_path):
    results = run_script(tmp_path, "--sections", "decode,tune", "--deadline", "3")
    assert all(s["status"].startswith("skipped") for s in results["sections"].values()), results["sections"]
    assert set(results["sections"]) == {"decode", "tune"}
    assert results["environment"]["cpu_smoke"] is True


def test_outputs_are_compared_relative_to_their_scale():
    """Long-context outputs are small: an all-zero or a partly wrong one must not pass as close."""
    import torch

    from benchmarks.gpu_kernels import compare_outputs

    ref = torch.randn(64, 8, 128, generator=torch.Generator().manual_seed(0)) * 0.03
    assert compare_outputs(ref.to(torch.bfloat16), ref, "bfloat16")[1]
    assert not compare_outputs(torch.zeros_like(ref), ref, "bfloat16")[1]
    assert not compare_outputs(ref * 0.9, ref, "bfloat16")[1]  # a tenth of the weight lost, as a dropped split
    poisoned = ref.clone()
    poisoned[3, 2, 1] = float("nan")
    assert not compare_outputs(poisoned, ref, "float32")[1]
