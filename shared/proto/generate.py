"""Regenerates the Python code of protos/ into shared/proto/ (grpcio-tools, with .pyi stubs).

    python -m shared.proto.generate            # write
    python -m shared.proto.generate --check    # exit 1 if the checked-in code is out of date
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTOS = ROOT / "protos"
OUT = Path(__file__).resolve().parent
FILES = ("pagedserve_api.proto", "pagedserve_internal.proto")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    for name in FILES:
        args = ["protoc", f"-I{PROTOS}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
                f"--grpc_python_out={out_dir}", str(PROTOS / name)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {name}")
    generated = sorted(p for p in out_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))
    for path in generated:
        _make_imports_package_relative(path)
    return generated


def _make_imports_package_relative(path: Path) -> None:
    # protoc writes `import pagedserve_api_pb2`; inside shared.proto it must be a relative import.
    text = path.read_text()
    for name in FILES:
        module = name.removesuffix(".proto") + "_pb2"
        text = text.replace(f"\nimport {module} as", f"\nfrom . import {module} as")
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if not args.check:
        for path in generate(OUT):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in generate(Path(tmp))
                 if not (OUT / p.name).exists() or not filecmp.cmp(p, OUT / p.name, shallow=False)]
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m shared.proto.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
