"""The committed stubs are what protoc makes of the committed .proto files (ARCHITECTURE.md, wire contracts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    protos = sorted((ROOT / "protos").glob("*.proto"))
    assert protos, "no .proto files under protos/"
    (tmp_path / "protos").mkdir()
    for p in protos:
        shutil.copy(p, tmp_path / "protos" / p.name)
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.", "--grpc_python_out=."]
    subprocess.run(cmd + [f"protos/{p.name}" for p in protos], cwd=tmp_path, check=True)
    for fresh in sorted((tmp_path / "protos").glob("*_pb2*.py*")):
        committed = ROOT / "protos" / fresh.name
        assert committed.is_file(), f"{committed} is missing: run the protoc command of ARCHITECTURE.md"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale: regenerate the stubs with the grpcio-tools that pyproject.toml pins"
        )
