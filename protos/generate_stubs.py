"""Generates the gRPC stubs of protos/ into libs/flotilla/api (the `flotilla.api` package, never edited by
hand and never committed). Called by the Makefile's `protos` target and by setup.py, so a wheel built from a
clean checkout carries its stubs. Needs grpcio-tools.

    python protos/generate_stubs.py [--if-stale]
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
OUT_ROOT = PROTO_ROOT.parent / "libs"
STUBS = OUT_ROOT / "flotilla" / "api"
STAMP = STUBS / ".generated"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def is_stale() -> bool:
    if not STAMP.exists():
        return True
    built = STAMP.stat().st_mtime
    return any(p.stat().st_mtime > built for p in proto_files())


def generate() -> None:
    from grpc_tools import protoc  # imported here: setup.py imports this module where grpc_tools may be absent

    shutil.rmtree(STUBS, ignore_errors=True)
    STUBS.mkdir(parents=True)
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={OUT_ROOT}", f"--pyi_out={OUT_ROOT}", f"--grpc_python_out={OUT_ROOT}",
            *map(str, proto_files())]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for folder in [STUBS, *(p for p in STUBS.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    STAMP.touch()


if __name__ == "__main__":
    if "--if-stale" not in sys.argv[1:] or is_stale():
        generate()
