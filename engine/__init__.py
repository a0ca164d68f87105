"""Model execution shared by prefill and decode workers."""

from engine.config import EngineConfig, ModelConfig, UnsupportedModelError
from engine.engine import Engine
from engine.request import RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams

__all__ = [
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprobs",
    "UnsupportedModelError",
]
