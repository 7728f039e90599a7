"""The generated protobuf code matches protos/ (regenerate: python -m shared.proto.generate)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from shared.proto import generate

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_is_current():
    done = subprocess.run([sys.executable, "-m", "shared.proto.generate", "--check"], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_the_check_notices_stale_code(tmp_path, monkeypatch):
    for path in generate.OUT.glob("*_pb2*.py*"):
        shutil.copy(path, tmp_path / path.name)
    stale = tmp_path / "pagedserve_api_pb2.py"
    stale.write_text(stale.read_text().replace("pagedserve", "pagedserv"))
    monkeypatch.setattr(generate, "OUT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["generate", "--check"])
    assert generate.main() == 1
