"""benchmarks/gpu_real_size.py, issue 34's run at real size, runs through on this machine.

``--cpu-smoke`` takes every section with a toy model of the same layout (the checkpoint it writes, the
engine started on it, decode and prefill steps, the offline engine against the whole stack, LoRA
adapters through the engine); this checks that each section ends "ok" and leaves what the GPU run's
report is read from. Its timings mean nothing and are not looked at.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import pytest

from tests.services_harness import REPO, RUN_LIMIT_S, free_port

try:  # (the version from the metadata: importing triton here would decide interpreted or compiled)
    TRITON_VERSION = importlib.metadata.version("triton")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("triton is not installed", allow_module_level=True)
if tuple(int(part) for part in TRITON_VERSION.split(".")[:2]) < (3, 7):
    pytest.skip(f"the Triton {TRITON_VERSION} interpreter cannot run the kernels", allow_module_level=True)


def test_every_section_runs_and_reports(tmp_path):
    out = tmp_path / "real.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_real_size.py"), "--cpu-smoke", "--out",
                          str(out), "--model-dir", str(tmp_path / "model"), "--port", str(free_port(span=2))],
                         cwd=REPO, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    sections = json.loads(out.read_text())["sections"]
    names = ("roofline", "checkpoint", "startup", "decode", "prefill", "serving", "lora")
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(names, "ok"), run.stdout[-6000:]
    decode = sections["decode"]["cases"]
    assert {(row["batch"], row["context"]) for row in decode} == {(b, c) for b in (1, 2, 4) for c in (64, 256)}
    assert all(row["step_ms"] > 0 and 0 < row["fraction_of_roofline"] for row in decode)
    assert [row["prompts"] for row in sections["prefill"]["forward"]] == [1, 2]
    assert all(row["speed_vs_sdpa"] > 0 for row in sections["prefill"]["attention"])
    serving = sections["serving"]
    assert serving["serving"]["output_tokens"] == serving["offline"]["output_tokens"] == 4 * 8
    assert serving["serving_over_offline"] > 0
    assert sections["lora"]["tokens_equal_eager"] is True
