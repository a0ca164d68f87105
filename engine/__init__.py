"""Model execution shared by prefill and decode workers.

Names are imported lazily so that ``import engine.block_hash`` (the gateway hashes
prompts with it) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "RequestOptions": "engine.request",
    "RequestOutput": "engine.request",
    "SamplingParams": "engine.sampling_params",
    "TokenLogprobs": "engine.request",
    "UnsupportedModelError": "engine.config",
}

__all__ = [
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOptions",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
    "UnsupportedModelError",
]

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig, UnsupportedModelError
    from engine.engine import Engine
    from engine.request import RequestOptions, RequestOutput, TokenLogprobs
    from engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
