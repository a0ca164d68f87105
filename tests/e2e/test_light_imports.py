"""What must load without torch, checked in a fresh interpreter (this one has torch loaded already)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_layout_and_refs_load_without_torch():
    """The launcher sizes kvstore slots and the kvstore server keeps blocks by ref without an engine."""
    code = "import sys, engine.block_hash, kvstore.control, tandem.launcher; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
