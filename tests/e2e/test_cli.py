"""The main job as a user runs it: a real `tandem` process on the default model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TANDEM = [sys.executable, "-m", "tandem.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*TANDEM, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ})


def test_generate_local_streams_the_answer(default_model):
    proc = run("generate", "--local", "What is the capital of France?", "--max-tokens", "32",
               "--model", str(default_model))
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish=" in proc.stderr


def test_generate_without_local_says_what_to_do():
    proc = run("generate", "hello")
    assert proc.returncode == 2 and "--local" in proc.stderr


def test_bad_sampling_flag_is_a_clear_error(default_model):
    proc = run("generate", "--local", "hi", "--top-p", "0", "--model", str(default_model))
    assert proc.returncode == 2 and "top_p must be in (0, 1]" in proc.stderr


def test_fetch_model_is_idempotent(default_model):
    proc = run("fetch-model", timeout=60)  # already converted: returns at once
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == default_model
