"""Where tandem keeps what it fetches and builds: one folder, ``$TANDEM_HOME``.

Services, the CLI and the launcher all ask here, so a model converted by ``tandem fetch-model``
is the one a worker serves and a kernel built by ``tandem build-kernels`` is the one it loads.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def tandem_home() -> Path:
    """``$TANDEM_HOME``, else ``~/.cache/tandem``."""
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem").expanduser()


def default_model_dir(home: Path | None = None) -> Path:
    """The folder the default model is converted into (it may not exist yet)."""
    return (home or tandem_home()) / "models" / DEFAULT_MODEL_NAME


def kernels_dir(home: Path | None = None) -> Path:
    """The parent of the engine's compiled CPU kernel builds (one subfolder per source and CPU)."""
    return (home or tandem_home()) / "kernels"


def model_folder(model: str | Path) -> Path:
    """The folder of a model given as a folder or as a ``.gguf`` file in one (config.json and the
    tokenizer lie beside the file)."""
    path = Path(model).expanduser()
    return path.parent if path.suffix == ".gguf" else path
